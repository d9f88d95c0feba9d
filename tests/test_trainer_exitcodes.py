"""Exit codes of `moe-train` (docs/contracts.md): 78 bad plan, 65 non-finite loss."""

import json
import os
from pathlib import Path

import pytest

from moe_trainer.launch import launch
from moe_trainer.train import run

FIXTURES = Path(__file__).parent / "fixtures" / "plans"


def test_bad_plan_exits_78(tmp_path, caplog):
    doc = json.loads((FIXTURES / "tiny_mixtral_autoep.json").read_text())
    doc["version"] = 9
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(doc))
    assert run(["--plan", str(p)]) == 78
    assert "version: 9 is not a known version" in caplog.text
    assert run(["--plan", str(tmp_path / "missing.json")]) == 78


def test_world_size_mismatch_exits_78(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert run(["--plan", str(FIXTURES / "tiny_mixtral_autoep.json"), "--cpu"]) == 78
    assert "WORLD_SIZE=3 differs from the plan's worldSize=2" in caplog.text


@pytest.mark.slow
def test_nan_loss_exits_65_with_progress_on_grouped_zero3(tmp_path):
    """One process, ZeRO-3 without AutoEP, the grouped MoE block (moeImpl=grouped): step 1 trains,
    step 2's loss is poisoned by the test hook -> exit 65, progress says Failed / NonFiniteLoss."""
    env = dict(os.environ, MOE_FAULT_NAN_AT_STEP="2")
    codes = launch(
        1,
        [
            "--plan",
            str(FIXTURES / "tiny_mixtral_zero3_grouped.json"),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--cpu",
        ],
        env=env,
        timeout=300,
        log_prefix=str(tmp_path / "log"),
    )
    assert codes == [65], (tmp_path / "log.rank0.log").read_text()[-3000:]
    prog = json.loads((tmp_path / "ck" / "progress.json").read_text())
    assert prog["phase"] == "Failed" and prog["step"] == 2 and prog["loss"] is None
    assert [h["type"] for h in prog["health"]] == ["NonFiniteLoss"]
    log = (tmp_path / "log.rank0.log").read_text()
    assert "step 1/3 loss" in log
    assert (
        "MoE blocks after initialize: 2 x GroupedMoeBlock (moeImpl=grouped, AutoEP=False, "
        "dispatcher=autoep)" in log
    )


def test_comm_failure_classification():
    from moe_trainer.train import is_comm_failure

    assert is_comm_failure(
        RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    )
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_comm_failure(KeyError("gloo"))


@pytest.mark.slow
def test_lost_peer_exits_75(tmp_path):
    """SIGKILL one rank mid-run: the survivor sees the broken connection and exits 75
    (retryable)."""
    import subprocess
    import sys
    import time

    from moe_trainer.launch import free_port

    doc = json.loads((FIXTURES / "tiny_mixtral_autoep.json").read_text())
    doc["training"]["steps"] = 500
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    cmd = [
        sys.executable,
        "-m",
        "moe_trainer.train",
        "--plan",
        str(tmp_path / "plan.json"),
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--cpu",
    ]
    procs = [
        subprocess.Popen(
            cmd,
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    try:
        progress = tmp_path / "ck" / "progress.json"
        deadline = time.monotonic() + 300
        while not (progress.exists() and json.loads(progress.read_text())["step"] >= 2):
            assert time.monotonic() < deadline and procs[0].poll() is None
            time.sleep(0.5)
        procs[1].kill()
        assert procs[0].wait(timeout=120) == 75
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
