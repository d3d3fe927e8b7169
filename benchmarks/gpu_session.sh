#!/usr/bin/env bash
# The device checks in one command that cannot lose its results, for a session lent a GPU machine (the
# H200 kind: python3 3.12, torch 2.11+cu130, lightning 2.6.6, pytest-timeout; no DeepSpeed, no
# hydra-core, which nothing here imports; no network). On the device tool:
#
#   bash benchmarks/build_gpu_wheels.sh          # here, once: .gpu_wheels (DeepSpeed and what it needs)
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600, carry=[".gpu_wheels"])
#
# and leave the rest of the session's 15 minutes for one rerun. Everything lands in $OUT (./gpu_out
# elsewhere) as it happens, in at most 8 files (what the tool brings back): session.log (every stage's
# output; df -T and nvidia-smi first), disk.json (each candidate offload directory's filesystem and
# O_DIRECT probe, the choice), machine.json (the rates the roofline uses), tests.jsonl and tests.log
# (each CUDA test's outcome as it ends), rows.jsonl (each benchmark row as it ends, failures
# included: benchmarks/gpu.py, gpu_deepspeed.py), stages.jsonl (each stage's exit status and seconds).
# A stage that fails or runs out of time is recorded and the next one runs; the summary table at the
# end is printed from whatever rows exist. Exit status: 1 if any stage failed.
#
# Stages, in order of value, each under its own `timeout` (seconds; 535 in all, under the 540 planned
# for a 600 s command), and what each should take on an H200 by arithmetic. Taken from here (a shared
# 2-core CPU box): python + torch + lightning + the package import in 5.4 s (~4 s on the H200 box's
# cores), pytest collecting tests/gpu in 11 s (~8 s). From the H200 machine's notes: bf16 matmul
# ~800 TFLOP/s at 8192^3 (~350 effective at n_embd 1024), disk ~1.2 GB/s O_DIRECT read and ~2.2 GB/s
# write, pinned copies ~55 GB/s both ways (~25 each), 16 cores; CUDA's start ~3 s per process. The
# benchmark model (benchmarks/gpu.py): GPT n_embd 1024, 8 layers, vocab 16384, seq 1024, micro-batch 4:
# P ~135 M parameters, 16 k tokens per step at K=4 (model FLOPs ~1.2e13: ~35 ms in memory); 4 optimizer
# steps per run, the last 2 timed; each run a fresh process (~12 s of start-up, greedysnake's set-up and
# auto=True's measurements at step 2 included; Lightning's ~9 s).
#   disk      30 s  (expect ~12): O_DIRECT probe of each candidate; 256 MiB x3 each way (~1 s), the
#                   host AdamW rate, the GPU's matmul rate and pinned bandwidth, CUDA's start.
#   tests    135 s  (expect ~125): tests/gpu, 26 tests, each ~2 small fits of ~2.5 s; a test times out
#                   after 40 s (pytest-timeout, in the image), its pytest is killed 10 s later where no
#                   signal reaches (a CUDA hang) and started again on the rest (benchmarks/pytest_stage.py).
#   headline 105 s  (expect ~85): GreedySnakeStrategy() with its state forced off the device (an eighth
#                   of it as auto_device_budget_bytes; the state, 2.4 GB, goes to RAM, about half the
#                   compute weights stay on the GPU) against Lightning in memory and the horizontal order,
#                   at K 4 and 8: 2 x 9 s + 4 x 15 s of runs; steps of ~0.1-0.4 s (host AdamW over 135 M
#                   elements at 0.3-2 G/s binds; horizontal K=8 moves ~6.5 GB over PCIe, ~0.3 s).
#   resident  40 s  (expect ~25): the resident-weights system (every kind on SSD but the compute
#                   weights on the GPU), K=8: 16P = 2.2 GB read (1.8 s) and written (1.0 s) per step.
#   rest      75 s  (expect ~72): every kind on SSD (ZeRO-Infinity's placement), K=8: vertical (20P read,
#                   18P written: ~3.4 s a step, ~27 s), then horizontal (the weights read 2K times:
#                   +4.3 GB, ~8 s a step, ~45 s; skipped and recorded if the stage runs short).
#   deepspeed 140 s (expect ~120): the wheels installed (~5 s; 3.6 s here), DeepSpeed's async_io and
#                   cpu_adam ops compiled side by side (~200 s on this box's 2 cores, as compare.py
#                   quotes it: ~400 CPU-seconds, ~70 s on 16 cores, the longest file bounding it),
#                   ZeRO-Infinity (parameters and optimizer on NVMe) at K=8 (~15 s of start and init;
#                   ~6.5 s a step: the parameters read per micro-batch, 32P = 4.3 GB, and the optimizer
#                   state, 16P each way).
#   summary   10 s  (expect ~1): the table from rows.jsonl.
# Expected ~440 s in all, 535 at most.
#
# --dry-run: the whole script on a CPU in a minute or two (CI runs it; 127 s, 50 CPU-seconds, on this
# shared 2-core box under load): the simulated device
# (GREEDYSNAKE_SIMULATE_DEVICE=1), tiny sizes, every benchmark configuration once at K=2 in-process,
# the CUDA tests collected (and skipped), DeepSpeed's stage as far as it goes (where DeepSpeed is
# missing, a recorded failure); OUT defaults to a fresh temporary folder there.
set -u -o pipefail
cd "$(dirname "$0")/.."
repo=$PWD
dry=()
if [ "${1:-}" = "--dry-run" ]; then
    dry=(--dry-run)
    export GREEDYSNAKE_SIMULATE_DEVICE=1
    OUT=${OUT:-$(mktemp -d)}
elif [ $# -gt 0 ]; then
    echo "usage: bash benchmarks/gpu_session.sh [--dry-run]" >&2
    exit 2
fi
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
log="$OUT/session.log"
status=0
start=$SECONDS

# stage NAME SECONDS COMMAND...: COMMAND under `timeout` (killed 5 s after), its output into session.log,
# its exit status and seconds into stages.jsonl; a failure is remembered and the next stage runs.
stage() {
    local name=$1 seconds=$2 t0=$SECONDS rc
    shift 2
    echo "== $name: at most ${seconds} s (at $((SECONDS - start)) s)" | tee -a "$log"
    timeout -k 5 "$seconds" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"budget_s\": $seconds}" >> "$OUT/stages.jsonl"
    echo "== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (its timeout)')" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

{ echo "== machine"; date -u; df -T; nvidia-smi 2>&1 | head -20; } >> "$log" 2>&1
# the offload directory: the first on a real disk where O_DIRECT works (the repository's, $HOME's, then
# /tmp's, which may be a tmpfs there): the disk stage probes each and says
candidates=("$repo/.gpu_offload" "${HOME:-/root}/.greedysnake_gpu_offload" "/tmp/greedysnake_gpu_offload")
stage disk 30 python3 benchmarks/gpu.py disk "${dry[@]}" --out "$OUT" --candidates "${candidates[@]}"
offload=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['chosen'])" "$OUT/disk.json" 2>/dev/null \
          || echo "${candidates[0]}")
echo "== offload directory: $offload" | tee -a "$log"

stage tests 135 python3 benchmarks/pytest_stage.py --out "$OUT" --budget-s 130 --test-timeout-s 40 --grace-s 10 \
    -- -m gpu tests/gpu
for s in headline:105 resident:40 rest:75; do
    stage "${s%%:*}" "${s##*:}" python3 benchmarks/gpu.py "${s%%:*}" "${dry[@]}" --out "$OUT" \
        --offload-dir "$offload" --budget-s $((${s##*:} - 5))
done
stage deepspeed 140 python3 benchmarks/gpu_deepspeed.py "${dry[@]}" --out "$OUT" --offload-dir "$offload" --k 8 \
    --budget-s 135 --wheels "$repo/.gpu_wheels"
stage summary 10 python3 benchmarks/gpu.py summary --out "$OUT"

for c in "${candidates[@]}"; do  # (the offload files; only the directories this script names)
    [ "$c" = "$offload" ] && rm -rf "$offload"
done
echo "== done in $((SECONDS - start)) s, exit $status; results in $OUT" | tee -a "$log"
exit $status
