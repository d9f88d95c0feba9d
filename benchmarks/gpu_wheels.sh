#!/usr/bin/env bash
# The wheels the GPU machine's image (python 3.12, torch, transformers) lacks, into DEST: the
# project's runtime dependencies named below and any extra package names, at the versions
# constraints.txt pins (cp312 manylinux wheels), and a DeepSpeed wheel built without its ops.
# Used by the GPU benchmarks' `prepare` steps (gpu_e2e.sh, replan_gpu.sh); run on a dev machine
# with the project's .venv.
#
#   benchmarks/gpu_wheels.sh DEST [PACKAGE ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:?usage: benchmarks/gpu_wheels.sh DEST [PACKAGE ...]}
shift
py="$root/.venv/bin/python"
names="pydantic|pydantic_core|annotated-types|typing-inspection|typing_extensions|hjson"
for extra in "$@"; do
  grep -qiE "^$extra==" "$root/constraints.txt" || { echo "gpu_wheels.sh: $extra: not pinned in constraints.txt" >&2; exit 2; }
  names="$names|$extra"
done
pins=$(grep -iE "^($names)==" "$root/constraints.txt")
mkdir -p "$dest"
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" $pins
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" \
    "$(grep -i '^deepspeed==' "$root/constraints.txt")"
