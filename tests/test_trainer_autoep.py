"""End to end on CPU: 2-process ZeRO-3 + AutoEP (EP size 2) tiny Mixtral from the plan fixture.

One straight 10-step run and one run killed after step 7 (fault hook, exit 75) then restarted;
several assertions share these runs because each costs ~40 s of the machine's 2 cores. Their
token sample keeps fewer tokens than a run routes (``SAMPLE_TOKENS``), so it is a real sample.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from moe_contracts.routing import parse_routing_stats as check_routing_stats
from moe_trainer.launch import launch

pytestmark = pytest.mark.slow
PLAN = Path(__file__).parent / "fixtures" / "plans" / "tiny_mixtral_autoep.json"
SAMPLE_TOKENS = 128  # training.routingSampleTokens of the shared runs: half a step's tokens


def run(ckpt: Path, plan: Path = PLAN, nproc: int = 2, **env) -> list[int]:
    e = dict(os.environ, **env)
    for k in (
        "MOE_FAULT_EXIT_AT_STEP",
        "MOE_FAULT_EXIT_CODE",
        "MOE_FAULT_NAN_AT_STEP",
        "MOE_PROGRESS_CONFIGMAP",
    ):
        if k not in env:
            e.pop(k, None)
    return launch(
        nproc,
        ["--plan", str(plan), "--checkpoint-dir", str(ckpt), "--cpu"],
        env=e,
        timeout=400,
        log_prefix=str(ckpt) + "-log",
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("autoep")
    straight, resumed = base / "straight", base / "resumed"
    doc = json.loads(PLAN.read_text())
    doc["training"]["routingSampleTokens"] = SAMPLE_TOKENS
    plan = base / "plan.json"
    plan.write_text(json.dumps(doc))
    codes = {
        "straight": run(straight, plan, MOE_VERIFY_PLACEMENT="1"),
        "killed": run(resumed, plan, MOE_FAULT_EXIT_AT_STEP="7", MOE_FAULT_EXIT_CODE="75"),
    }
    killed_progress = json.loads((resumed / "progress.json").read_text())
    codes["restarted"] = run(resumed, plan, MOE_FAULT_EXIT_AT_STEP="7", MOE_FAULT_EXIT_CODE="75")
    return {
        "codes": codes,
        "straight": straight,
        "resumed": resumed,
        "killed_progress": killed_progress,
    }


def test_exit_codes(runs):
    assert runs["codes"] == {"straight": [0, 0], "killed": [75, 75], "restarted": [0, 0]}
    assert runs["killed_progress"]["step"] == 7
    assert runs["killed_progress"]["checkpoint"]["step"] == 6


def test_loss_falls(runs):
    losses = json.loads((runs["straight"] / "losses.json").read_text())["losses"]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5


def test_each_rank_holds_the_planned_experts(runs):
    plan = json.loads(PLAN.read_text())
    perm = plan["placement"]["permutation"]
    for rank in range(2):
        report = json.loads((runs["straight"] / f"placement_check_rank{rank}.json").read_text())
        assert report["ok"]
        assert [x["experts"] for x in report["layers"]] == [
            row[rank * 2 : rank * 2 + 2] for row in perm
        ]
        assert all(x["epRank"] == rank for x in report["layers"])


def test_resume_continues_bitwise_identically(runs):
    a = json.loads((runs["straight"] / "losses.json").read_text())["losses"]
    b = json.loads((runs["resumed"] / "losses.json").read_text())["losses"]
    assert a == b  # exact float equality, steps 1..10
    for name in sorted(os.listdir(runs["straight"] / "ds" / "step-10")):
        if not name.startswith("zero_pp_rank"):
            continue
        sa = torch.load(
            runs["straight"] / "ds" / "step-10" / name, weights_only=False, map_location="cpu"
        )
        sb = torch.load(
            runs["resumed"] / "ds" / "step-10" / name, weights_only=False, map_location="cpu"
        )
        n = assert_tensors_equal(sa, sb, name)
        if "optim_states" in name:
            assert n > 0
    ra = json.loads((runs["straight"] / "routing_stats.json").read_text())
    rb = json.loads((runs["resumed"] / "routing_stats.json").read_text())
    assert ra == rb


def assert_tensors_equal(a, b, path) -> int:
    """Recursively compare checkpoint contents; returns how many tensors were compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), path
        return 1
    if isinstance(a, dict):
        return sum(
            assert_tensors_equal(v, b[k], f"{path}.{k}")
            for k, v in a.items()
            if k not in ("ds_config", "ds_version", "global_samples")
        )
    if isinstance(a, (list, tuple)):
        return sum(
            assert_tensors_equal(x, y, f"{path}[{i}]")
            for i, (x, y) in enumerate(zip(a, b, strict=True))
        )
    return 0


def test_routing_stats_progress_and_heatmap(runs):
    d = runs["straight"]
    stats = json.loads((d / "routing_stats.json").read_text())
    check_routing_stats(stats)
    assert (stats["numLayers"], stats["numExperts"], stats["topK"], stats["steps"]) == (2, 4, 2, 10)
    assert stats["tokens"] == 10 * 2 * 2 * 64  # steps x ranks x microBatch x seqLen
    prog = json.loads((d / "progress.json").read_text())
    assert prog["kind"] == "TrainerProgress" and prog["phase"] == "Finished" and prog["step"] == 10
    assert prog["checkpoint"]["step"] == 10 and prog["tokensPerSecond"] > 0
    moe = prog["moe"]
    assert len(moe["maxMeanLoadPerLayer"]) == 2 and all(
        x >= 1.0 for x in moe["maxMeanLoadPerLayer"]
    )
    assert moe["allToAllSecondsPerStep"] > 0 and moe["allGatherSecondsPerStep"] > 0
    assert moe["fragmentation"] is None  # CPU
    assert moe["peakMemoryAllocatedBytesByRank"] is None
    # bytes each rank sent in the last step's all-to-alls vs the planner's AutoEP model on this
    # run's own routing (per-step mean; fwd + bwd, fp32 rows); the total is placement-independent
    import numpy as np

    from moejob_operator.core.cost import autoep_sends
    from moejob_operator.core.placement import Placement

    plan = json.loads(PLAN.read_text())
    perm = np.array(plan["placement"]["permutation"])
    pl = Placement("plan", perm, np.arange(2), 2)
    load = np.array(stats["load"], dtype=float) / stats["steps"]
    row = plan["model"]["hfConfig"]["hidden_size"] * 4
    predicted = 2 * autoep_sends(pl, load) * row
    measured = np.array(moe["allToAllBytesPerStepByRank"], dtype=float)
    assert len(measured) == 2 and (measured > 0).all()
    assert 0.9 < measured.sum() / predicted.sum() < 1.1, (measured, predicted)  # 0.98 here
    assert (d / "ds" / "latest").read_text().strip() == "step-10"


def test_the_last_window_carries_a_full_sample_of_its_own(runs):
    """The final publish's window is step 10 alone (the checkpoint at step 9 published before it):
    256 tokens, of which it carries a full sample of its own, ``SAMPLE_TOKENS`` of them, all of
    step 10, over both ranks. The whole-run sample holds about a tenth of that from step 10: cut
    out of it, the window would have been too small for the re-placement decision. The resumed
    run (restarted from step 6) published the same window (``ra == rb`` above)."""
    from moe_contracts.routing import window_stats

    stats = json.loads((runs["straight"] / "routing_stats.json").read_text())
    assert stats["window"]["fromStep"] == 9 and stats["window"]["tokens"] == 2 * 2 * 64
    window = window_stats(stats)
    assert window is not None and window.token_steps is not None
    assert window.token_experts.shape[1] == SAMPLE_TOKENS
    assert set(window.token_steps.tolist()) == {10}
    whole = check_routing_stats(stats)
    assert whole.token_steps is not None and len(whole.token_steps) == SAMPLE_TOKENS
    assert int((whole.token_steps == 10).sum()) < SAMPLE_TOKENS // 2


@pytest.mark.parametrize(
    ("preset", "family"), [("tiny-qwen3-moe", "qwen3_moe"), ("tiny-deepseek-v3", "deepseek_v3")]
)
def test_other_families_train_under_autoep(tmp_path, preset, family):
    """Qwen3-MoE and DeepSeek-V3 (shared experts, sigmoid group routing) under ZeRO-3 + AutoEP, 3
    steps."""
    from moe_trainer.model.models import TINY_HF_CONFIGS

    doc = json.loads(PLAN.read_text())
    doc["model"] = {
        "family": family,
        "preset": preset,
        "path": None,
        "hfConfig": TINY_HF_CONFIGS[preset],
    }
    doc["deepspeed"]["expert_parallel"]["preset_model"] = family
    doc["training"]["steps"] = 3
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    assert run(tmp_path / "ck", plan=plan, MOE_VERIFY_PLACEMENT="1") == [0, 0]
    stats = json.loads((tmp_path / "ck" / "routing_stats.json").read_text())
    check_routing_stats(stats)
    assert stats["steps"] == 3 and stats["model"] == preset
    perm = doc["placement"]["permutation"]
    for rank in range(2):
        rep = json.loads((tmp_path / "ck" / f"placement_check_rank{rank}.json").read_text())
        assert rep["ok"] and [x["experts"] for x in rep["layers"]] == [
            r[rank * 2 : rank * 2 + 2] for r in perm
        ]
    log = (tmp_path / "ck-log.rank0.log").read_text()
    assert "MoE blocks after initialize: 2 x AutoEPMoELayer" in log
