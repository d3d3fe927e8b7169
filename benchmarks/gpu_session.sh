#!/usr/bin/env bash
# The device checks in one command that cannot lose its results, for a session lent a GPU machine: an
# H100 (80 GB) or an H200 (141 GB), either kind (python3 3.12, torch 2.11+cu130, lightning 2.6.6,
# pytest-timeout; no DeepSpeed, no hydra-core, which nothing here imports; no network). First, here:
#
#   bash benchmarks/check_gpu_image.sh           # the dry run under the image's versions (CI runs it too)
#   bash benchmarks/build_gpu_wheels.sh          # .gpu_wheels (DeepSpeed and what it needs)
#
# then on the device tool, as the first call:
#
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=420, carry=[".gpu_wheels"])
#
# It ends within 400 s, leaving the session's 15 minutes of device time room for a second, shorter call
# (the machine stays warm only ~30 s after a call: plan the second one before the first returns).
# Everything lands in $OUT (./gpu_out elsewhere) as it happens, in the 8 files the tool brings back:
# session.log (every stage's output; df -T and nvidia-smi first), disk.json (each candidate offload
# directory's filesystem and O_DIRECT probe, the choice), machine.json (the GPU, its datasheet bf16 peak,
# the measured rates), tests.jsonl and tests.log (each CUDA test's outcome as it ends), rows.jsonl (each
# benchmark row as it ends, failures included: benchmarks/gpu.py, gpu_deepspeed.py), stages.jsonl (each
# stage's exit status, seconds and budget), gpu.json (the rows with MFU and the roofline, for
# benchmarks/report.py's GPU table). A stage that fails or runs out of time is recorded and the next one
# runs; the summary at the end is printed from whatever rows exist. Exit status: 1 if any stage failed.
#
# Stages, in order of value, each under its own `timeout` (seconds; 381 in all, plus ~10 s of the
# script's own; without it the DeepSpeed stage's seconds go to the benchmark stages).
# Each benchmark configuration's expected seconds are beside it in benchmarks/gpu.py's STAGES (an
# estimate until the first GPU run measures them); its child gets twice that, settle() included, less
# where the stage's later configurations need theirs (a hung configuration costs its own timeout, and
# the others still run). The model (benchmarks/gpu.py): GPT n_embd 1024, 8 layers, vocab 16384, seq 1024,
# micro-batch 4: P ~135 M parameters, 16 k tokens per step at K=4 (~35 ms of compute on either card);
# 5 optimizer steps per run, the last 3 timed (after auto=True's warm-step plan at step 2).
#   disk      15 s  (expect ~10): O_DIRECT probe of each candidate; 256 MiB x3 each way, the host AdamW
#                   rate, the GPU's name, its matmul rate and pinned bandwidth, CUDA's start.
#   tests     80 s  (expect ~65): tests/gpu, 23 tests, in order of value: the smoke test first (an O_DIRECT
#                   buffer registered, a round trip through CudaCopies, a failed registration's error
#                   cleared), copy ordering, the three no-hidden-sync tests, memory, then the trimmed
#                   equivalence matrix; each ~2 small fits of ~1 s; written under the offload disk
#                   (--basetemp), never a tmpfs. A test times out after 40 s (pytest-timeout), its pytest
#                   is killed 10 s later where no signal reaches (a CUDA hang) and started again on the rest
#                   (benchmarks/pytest_stage.py). Beside it, where .gpu_wheels exists: DeepSpeed's
#                   install and op build (gpu_deepspeed.py build: async_io and cpu_adam compiled side by
#                   side, ~70 s on 16 cores), under the same 80 s (the tests time nothing).
#   headline 102 s  (expect ~89): GreedySnakeStrategy() with its state forced off the device (an eighth
#                   of it as auto_device_budget_bytes) against Lightning in memory and the horizontal
#                   order, at K 4 and 8.
#   resident  32 s  (expect ~26): the resident-weights system (every kind on SSD but the compute weights
#                   on the GPU), K=8.
#   rest      92 s  (expect ~80): every kind on SSD (ZeRO-Infinity's placement), K=8: vertical_ssd, then
#                   horizontal_ssd: the vertical-against-horizontal pair.
#   deepspeed 55 s  (expect ~45): ZeRO-Infinity (parameters and optimizer on NVMe) at K=8, on the ops the
#                   build compiled (gpu_deepspeed.py run). Without .gpu_wheels: 5 s (its failure recorded),
#                   the other 50 s to headline (+22), resident (+6) and rest (+22).
#   summary    5 s  (expect ~1): the table and gpu.json from rows.jsonl.
#
# --dry-run: the whole script on a CPU in about two minutes (CI runs it): the simulated device
# (GREEDYSNAKE_SIMULATE_DEVICE=1), tiny sizes, every benchmark configuration once at K=2, each in a child
# process under its timeout as on the GPU (each expecting 15 s), the CUDA tests collected (and skipped),
# DeepSpeed's stage as far as it goes (where .gpu_wheels is missing, a recorded failure); OUT defaults to a
# fresh temporary folder there.
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
wheels=$repo/.gpu_wheels

# the stages' seconds (tests/unit/test_gpu_session.py: gpu.py's expected times fit them, and they add to
# at most 400 with the script's own)
DISK_S=15 TESTS_S=80 HEADLINE_S=102 RESIDENT_S=32 REST_S=92 DEEPSPEED_S=55 SUMMARY_S=5
if ! ls "$wheels"/*.whl >/dev/null 2>&1; then  # no DeepSpeed to run: its time goes to the benchmark stages
    HEADLINE_S=$((HEADLINE_S + 22)) RESIDENT_S=$((RESIDENT_S + 6)) REST_S=$((REST_S + 22)) DEEPSPEED_S=5
    have_wheels=0
else
    have_wheels=1
fi

# record NAME RC SECONDS BUDGET: one line of stages.jsonl
record() {
    echo "{\"stage\": \"$1\", \"rc\": $2, \"seconds\": $3, \"budget_s\": $4}" >> "$OUT/stages.jsonl"
}

# stage NAME SECONDS COMMAND...: COMMAND under `timeout` (killed 5 s after), its output into session.log,
# its exit status and seconds into stages.jsonl; a failure is remembered and the next stage runs.
stage() {
    local name=$1 seconds=$2 t0=$SECONDS rc
    shift 2
    echo "== $name: at most ${seconds} s (at $((SECONDS - start)) s)" | tee -a "$log"
    timeout -k 5 "$seconds" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    record "$name" "$rc" $((SECONDS - t0)) "$seconds"
    echo "== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (its timeout)')" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

{ echo "== machine"; date -u; df -T; nvidia-smi 2>&1 | head -20; } >> "$log" 2>&1
# the offload directory: the first on a real disk where O_DIRECT works (the repository's, $HOME's, then
# /tmp's, which may be a tmpfs there): the disk stage probes each and says
candidates=("$repo/.gpu_offload" "${HOME:-/root}/.greedysnake_gpu_offload" "/tmp/greedysnake_gpu_offload")
stage disk "$DISK_S" python3 benchmarks/gpu.py disk "${dry[@]}" --out "$OUT" --candidates "${candidates[@]}"
offload=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['chosen'])" "$OUT/disk.json" 2>/dev/null \
          || echo "${candidates[0]}")
echo "== offload directory: $offload" | tee -a "$log"

build_pid=
if [ "$have_wheels" = 1 ]; then  # DeepSpeed's install and op build beside the tests (which time nothing)
    echo "== deepspeed_build: beside the tests, at most ${TESTS_S} s (at $((SECONDS - start)) s)" | tee -a "$log"
    (
        t0=$SECONDS
        timeout -k 5 "$TESTS_S" python3 benchmarks/gpu_deepspeed.py build "${dry[@]}" --out "$OUT" \
            --offload-dir "$offload" --budget-s $((TESTS_S - 3)) --wheels "$wheels" 2>&1 \
            | sed -u 's/^/[deepspeed_build] /' >> "$log"
        rc=${PIPESTATUS[0]}
        record deepspeed_build "$rc" $((SECONDS - t0)) "$TESTS_S"
        echo "== deepspeed_build: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
        exit "$rc"
    ) &
    build_pid=$!
fi
# (--basetemp: the tests' files on the offload disk, O_DIRECT-capable; pytest empties that folder first)
stage tests "$TESTS_S" python3 benchmarks/pytest_stage.py --out "$OUT" --budget-s $((TESTS_S - 5)) \
    --test-timeout-s 40 --grace-s 10 -- -m gpu tests/gpu --basetemp "$offload/tests"
if [ -n "$build_pid" ]; then
    wait "$build_pid" || status=1
fi
for s in "headline:$HEADLINE_S" "resident:$RESIDENT_S" "rest:$REST_S"; do
    stage "${s%%:*}" "${s##*:}" python3 benchmarks/gpu.py "${s%%:*}" "${dry[@]}" --out "$OUT" \
        --offload-dir "$offload" --budget-s $((${s##*:} - 3))
done
if [ "$have_wheels" = 1 ]; then
    stage deepspeed "$DEEPSPEED_S" python3 benchmarks/gpu_deepspeed.py run "${dry[@]}" --out "$OUT" \
        --offload-dir "$offload" --k 8 --budget-s $((DEEPSPEED_S - 3)) --wheels "$wheels"
else  # (the install's failure recorded: no wheels to install)
    stage deepspeed "$DEEPSPEED_S" python3 benchmarks/gpu_deepspeed.py all "${dry[@]}" --out "$OUT" \
        --offload-dir "$offload" --k 8 --budget-s $((DEEPSPEED_S - 1)) --wheels "$wheels"
fi
stage summary "$SUMMARY_S" python3 benchmarks/gpu.py summary "${dry[@]}" --out "$OUT"

for c in "${candidates[@]}"; do  # (the offload files; only the directories this script names)
    [ "$c" = "$offload" ] && rm -rf "$offload"
done
echo "== done in $((SECONDS - start)) s, exit $status; results in $OUT" | tee -a "$log"
exit $status
