"""Re-placement during a job (``moe_trainer.replace`` / ``moe_trainer.replan``), CPU, gloo.

(a) the routine (tests/replace_worker.py): one rank, ZeRO-3 with Hugging Face experts (fp32, and
bf16 with fp32 masters), and two ranks with AutoEP EP 2 (Mixtral, DeepSeek-V3): re-placing every
layer after step 2 moves fp32 masters and Adam states with their experts (read in original order,
the same before and after), and the losses after it equal the never-re-placed run's.
(b, c) two ranks, AutoEP EP 2 with the dedup dispatcher, through ``moe_trainer.train``: a
PlacementUpdate (the file stand-in of the ConfigMap, seeded with generation 0 as the operator
does; generation 1 written while the job runs) is applied at the next checkpoint, the progress
document reports it, losses and the export equal a run that never re-placed, and a
resume from the post-switch checkpoint continues identically.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moe_contracts import placement_update as PU
from moe_trainer.launch import local_world_envs

pytestmark = pytest.mark.slow
PLANS = Path(__file__).parent / "fixtures" / "plans"
WORKER = Path(__file__).parent / "replace_worker.py"
REL = 1e-5


def close(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    return all(abs(x - y) <= REL * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True))


def one_rank_plan(tmp: Path, bf16: bool) -> Path:
    doc = json.loads((PLANS / "tiny_mixtral_zero3_grouped.json").read_text())
    doc["training"].update(steps=4, moeImpl="hf")
    if bf16:  # bf16 parameters the forward reads, fp32 masters: the switch refreshes both
        doc["deepspeed"]["bf16"] = {"enabled": True}
    else:  # no persistent parameter: the forward gathers every one from its partitions
        doc["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = tmp / "plan.json"
    path.write_text(json.dumps(doc))
    return path


def run_worker(tmp: Path, plan: Path, nproc: int, **extra: str) -> list[dict]:
    envs = local_world_envs(nproc, dict(os.environ, SWITCH="2", **extra))
    procs = []
    for r in range(nproc):
        with open(tmp / f"log{r}.txt", "w") as log:  # the child keeps its own copy
            cmd = [sys.executable, str(WORKER), str(plan), str(tmp)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=envs[r]))
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * nproc, (tmp / "log0.txt").read_text()[-3000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_rank_switch_moves_optimizer_state_and_keeps_losses(tmp_path, bf16):
    (doc,) = run_worker(tmp_path, one_rank_plan(tmp_path, bf16), 1)
    (state,) = doc["states"]
    assert state["summary"]["layers"] == 2
    assert set(state["summary"]["stateKeys"]) == {"exp_avg", "exp_avg_sq"}
    assert any(n.endswith("experts.gate_up_proj.exp_avg_sq") for n in state["names"])
    assert any(n.endswith("router.weight.exp_avg") for n in state["names"])
    assert state["equal"], "fp32 masters / Adam states did not move with their experts"
    assert doc["permutation"] == [[1, 3, 0, 2], [2, 0, 3, 1]]
    ref, switched = doc["reference"], doc["switched"]
    if not bf16:
        assert close(ref, switched), (ref, switched)
        assert max(doc["weights_rel_diff"].values()) < 1e-4, doc["weights_rel_diff"]
        return
    # bf16: the step right after the switch runs on the moved bf16 copies (stale ones would
    # change its loss); later steps differ by bf16 rounding of another summation order only
    assert close(ref[:3], switched[:3]), (ref, switched)
    assert abs(ref[3] - switched[3]) <= 1e-3 * abs(ref[3]), (ref, switched)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_two_ranks_expert_parallel_switch_moves_optimizer_state(tmp_path, family):
    """AutoEP EP 2: each rank's slots come from both ranks (``all_to_all_single``); fp32 masters
    and Adam states in original order are the same before and after, on both ranks. DeepSeek-V3:
    shared experts stay, the router's score-correction bias (set non-zero by the worker: it
    decides the top-k) moves with the experts."""
    if family == "mixtral":
        plan = two_rank_plan(tmp_path, tmp_path / "unused")
        doc = json.loads(plan.read_text())
        doc.pop("output")
        doc["training"]["steps"] = 4
    else:
        from family_plans import plan_doc

        doc = plan_doc(family, steps=4, dispatcher="dedup")
        doc["placement"]["permutation"] = [[1, 2, 3, 0], [1, 0, 3, 2]]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    docs = run_worker(tmp_path, plan, 2, NEW=json.dumps(NEW_TWO_RANKS))
    for d in docs:
        (state,) = d["states"]
        # per layer: router weight (+ DeepSeek's bias), tokens_per_expert, w1, w2, w3
        assert state["summary"]["tensors"] == (10 if family == "mixtral" else 12)
        assert any(".experts.w2.exp_avg_sq" in n for n in state["names"])
        assert state["equal"], "fp32 masters / Adam states did not move with their experts"
        assert d["permutation"] == NEW_TWO_RANKS
        assert close(d["reference"], d["switched"]), (d["reference"], d["switched"])
        assert max(d["weights_rel_diff"].values()) < 1e-4, d["weights_rel_diff"]


# ---- (b, c): two ranks, AutoEP + dedup, through the trainer ------------------------------------
STEPS, EVERY = 8, 2
# the plan's [[2, 0, 3, 1], [1, 3, 0, 2]] -> layer 0: every expert changes EP rank; layer 1:
# experts 3 and 2 stay on their EP rank in another slot, 0 and 1 change rank
NEW_TWO_RANKS = [[3, 1, 0, 2], [3, 0, 1, 2]]


def two_rank_plan(tmp: Path, out: Path) -> Path:
    doc = json.loads((PLANS / "tiny_mixtral_autoep.json").read_text())
    doc["ranks"] = [
        {"rank": r, "node": f"node-{r}", "nodeRank": r, "localRank": 0, "gpu": None, "group": r}
        for r in range(2)
    ]
    doc["placement"]["dispatcher"] = "dedup"
    doc["training"].update(steps=STEPS, checkpointEverySteps=EVERY)
    # no persistent parameter: experts and router rows are gathered from moved partitions
    doc["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    doc["output"] = {"path": str(out)}
    path = tmp / f"plan-{out.name}.json"
    path.write_text(json.dumps(doc))
    return path


def train(ckpt: Path, plan: Path, **env) -> list[int]:
    from test_trainer_autoep import run

    return run(ckpt, plan=plan, **env)


def losses(ckpt: Path) -> list[float]:
    return json.loads((ckpt / "losses.json").read_text())["losses"]


def write_when(path: Path, text: str, ready: Path, stop: threading.Event) -> threading.Thread:
    """Write ``text`` to ``path`` (atomically) once ``ready`` exists: the update arrives while the
    job runs."""

    def wait() -> None:
        while not stop.is_set():
            if ready.exists():
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(text)
                os.replace(tmp, path)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("replace")
    new = NEW_TWO_RANKS
    plan_perm = json.loads((PLANS / "tiny_mixtral_autoep.json").read_text())["placement"]
    update = base / "placement.json"  # seeded as the operator does: generation 0, the plan's
    update.write_text(
        PU.dumps(PU.PlacementUpdate(generation=0, permutation=plan_perm["permutation"]))
    )
    out: dict = {"new": new}
    out["ref"] = base / "ref"
    assert train(out["ref"], two_rank_plan(base, base / "export-ref")) == [0, 0]
    # generation 1 arrives once checkpoint step-2 is being written (its read already done): the
    # next checkpoint boundary applies it (step 4; step 6 when the writer thread was late)
    out["switched"] = switched = base / "switched"
    stop = threading.Event()
    doc = PU.dumps(PU.PlacementUpdate(generation=1, permutation=new, decided_at_step=2))
    writer = write_when(update, doc, switched / "ds" / "step-2", stop)
    plan = two_rank_plan(base, base / "export-switched")
    try:
        assert train(switched, plan, MOE_TEST_PLACEMENT_FILE=str(update)) == [0, 0]
    finally:
        stop.set()
        writer.join()
    # resume from the post-switch checkpoint, the update still in place (a no-op)
    applied = json.loads((switched / "progress.json").read_text())["placement"]["appliedAtStep"]
    assert applied in (2 * EVERY, 3 * EVERY), applied
    out["applied"] = applied
    resumed = base / "resumed"
    shutil.copytree(switched / "ds" / f"step-{applied}", resumed / "ds" / f"step-{applied}")
    (resumed / "ds" / "latest").write_text(f"step-{applied}")
    plan = two_rank_plan(base, base / "export-resumed")
    assert train(resumed, plan, MOE_TEST_PLACEMENT_FILE=str(update)) == [0, 0]
    out["resumed"] = resumed
    return out


def test_switch_is_applied_at_the_next_checkpoint_and_reported(runs):
    prog = json.loads((runs["switched"] / "progress.json").read_text())
    assert prog["placement"]["generation"] == 1
    assert prog["placement"]["appliedAtStep"] == runs["applied"] > EVERY  # not before it came
    assert prog["placement"]["seconds"] >= 0 and prog["placement"]["message"] == ""
    ref = json.loads((runs["ref"] / "progress.json").read_text())
    assert "placement" not in ref
    from moe_contracts.progress import parse_progress

    assert parse_progress(prog).placement.generation == 1


def test_losses_and_export_equal_the_never_replaced_run(runs):
    a, b = losses(runs["ref"]), losses(runs["switched"])
    assert close(a, b), (a, b)
    from safetensors.torch import load_file

    ref_dir, sw_dir = runs["ref"].parent / "export-ref", runs["switched"].parent / "export-switched"
    ta, tb = load_file(ref_dir / "model.safetensors"), load_file(sw_dir / "model.safetensors")
    assert ta.keys() == tb.keys()
    for k in ta:
        d = float((ta[k] - tb[k]).abs().max())
        assert d <= 1e-4 * max(1.0, float(ta[k].abs().max())), (k, d)


def test_resume_after_the_switch_uses_the_checkpoints_permutation(runs):
    import torch

    def placement(step: int) -> dict:
        tag = runs["switched"] / "ds" / f"step-{step}" / "trainer_state.pt"
        return torch.load(tag, weights_only=False)["placement"]

    assert placement(EVERY)["generation"] == 0  # the seeded generation 0 moved nothing
    after = placement(runs["applied"])
    assert after["generation"] == 1 and after["permutation"] == runs["new"]
    a, b = losses(runs["switched"]), losses(runs["resumed"])
    assert close(a, b), (a, b)
    prog = json.loads((runs["resumed"] / "progress.json").read_text())
    assert prog["placement"] == dict(prog["placement"], generation=1, appliedAtStep=runs["applied"])


def test_routing_stats_carry_the_window_since_the_previous_checkpoint(runs):
    from moe_contracts.routing import read_routing_stats, window_stats

    doc = json.loads((runs["switched"] / "routing_stats.json").read_text())
    whole, window = read_routing_stats(doc), window_stats(doc)
    assert window is not None and doc["window"]["fromStep"] == STEPS - EVERY
    assert window.steps == EVERY and whole.steps == STEPS
    assert window.tokens * STEPS == whole.tokens * EVERY
    # the window's own sample (it holds fewer tokens than routingSampleTokens: all of them),
    # routed after the switch and read in original ids, counts to the window's load
    te = window.token_experts
    assert te is not None and te.shape[1] == window.tokens
    for layer, want in enumerate(window.load):
        assert np.bincount(te[layer].ravel(), minlength=len(want)).tolist() == want.tolist()
