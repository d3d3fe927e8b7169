#!/usr/bin/env bash
# The GPU image's versions before the GPU: benchmarks/gpu_session.sh's dry run under the lent machine's
# Python 3.12, torch 2.11.0 and lightning 2.6.6 (the same image on the H100 and the H200 kinds), in an
# environment of its own, since the project's tests run under torch 2.13 and the code had never run on
# 2.11. The registry's torch 2.11.0 is the CUDA build (the CPU wheel on disk here is 2.13 only): it
# imports and runs on a CPU. A developer runs it before any GPU run (not CI: 1-2.5 minutes and 4.7 GB more
# on a run kept under 30 minutes, and a Python 3.12 install; docs/how-to/gpu.md).
#
# The environment (~4.7 GB, ~1.5 min to make on the 2-core box; the image's packages that the package,
# the tests stage and DeepSpeed use, at the image's versions where its package list gives them, and no
# hydra-core, which the image lacks) is made once and kept, and made again when PACKAGES changes:
# $GREEDYSNAKE_GPU_IMAGE_VENV, by default ~/.cache/greedysnake/gpu-image-venv. Python 3.12 is
# $PYTHON312, else pyenv's, else python3.12 on the PATH.
#
#   bash benchmarks/check_gpu_image.sh              # the dry run (~2 min once the environment exists)
#   bash benchmarks/check_gpu_image.sh --deepspeed  # also DeepSpeed from .gpu_wheels, end to end (by hand)
#
# --deepspeed: builds .gpu_wheels (benchmarks/build_gpu_wheels.sh) where missing, then runs
# gpu_deepspeed.py's dry run from it under Python 3.12 and torch 2.11: the wheels installed as the GPU
# machine installs them (pip --no-index --target, libaio unpacked), DeepSpeed imported beside torch 2.11,
# its async_io and cpu_adam ops compiled (on the CPU accelerator here: ~10 minutes on 2 cores), then the
# steps of ZeRO-Infinity on the CPU. Its rows are printed; the exit status is the script's own.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(torch==2.11.0 lightning==2.6.6 pytorch-lightning==2.6.6 torchmetrics==1.9.0 safetensors==0.8.0
          numpy pytest pytest-timeout psutil ninja py-cpuinfo msgpack einops packaging tqdm)
venv=${GREEDYSNAKE_GPU_IMAGE_VENV:-$HOME/.cache/greedysnake/gpu-image-venv}
deepspeed=0
case "${1:-}" in
    --deepspeed) deepspeed=1 ;;
    "") ;;
    *) echo "usage: bash benchmarks/check_gpu_image.sh [--deepspeed]" >&2; exit 2 ;;
esac

py=
for cand in ${PYTHON312:-} $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV) \
            $(command -v python3.12 || true); do
    if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
        py=$cand
        break
    fi
done
if [ -z "$py" ]; then
    echo "no Python 3.12 (the GPU image's): set PYTHON312, or install one (pyenv install 3.12)" >&2
    exit 1
fi
stamp="$venv/.greedysnake-packages"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${PACKAGES[*]}" ]; then
    echo "== making $venv with $("$py" --version): ${PACKAGES[*]}"
    t0=$SECONDS
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --progress-bar off "${PACKAGES[@]}"
    echo "${PACKAGES[*]}" > "$stamp"
    echo "== made in $((SECONDS - t0)) s ($(du -sh "$venv" | cut -f1))"
fi
"$venv/bin/python" - <<'EOF'
import sys

import lightning
import torch

assert sys.version_info[:2] == (3, 12), sys.version
assert torch.__version__.startswith("2.11.0"), torch.__version__
assert lightning.__version__ == "2.6.6", lightning.__version__
print(f"== Python {sys.version.split()[0]}, torch {torch.__version__}, lightning {lightning.__version__}")
EOF
PATH="$venv/bin:$PATH" bash benchmarks/gpu_session.sh --dry-run
if [ "$deepspeed" = 1 ]; then
    [ -d .gpu_wheels ] || bash benchmarks/build_gpu_wheels.sh
    out=$(mktemp -d)
    site=$(mktemp -d)
    trap 'rm -rf "$out" "$site"' EXIT
    PYTHONPATH="$PWD" "$venv/bin/python" benchmarks/gpu_deepspeed.py --dry-run --out "$out" \
        --offload-dir "$out/offload" --wheels .gpu_wheels --site "$site" --budget-s 1500
    cat "$out/rows.jsonl"
fi
