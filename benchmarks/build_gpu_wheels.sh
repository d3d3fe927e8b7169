#!/usr/bin/env bash
# Builds, here (a machine with the package registry), what the GPU machine needs to run DeepSpeed
# ZeRO-Infinity (benchmarks/gpu_deepspeed.py) and has not: that machine has no network, and its image
# (Python 3.12, torch 2.11+cu130, lightning 2.6.6; the package list in the device notes' KINDS.md) has
# no DeepSpeed, hjson, pydantic or libaio. Into one git-ignored folder (default .gpu_wheels, a few MB;
# it fails above 60 MB), which the device call carries (run(..., carry=[".gpu_wheels"])) and
# gpu_deepspeed.py installs there with pip --no-index --find-links into a target directory, --no-deps
# (the image's torch, numpy, ninja, psutil, py-cpuinfo, msgpack, einops, packaging and tqdm serve
# DeepSpeed as they are):
#   - deepspeed 0.19.8: an sdist only; `pip wheel --no-deps` makes a pure-Python wheel (its ops are
#     compiled on first use, on the GPU machine: DS_BUILD_OPS stays unset);
#   - hjson, pydantic, pydantic-core (a binary: cp312 manylinux x86_64), annotated-types,
#     typing-inspection, and typing-extensions (pydantic needs >= 4.14.1; the image's version is not
#     known here): `pip download --only-binary=:all:` for that Python and platform;
#   - libaio (DeepSpeed's async_io links -laio and includes libaio.h; the image has neither): Debian's
#     libaio1 and libaio-dev, `apt-get download`ed, unpacked there with dpkg -x (never into /).
# hydra-core is not needed: the GPU run imports neither examples/ nor conf/.
# Checked end to end here by `bash benchmarks/check_gpu_image.sh --deepspeed`: the folder installed as
# gpu_deepspeed.py installs it, under Python 3.12 beside torch 2.11 and the image's other packages (einops,
# which DeepSpeed imports, among them), both ops compiled and ZeRO-Infinity's steps run, on the CPU.
# Usage: bash benchmarks/build_gpu_wheels.sh [FOLDER]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu_wheels}
case "$dest" in .gpu_wheels|*/.gpu_wheels) ;; *) echo "note: $dest must be git-ignored to be carried" >&2 ;; esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$tmp" deepspeed==0.19.8
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" \
    hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    typing-extensions==4.16.0
(cd "$tmp" && apt-get download libaio1 libaio-dev >/dev/null)
# one version of each (two stop pip's install), and nothing else
count=$(ls "$tmp" | sed -E 's/[-_][0-9].*//' | tr A-Z_ a-z- | sort | uniq -d | wc -l)
[ "$count" -eq 0 ] || { echo "two versions of one package in $tmp: $(ls "$tmp")" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp"/* "$dest"/
size=$(du -sm "$dest" | cut -f1)
ls -l "$dest"
echo "$dest: ${size} MB"
[ "$size" -lt 60 ] || { echo "$dest is ${size} MB, over the 60 MB the device call may carry for it" >&2; exit 1; }
