"""Pods with more than one rank, through the real operator, API server and node agent: 2 node ranks
x 2 ranks per pod (world 4, EP 4, DeepSpeed ZeRO-3 + AutoEP on gloo), the code path of a GPU pod
(`moe-train` as node launcher) in CPU mode.

- one rank's process killed mid-run: its pod fails, the gang restarts from the last checkpoint
  and the job succeeds, every rank having trained (logs, all-to-all bytes by rank, routing
  statistics over the world of 4);
- a worker pod deleted while a checkpoint is being written: the write completes, the restarted
  gang resumes from exactly that checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from moejob_operator import constants as C
from operator_harness import apply_job, example, get_job, module_operator, seed_topology

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HOLD = f"{C.GROUP}/fault-hold-checkpoint-at-step"
operator_proc = module_operator("operator-multirank")


def _job(name: str, tmp_path, *, steps: int, every: int, annotations=None) -> dict:
    job = example(
        "tiny-cpu.yaml",
        metadata={"name": name, "annotations": annotations or {}},
        nodes={"count": 2, "gpusPerNode": 2},
        placement={"strategy": "TopologyAware", "expertParallelSize": 4},
        checkpoint={"everySteps": every, "volume": {"hostPath": {"path": str(tmp_path)}}},
        runPolicy={"backoffLimit": 2},
        gate={"skip": True, "skipReason": "the gate's own tests run the smoke Job"},
    )
    job["spec"]["training"].update(steps=steps, seqLen=32, globalBatch=8, microBatch=2)
    return job


def _ckpt_dir(kube, namespace: str, name: str, tmp_path) -> Path:
    uid = get_job(kube, namespace, name)["metadata"]["uid"]
    return Path(tmp_path) / f"{name}-{uid[:8]}"


def _latest(ckpt: Path) -> int | None:
    try:
        m = re.fullmatch(r"step-(\d+)", (ckpt / "ds" / "latest").read_text().strip())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _all_logs(node_agent, namespace: str, pod: str) -> str:
    """Every attempt's output of ``pod`` (the node agent keeps one directory per pod uid)."""
    base = Path(node_agent.run_dir) / "pods" / namespace / pod
    files = sorted(base.glob("*/logs/*.log"), key=lambda p: p.stat().st_mtime)
    return "\n".join(f.read_text(errors="replace") for f in files)


def _rank_pid(ckpt: Path, rank: int) -> int | None:
    """The trainer process of global rank ``rank`` of this job (a child of a pod's launcher)."""
    want = [f"RANK={rank}".encode(), b"MOE_CHECKPOINT_DIR="]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"moe_trainer.train" not in (proc / "cmdline").read_bytes():
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want[0] in env and any(
            e.startswith(want[1]) and e.endswith(ckpt.name.encode()) for e in env
        ):
            return int(proc.name)
    return None


def _finished(kube, namespace, name):
    st = get_job(kube, namespace, name).get("status") or {}
    return st.get("phase") in ("Succeeded", "Failed") and st


def test_two_ranks_per_pod_survive_a_killed_rank_and_succeed(
    kube, namespace, operator_proc, node_agent, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    steps, every = 24, 4
    apply_job(kube, namespace, _job("mr", tmp_path, steps=steps, every=every))
    wait_for(
        lambda: get_job(kube, namespace, "mr").get("status", {}).get("plan"),
        timeout=60,
        message="planned\n" + operator_proc.logs(),
    )
    plan = json.loads(kube.core.read_namespaced_config_map("mr-plan", namespace).data[C.PLAN_KEY])
    assert plan["worldSize"] == 4 and plan["epSize"] == 4 and plan["distBackend"] == "gloo"
    assert [(r["rank"], r["nodeRank"], r["localRank"]) for r in plan["ranks"]] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    ckpt = _ckpt_dir(kube, namespace, "mr", tmp_path)

    # a checkpoint exists and training goes on: kill global rank 3 (local rank 1 of worker-1)
    first = wait_for(
        lambda: (_latest(ckpt) or 0) >= every and _latest(ckpt),
        timeout=400,
        interval=0.1,
        message="first checkpoint\n" + operator_proc.logs(),
    )
    assert first < steps, "the run ended before a rank could be killed: make it longer"
    pid = wait_for(lambda: _rank_pid(ckpt, 3), timeout=10, message="rank 3's process")
    os.kill(pid, signal.SIGKILL)

    st = wait_for(
        lambda: _finished(kube, namespace, "mr"),
        timeout=600,
        interval=1,
        message="job finished\n" + operator_proc.logs(),
    )
    assert st["phase"] == "Succeeded", json.dumps(st, indent=1)
    assert st["restarts"] == 1 and st["attempt"] == 1
    assert st["progress"]["step"] == steps

    logs = {p: _all_logs(node_agent, namespace, f"mr-worker-{p}") for p in (0, 1)}
    # the launcher of worker-1 saw rank 3 die first and stopped rank 2 with it
    assert re.search(r"node rank 1: rank3 exited with code 137 first", logs[1]), logs[1][-3000:]
    for rank in range(4):
        pod_log = logs[rank // 2]
        lines = [x for x in pod_log.splitlines() if x.startswith(f"[rank{rank}] ")]
        # the restarted gang: every rank loaded the checkpoint taken before the kill, then trained
        resumed = [
            int(m.group(1)) for x in lines for m in [re.search(r"resumed from step (\d+)", x)] if m
        ]
        assert resumed and resumed[-1] >= first, (rank, resumed)
        assert any(
            f"rank {rank} trained steps {resumed[-1] + 1}..{steps} of {steps}" in x for x in lines
        ), pod_log[-3000:]
    assert f"step {steps}/{steps} loss" in logs[0]

    prog = json.loads((ckpt / "progress.json").read_text())
    by_rank = prog["moe"]["allToAllBytesPerStepByRank"]
    assert len(by_rank) == 4 and all(b > 0 for b in by_rank), by_rank  # every rank dispatched
    stats = json.loads((ckpt / "routing_stats.json").read_text())
    tokens_per_step = 8 * 32  # globalBatch x seqLen, all 4 ranks
    assert stats["steps"] == steps and stats["tokens"] == steps * tokens_per_step
    assert all(sum(layer) == stats["tokens"] * stats["topK"] for layer in stats["load"])


def test_pod_deleted_during_a_checkpoint_write_leaves_that_checkpoint_loadable(
    kube, namespace, operator_proc, node_agent, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    steps, hold = 8, 4
    apply_job(
        kube,
        namespace,
        _job("ckdel", tmp_path, steps=steps, every=4, annotations={HOLD: str(hold)}),
    )
    wait_for(
        lambda: get_job(kube, namespace, "ckdel").get("status", {}).get("plan"),
        timeout=60,
        message="planned\n" + operator_proc.logs(),
    )
    ckpt = _ckpt_dir(kube, namespace, "ckdel", tmp_path)
    # rank 0 (worker-0) has started writing step 4 and holds there, half-written
    wait_for(
        lambda: (ckpt / f"checkpoint-write-started-step-{hold}").exists(),
        timeout=400,
        interval=0.1,
        message="checkpoint write started\n" + operator_proc.logs(),
    )
    assert _latest(ckpt) is None  # not complete yet
    kube.core.delete_namespaced_pod("ckdel-worker-0", namespace)

    st = wait_for(
        lambda: _finished(kube, namespace, "ckdel"),
        timeout=600,
        interval=1,
        message="job finished\n" + operator_proc.logs(),
    )
    assert st["phase"] == "Succeeded", json.dumps(st, indent=1)
    assert st["restarts"] >= 1 and st["progress"]["step"] == steps
    log0 = _all_logs(node_agent, namespace, "ckdel-worker-0")
    # the deleted pod's ranks finished the write they were in, then exited
    assert "SIGTERM during a checkpoint write: finishing the write" in log0, log0[-3000:]
    assert f"checkpoint step-{hold} written; exiting on SIGTERM" in log0, log0[-3000:]
    # ...and the restarted gang loaded exactly that checkpoint, on every rank
    for rank in range(4):
        pod_log = log0 if rank < 2 else _all_logs(node_agent, namespace, "ckdel-worker-1")
        assert f"rank {rank} resumed from step {hold}" in pod_log, pod_log[-3000:]
