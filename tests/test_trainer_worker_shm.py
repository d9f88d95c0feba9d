"""A CPU worker started the way the operator starts it (the worker pod's command and env from
`builders.workers`, the plan from the planning step) compiles nothing: with a stale
`deepspeed_shm_comm/lock` in TORCH_EXTENSIONS_DIR (which used to hang every run) it trains and
exits 0, and the extensions dir is left as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_cpu_worker_pod_builds_no_shm_op(tmp_path):
    from moe_trainer.launch import free_port
    from moejob_operator.builders import workers
    from moejob_operator.builders.common import JobRef
    from moejob_operator.reconcile import planning
    from moejob_operator.spec import parse_spec

    spec = parse_spec(
        {
            "image": "moe-trainer:local",
            "device": "CPU",
            "model": {"preset": "tiny-mixtral"},
            "nodes": {"count": 1, "gpusPerNode": 1},
            "checkpoint": {"everySteps": 1},
            "placement": {"strategy": "Contiguous"},
            "training": {"steps": 1, "seqLen": 16, "globalBatch": 1, "microBatch": 1},
        }
    )
    job = JobRef(namespace="ns", name="shm", uid="0" * 36)
    plan = planning._make_plan(job, spec, ["node-a"], {}, None, 0, planning.Inputs())
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    pod = workers.worker_pod(job, spec, node_rank=0, node="node-a", attempt=0, spec_hash="h")
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    ext = tmp_path / "torch_extensions"
    (ext / "deepspeed_shm_comm").mkdir(parents=True)
    (ext / "deepspeed_shm_comm" / "lock").touch()  # what a killed build leaves
    env.update(
        MOE_PLAN=str(tmp_path / "plan.json"),
        MOE_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NODE_NAME="node-a",
        POD_NAME=pod["metadata"]["name"],
        TORCH_EXTENSIONS_DIR=str(ext),
        MOE_CPU_THREADS="1",
        PATH=os.environ["PATH"],
        HOME=str(tmp_path),
    )
    env.pop("MOE_METRICS_PORT", None)
    exe = shutil.which(container["command"][0], path=str(Path(os.sys.executable).parent))
    assert exe, container["command"]
    out = subprocess.run(
        [exe, *container["command"][1:]], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert sorted(str(p.relative_to(ext)) for p in ext.rglob("*")) == [
        "deepspeed_shm_comm",
        "deepspeed_shm_comm/lock",
    ]
    assert "deepspeed_shm_comm" not in (out.stdout + out.stderr).replace(str(ext), "")
    stats = json.loads((tmp_path / "ckpt" / "routing_stats.json").read_text())
    assert stats["steps"] == 1
