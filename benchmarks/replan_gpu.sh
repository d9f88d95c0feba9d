#!/usr/bin/env bash
# A placement switch during training on a GPU (issue 33), through the entry points a worker pod
# runs (no Kubernetes): moe-discover (real NVML) -> moectl plan -> moe-train twice on the same
# plan and seed: once with a PlacementUpdate of generation 1 (every MoE layer's experts in a
# seeded random order) that the trainer applies in place at its first checkpoint boundary
# (experts, router rows, fp32 masters and Adam states move; moe_trainer.replace), once without.
# The trainer reads the update from the file $MOE_TEST_PLACEMENT_FILE (its test hook) instead of
# the ConfigMap the operator writes. Compared as the MFU work compares loss curves
# (docs/performance.md): the 10-step moving average's largest relative difference from step 10
# on (tolerance 3 %), the largest per-step difference, and the steps before the switch exactly.
#
#   benchmarks/replan_gpu.sh prepare           on a dev machine with the project's .venv: the
#                                              wheels the GPU image lacks into .gpurun/replan
#   benchmarks/replan_gpu.sh run OUT [MODEL] [STEPS] [EVERY]
#                                              on the GPU machine (carry .gpurun/replan):
#                                              defaults bench-mixtral, 40 steps, checkpoint every
#                                              10; seq 1024 x global batch 16, the trainer's
#                                              built-in text corpus; writes OUT/replan_gpu.json
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:?usage: benchmarks/replan_gpu.sh prepare|run OUT [MODEL] [STEPS] [EVERY]}
shift
pack="$root/.gpurun/replan"

case "$cmd" in
prepare)
  rm -rf "$pack"
  "$root/benchmarks/gpu_wheels.sh" "$pack"
  du -sh "$pack"
  ;;
run)
  out=${1:?usage: benchmarks/replan_gpu.sh run OUT [MODEL] [STEPS] [EVERY]}
  model=${2:-bench-mixtral}
  steps=${3:-40}
  every=${4:-10}
  work=${MOE_GPU_DIR:-/tmp/moe-replan}
  mkdir -p "$out" "$work"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$pack"/*.whl
  export PYTHONPATH="$work/site:$root/operator:$root/trainer_image${PYTHONPATH:+:$PYTHONPATH}"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python3 -m moe_trainer.discovery.main --no-stdout -o "$out/topology.json"
  python3 -m moejob_operator.cli plan --topology "$out/topology.json" --model "$model" \
      --steps "$steps" --checkpoint-every "$every" --seq-len 1024 --global-batch 16 \
      --data "{\"kind\": \"corpus\", \"path\": \"$work/corpus\"}" -o "$work/plan.json" \
      > "$out/plan.txt" 2>&1
  python3 - "$work/plan.json" "$work/update.json" <<'EOF'
import json, sys
import numpy as np
from moe_contracts import placement_update as PU
plan = json.load(open(sys.argv[1]))
L, E = len(plan["placement"]["permutation"]), len(plan["placement"]["permutation"][0])
rng = np.random.default_rng(33)
perm = [[int(e) for e in rng.permutation(E)] for _ in range(L)]
doc = PU.PlacementUpdate(generation=1, permutation=perm, decided_at_step=0, reason="replan_gpu.sh")
open(sys.argv[2], "w").write(PU.dumps(doc))
EOF
  gpus=$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["gpus"]))' "$out/topology.json")
  for run in switch stay; do
    ck="$work/ckpt-$run"
    rm -rf "$ck"
    env_update=()
    [ "$run" = switch ] && env_update=(MOE_TEST_PLACEMENT_FILE="$work/update.json")
    t0=$SECONDS
    env "${env_update[@]}" NODE_RANK=0 NNODES=1 NPROC_PER_NODE="$gpus" WORLD_SIZE="$gpus" \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=29519 \
        python3 -m moe_trainer.train --plan "$work/plan.json" --checkpoint-dir "$ck" \
        > "$out/train-$run.txt" 2>&1 || echo "moe-train ($run) exited $?" >> "$out/train-$run.txt"
    echo $(( SECONDS - t0 )) > "$work/wall-$run"
    cp "$ck/losses.json" "$work/losses-$run.json" 2>/dev/null || true
    cp "$ck/progress.json" "$work/progress-$run.json" 2>/dev/null || true
    rm -rf "$ck"
  done
  python3 - "$out" "$model" "$steps" "$every" "$work" <<'EOF'
import json, sys
import numpy as np
out, model, steps, every, work = sys.argv[1:]
def read(name):
    try:
        return json.load(open(f"{work}/{name}"))
    except (OSError, ValueError):
        return None
la, lb = (read(f"losses-{r}.json") for r in ("switch", "stay"))
pa = read("progress-switch.json") or {}
res = {
    "command": f"benchmarks/replan_gpu.sh run OUT {model} {steps} {every}",
    "model": model, "steps": int(steps), "checkpointEverySteps": int(every),
    "shape": "seq 1024 x global batch 16, bf16, ZeRO-3, the trainer's built-in text corpus",
    "placement": pa.get("placement"),
    "wallSeconds": {r: int(open(f"{work}/wall-{r}").read()) for r in ("switch", "stay")},
    "ok": False,
}
if la and lb and len(la["losses"]) == len(lb["losses"]) == int(steps):
    a, b = np.array(la["losses"]), np.array(lb["losses"])
    applied = (pa.get("placement") or {}).get("appliedAtStep")
    ma = np.convolve(a, np.ones(10) / 10, "valid")
    mb = np.convolve(b, np.ones(10) / 10, "valid")
    rel = np.abs(ma - mb) / np.abs(mb)
    rs = np.abs(a - b) / np.abs(b)  # per step
    res.update(
        appliedAtStep=applied,
        identicalBeforeSwitch=bool(applied and (a[:applied] == b[:applied]).all()),
        movingAverageMaxRelDiff=float(rel.max()),
        maxAbsStepDiff=float(np.abs(a - b).max()),
        maxRelStepDiffAfterSwitch=float((np.abs(a - b) / np.abs(b))[applied or 0 :].max()),
        # the same placement, seed and data: on a GPU the runs differ before the switch too
        # (non-deterministic kernels); this is the floor the figures after it compare against
        maxRelStepDiffBeforeSwitch=float(rs[: applied or 0].max()) if applied else None,
        meanRelStepDiff={
            "beforeSwitch": float(rs[: applied or 0].mean()) if applied else None,
            "afterSwitch": float(rs[applied or 0 :].mean()),
        },
        lastTenMean={"switch": float(a[-10:].mean()), "stay": float(b[-10:].mean())},
        losses={"switch": la["losses"], "stay": lb["losses"]},
        tolerance=0.03,
    )
    res["ok"] = bool(applied == int(every) and res["movingAverageMaxRelDiff"] <= 0.03)
json.dump(res, open(f"{out}/replan_gpu.json", "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "losses"}, indent=1))
EOF
  ;;
*)
  echo "unknown command $cmd" >&2; exit 2 ;;
esac
