#!/usr/bin/env bash
# The device checks in one run, for a session lent a GPU machine (the H200 kind: torch, lightning,
# torchmetrics, safetensors and transformers in its python3; no hydra-core, which none of this needs).
# Everything it writes goes under $OUT (the device tool's folder; ./gpu_out elsewhere):
#   1. the CUDA tests (tests/gpu, marked gpu): exactness against strategy="auto" for every placement
#      (device-resident compute weights and a three-way split included), fp16, memory back to its
#      starting level, no synchronize in the steady state;
#   2. the simulated-device tests of the resident weights on that machine's torch (a cross-check of
#      the CPU suite there, a minute);
#   3. benchmarks/gpu.py at the size its docstring gives, with the resident-weights system at K=4
#      (its table is the number the notes quote).
# Sized for about 8 minutes of a 10-minute command: run it as
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600)
# and leave the second half of the session's 15 minutes for one rerun. Each stage's log is kept even
# when a later one fails or the command is stopped at its limit.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
{ nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv; python3 -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.is_available())"; df -h /tmp; } \
    2>&1 | tee "$OUT/machine.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" || status=1
GREEDYSNAKE_SIMULATE_DEVICE=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -x \
    tests/integration/test_device_weights.py 2>&1 | tee "$OUT/simulated.log" || status=1
timeout 300 python3 benchmarks/gpu.py --ks 4 --resident-ks 4 --default-ks --offload-dir /tmp \
    --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.log" || status=1
exit $status
