#!/usr/bin/env bash
# The user's path on one GPU machine, through the entry points a worker pod runs (no Kubernetes):
#   moe-discover (real NVML) -> moectl plan (planner defaults) -> moe-train (node launcher, one
#   rank per GPU) for a few steps; checks the run and writes what happened.
#   benchmarks/userflow_gpu.sh OUT_DIR [MODEL] [STEPS]     (defaults: bench-mixtral, 40)
# Needs the project's Python packages importable (PYTHONPATH=operator:trainer_image is set here)
# and a CUDA GPU. Writes OUT_DIR/{topology.json,plan.json,plan.txt,train.log,userflow.json}.
set -uo pipefail
out=${1:?usage: benchmarks/userflow_gpu.sh OUT_DIR [MODEL] [STEPS]}
model=${2:-bench-mixtral}
steps=${3:-40}
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/operator:$root/trainer_image${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
py=${PYTHON:-python3}

"$py" -m moe_trainer.discovery.main --no-stdout -o "$out/topology.json"
discover=$?
"$py" -m moejob_operator.cli plan --topology "$out/topology.json" --model "$model" \
    --steps "$steps" -o "$out/plan.json" > "$out/plan.txt" 2>&1
plan=$?
gpus=$("$py" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["gpus"]))' "$out/topology.json" 2>/dev/null || echo 0)
t0=$SECONDS
NODE_RANK=0 NNODES=1 NPROC_PER_NODE=$gpus WORLD_SIZE=$gpus MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
    "$py" -m moe_trainer.train --plan "$out/plan.json" --checkpoint-dir "$out/ckpt" > "$out/train.log" 2>&1
train=$?
wall=$(( SECONDS - t0 ))
rm -rf "$out/ckpt"

"$py" - "$out" "$discover" "$plan" "$train" "$wall" "$gpus" "$model" "$steps" <<'EOF'
import json, re, sys
out, discover, plan, train, wall, gpus, model, steps = sys.argv[1:]
log = open(f"{out}/train.log", errors="replace").read()
# "step N/M loss ... R tok/s": the trainer's rate over its last 10 steps
rates = {int(n): float(r) for n, r in re.findall(r"step (\d+)/\d+ loss .*? ([\d.]+) tok/s", log)}
steady = sorted(r for n, r in rates.items() if n > 10)
result = {
    "model": model, "steps": int(steps), "gpus": int(gpus),
    "exit": {"moe-discover": int(discover), "moectl plan": int(plan), "moe-train": int(train)},
    "trainWallSeconds": int(wall),
    "performanceOptions": re.findall(r"performance options: (.*)", log),
    "zero3Step": re.findall(r"ZeRO-3 step: (.*)", log),
    "checkpointEverySteps": (
        json.load(open(f"{out}/plan.json"))["training"]["checkpointEverySteps"]
        if plan == "0" else None
    ),
    "stepsLogged": len(rates),
    "medianTokensPerSecondAfterStep10": steady[len(steady) // 2] if steady else None,
    "ok": discover == plan == train == "0",
}
json.dump(result, open(f"{out}/userflow.json", "w"), indent=1)
print(json.dumps(result, indent=1))
sys.exit(0 if result["ok"] else 1)
EOF
