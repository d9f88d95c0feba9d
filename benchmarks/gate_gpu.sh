#!/usr/bin/env bash
# The upgrade gate on one GPU, in one command (about 6-8 minutes on a fresh H200, FusedAdam's JIT
# build included):
#   1. derive the GPU's numeric tolerances from the spread of correct runs over SEEDS seeds
#      (benchmarks/smoke_tolerances.py: writes benchmarks/results/smoke_tolerances_cuda-bf16.json
#      and the cuda-bf16 table of trainer_image/moe_trainer/gate/tolerances.json);
#   2. time the smoke run with those tolerances against the 120 s budget (benchmarks/smoke_bench.py:
#      writes benchmarks/results/smoke_gpu.json; exit 1 when it fails or is over budget).
#   benchmarks/gate_gpu.sh [SEEDS]                      (default 3)
# Needs the project's Python packages (PYTHONPATH=operator:trainer_image is set here), DeepSpeed,
# and a CUDA GPU.
set -euo pipefail
seeds=${1:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/operator:$root/trainer_image${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 DS_BUILD_OPS=0 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
py=${PYTHON:-python3}
cd "$root"
"$py" benchmarks/smoke_tolerances.py --gpu --seeds "$seeds"
"$py" benchmarks/smoke_bench.py --gpu --out benchmarks/results
