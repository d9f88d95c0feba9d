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
    assert "version: 9 is not supported" in caplog.text
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
    codes = launch(1, ["--plan", str(FIXTURES / "tiny_mixtral_zero3_grouped.json"), "--checkpoint-dir",
                       str(tmp_path / "ck"), "--cpu"], env=env, timeout=300, log_prefix=str(tmp_path / "log"))
    assert codes == [65], (tmp_path / "log.rank0.log").read_text()[-3000:]
    prog = json.loads((tmp_path / "ck" / "progress.json").read_text())
    assert prog["phase"] == "Failed" and prog["step"] == 2 and prog["loss"] is None
    assert [h["type"] for h in prog["health"]] == ["NonFiniteLoss"]
    log = (tmp_path / "log.rank0.log").read_text()
    assert "step 1/3 loss" in log
    assert "MoE blocks after initialize: 2 x GroupedMoeBlock (moeImpl=grouped, AutoEP=False)" in log
