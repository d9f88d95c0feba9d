"""ZeRO-3 + AutoEP training through `moe_trainer.train` (2 gloo processes on two "nodes", EP 2):
the dedup dispatcher follows stock AutoEP's loss curve step for step, sends fewer cross-group
bytes (counted in the collectives, reported in progress), and checkpoints load either way."""

import json
import shutil
from pathlib import Path

import pytest

from test_trainer_autoep import PLAN, run

pytestmark = pytest.mark.slow
STEPS = 6


def plan_for(tmp: Path, dispatcher: str) -> Path:
    doc = json.loads(PLAN.read_text())
    doc["ranks"] = [
        {"rank": r, "node": f"node-{r}", "nodeRank": r, "localRank": 0, "gpu": None, "group": r}
        for r in range(2)
    ]
    doc["placement"]["dispatcher"] = dispatcher
    doc["training"].update(steps=STEPS, checkpointEverySteps=3)
    path = tmp / f"plan-{dispatcher}.json"
    path.write_text(json.dumps(doc))
    return path


def losses(ckpt: Path) -> list[float]:
    return json.loads((ckpt / "losses.json").read_text())["losses"]


def resume_copy(src: Path, dst: Path, step: int) -> Path:
    shutil.copytree(src / "ds" / f"step-{step}", dst / "ds" / f"step-{step}")
    (dst / "ds" / "latest").write_text(f"step-{step}")
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dedup_train")
    plans = {d: plan_for(base, d) for d in ("autoep", "dedup")}
    out = {}
    for name in plans:
        out[name] = base / name
        assert run(out[name], plan=plans[name]) == [0, 0], name
    # autoep checkpoint -> dedup run, dedup checkpoint -> autoep run
    out["autoep->dedup"] = resume_copy(out["autoep"], base / "a2d", 3)
    assert run(out["autoep->dedup"], plan=plans["dedup"]) == [0, 0]
    out["dedup->autoep"] = resume_copy(out["dedup"], base / "d2a", 3)
    assert run(out["dedup->autoep"], plan=plans["autoep"]) == [0, 0]
    return out


def test_dedup_follows_autoep_loss_step_for_step(runs):
    a, d = losses(runs["autoep"]), losses(runs["dedup"])
    assert len(a) == len(d) == STEPS
    assert a[-1] < a[0] - 0.3  # it trains
    for step, (x, y) in enumerate(zip(a, d, strict=True), 1):
        assert abs(x - y) <= 1e-4 * abs(x), (step, a, d)


def test_checkpoints_load_either_way(runs):
    a, d = losses(runs["autoep"]), losses(runs["dedup"])
    a2d, d2a = losses(runs["autoep->dedup"]), losses(runs["dedup->autoep"])
    assert len(a2d) == len(d2a) == STEPS  # resumed at 3: earlier losses restored
    for step in range(3, STEPS):
        assert abs(a2d[step] - a[step]) <= 1e-4 * abs(a[step]), (step, a, a2d)
        assert abs(d2a[step] - d[step]) <= 1e-4 * abs(d[step]), (step, d, d2a)


def test_progress_reports_bytes_by_tier_and_dedup_sends_less_across_groups(runs):
    moe = {
        k: json.loads((runs[k] / "progress.json").read_text())["moe"] for k in ("autoep", "dedup")
    }
    assert moe["autoep"]["dispatcher"] == "autoep" and moe["dedup"]["dispatcher"] == "dedup"
    for k in ("autoep", "dedup"):
        tiers = moe[k]["allToAllBytesPerStepByTier"]
        assert tiers["crossGroup"] > 0 and tiers["crossNode"] == tiers["crossGroup"], (k, tiers)
        assert tiers["intraGroup"] == 0, (k, tiers)  # one rank per group
    assert (
        moe["dedup"]["allToAllBytesPerStepByTier"]["crossGroup"]
        < moe["autoep"]["allToAllBytesPerStepByTier"]["crossGroup"]
    )


def test_progress_sums_the_bytes_over_the_attempt(runs):
    """``allToAllBytesSinceStart``: the steps this attempt ran and their bytes summed (a resumed
    attempt counts from its restart); the sum keeps dedup below AutoEP over the whole run."""
    since = {
        k: json.loads((runs[k] / "progress.json").read_text())["moe"]["allToAllBytesSinceStart"]
        for k in ("autoep", "dedup", "autoep->dedup")
    }
    assert since["autoep"]["steps"] == since["dedup"]["steps"] == STEPS
    assert since["autoep->dedup"]["steps"] == STEPS - 3
    for k, s in since.items():
        last = json.loads((runs[k] / "progress.json").read_text())["moe"]
        per_step = last["allToAllBytesPerStepByTier"]["crossGroup"]
        total = s["byTier"]["crossGroup"]
        assert per_step < total < 2 * per_step * s["steps"], (k, s, per_step)
    assert since["dedup"]["byTier"]["crossGroup"] < since["autoep"]["byTier"]["crossGroup"]
