#!/usr/bin/env bash
# The operator's whole GPU path on one GPU machine with no Kubernetes (issue 32):
# control plane + CRD + node agent as a GPU node (real NVML, CUDA_VISIBLE_DEVICES per grant) +
# operator; a device: GPU job to Succeeded, moe-train started directly on the same plan, a second
# job planned from the first one's routing statistics (moe_localkube.gpu_e2e).
#
#   benchmarks/gpu_e2e.sh prepare          on a dev machine with the project's .venv: builds
#                                          .gpurun/ (wheels the GPU machine lacks, the Kubernetes
#                                          v1.20.2 binaries, etcd), split in three parts of < 25 MB
#                                          (a: apiserver, etcd; a2: controller manager; b: below)
#                                          so that each fits beside the checkout in one transfer
#   benchmarks/gpu_e2e.sh stage-a          on the GPU machine: unpack the parts a* present (carry
#                                          .gpurun/a in one call, .gpurun/a2 in the next) under
#                                          $MOE_GPU_DIR (default /tmp/moe-gpu)
#   benchmarks/gpu_e2e.sh run OUT [ARGS]   on the GPU machine: unpack part b (scheduler, wheels),
#                                          install the wheels, run the end-to-end flow; results in OUT
#                                          (gpu_e2e.json, collected.tar.gz, topology.json)
# A GPU machine that has the binaries another way: set MOE_KUBE_BIN_DIR and put etcd on PATH.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:?usage: benchmarks/gpu_e2e.sh prepare|stage-a|run OUT [ARGS]}
shift
gdir=${MOE_GPU_DIR:-/tmp/moe-gpu}
pack="$root/.gpurun"

case "$cmd" in
prepare)
  py="$root/.venv/bin/python"
  kbin="$root/../shared/k8s/bin"
  [ -d "$kbin" ] || kbin="$root/../../shared/k8s/bin"
  rm -rf "$pack/a" "$pack/a2" "$pack/b"; mkdir -p "$pack/a" "$pack/a2" "$pack/b/wheels"
  cp "$kbin"/kube-apiserver.xz "$pack/a/"
  cp "$kbin"/kube-controller-manager.xz "$pack/a2/"
  cp "$kbin"/kube-scheduler.xz "$kbin"/SHA256SUMS "$pack/b/"
  xz -T2 -9 -c "$(command -v etcd || echo /usr/bin/etcd)" > "$pack/a/etcd.xz"
  xz -T2 -9 -c "$(command -v openssl)" > "$pack/a/openssl.xz"   # used only where none exists
  w="$pack/b/wheels"
  # what the GPU image lacks (benchmarks/gpu_wheels.sh), with the operator's dependencies
  "$root/benchmarks/gpu_wheels.sh" "$w" kopf iso8601 python-json-logger jsonpatch jsonpointer \
      kubernetes durationpy oauthlib requests-oauthlib websocket-client aiohttp-retry
  "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$w" "$root" "$root/operator/dev"
  du -sh "$pack/a" "$pack/a2" "$pack/b"
  ;;
stage-a)
  mkdir -p "$gdir/bin"
  for f in "$pack"/a*/*.xz; do xz -dc "$f" > "$gdir/bin/$(basename "$f" .xz)"; done
  chmod +x "$gdir"/bin/*
  command -v openssl >/dev/null && rm -f "$gdir/bin/openssl"
  ls -la "$gdir/bin"
  ;;
run)
  out=${1:?usage: benchmarks/gpu_e2e.sh run OUT [ARGS]}
  shift
  xz -dc "$pack/b/kube-scheduler.xz" > "$gdir/bin/kube-scheduler"
  chmod +x "$gdir/bin/kube-scheduler"
  (cd "$gdir/bin" && grep -E 'kube-(apiserver|controller-manager|scheduler)$' "$pack/b/SHA256SUMS" \
      | sha256sum -c --quiet) || { echo "Kubernetes binaries do not match SHA256SUMS" >&2; exit 1; }
  # Into a folder on PYTHONPATH, not a venv: the GPU image's python3 is itself a venv (torch), and
  # a venv made from it would not see its packages. The node agent passes PYTHONPATH to its pods
  # and puts /usr/local/bin on their PATH: the entry points (moe-train, ...) go there.
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$gdir/site" \
      "$pack"/b/wheels/*.whl
  install -m 755 "$gdir"/site/bin/* /usr/local/bin/
  export PYTHONPATH="$gdir/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$gdir/bin:$PATH" MOE_KUBE_BIN_DIR="$gdir/bin"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} TORCH_EXTENSIONS_DIR="$gdir/torch_ext"
  # Checkpoints (and exports) on a tmpfs when the machine can hold a 3.4 B model's final ZeRO-3
  # checkpoint with its optimizer state (~48 GB) plus two exports: seconds instead of minutes.
  ck=() mem=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
  if [ "$(id -u)" = 0 ] && [ "${mem:-0}" -ge 110 ]; then
    mkdir -p "$gdir/tmpfs"
    mountpoint -q "$gdir/tmpfs" || mount -t tmpfs -o size=90g tmpfs "$gdir/tmpfs" || true
    mountpoint -q "$gdir/tmpfs" && ck=(--checkpoints "$gdir/tmpfs/ckpt")
  fi
  exec python3 -m moe_localkube.gpu_e2e --out "$out" --work "$gdir/work" \
      --crd "$root/crds/moetrainingjob.yaml" "${ck[@]}" "$@"
  ;;
*) echo "unknown command $cmd" >&2; exit 2 ;;
esac
