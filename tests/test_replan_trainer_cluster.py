"""Re-placement during a job end to end (issue 33): the real operator, API server and node agent,
and REAL multi-rank CPU trainers (DeepSpeed ZeRO-3 + AutoEP on gloo, the de-duplicating
dispatcher, 2 node ranks = 2 NVLink groups, EP 2).

The user's story: a team fine-tunes its pretrained MoE with no earlier run's routing statistics.
The launch plan is made on none (the contiguous layout); the job's own routing is known after
its first checkpoints, and the operator re-places to fit it. The model is tests/planted_routing.py's
(a pretrained MoE's routers have learned structure; a random init's route without it, and a
re-fit there wins nothing but noise), trained on its arithmetic text, whose expert pairs the
contiguous layout splits in half of the cases.

Two jobs on the same data and seed, applied together: job A with ``placement.replan`` and no
``routingStatsFrom``, job B the same without ``replan``. What a user would notice:

- A switches exactly once: ``<job>-placement`` generation 1, one ``PlacementUpdated`` Event,
  ``status.placementHistory`` with the decision's step, the checkpoint step the trainer applied it
  at and a predicted saving; its final progress reports generation 1. B never re-places.
- The switch is function preserving: A's per-step losses equal B's (the trainer's re-placement
  tolerance, tests/test_replace.py).
- The trainers counted fewer cross-group bytes in A than in B over the same steps after the
  switch (before it both ran the same placement on the same tokens and counted the same bytes).

With ``MOE_REPLAN_RESULTS=<path>`` the measured figures are written there
(``benchmarks/results/replan_cluster.json``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moejob_operator import constants as C
from operator_harness import apply_job, events_for, get_job, module_operator, seed_topology
from planted_routing import arithmetic_text, planted_model, prose_text
from replan_cluster_util import (
    GLOBAL_BATCH,
    SEQ_LEN,
    ProgressLog,
    applied_switch,
    close,
    counted_after_switch,
    finished,
    losses_of,
    max_rel_diff,
    placement_of,
    planted_job,
    progress_of,
    switch_figures,
    write_results,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

operator_proc = module_operator("operator-replan-trainer")
STEPS, EVERY = 32, 4
# replayed on a recording of this test (every window a check could see), a first switch is
# predicted 17.1-31.2 % held out in the windows up to step 16 (12.4 % at step 20, 21.2 % at 24),
# a second one at most 8.9 % (the model's deeper layers keep learning the arithmetic)
MIN_GAIN = 15


def _data(root: Path) -> tuple[dict, Path]:
    """``spec.data`` (the arithmetic text, enough for the run) and the planted model."""
    n = STEPS * GLOBAL_BATCH * (SEQ_LEN + 1)
    arithmetic = arithmetic_text(n)
    d = root / "data"
    d.mkdir(parents=True)
    (d / "arithmetic.txt").write_text(arithmetic)
    model = planted_model(root / "model", prose_text(4 * n), arithmetic)
    return {"kind": "Text", "path": "/data", "volume": {"hostPath": {"path": str(d)}}}, model


def test_replan_switches_once_keeps_losses_and_counts_fewer_cross_group_bytes(
    kube, namespace, operator_proc, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    data, model = _data(tmp_path)
    t0 = time.monotonic()
    runs = {"steps": STEPS, "every": EVERY, "min_gain": MIN_GAIN}
    made = {
        name: apply_job(
            kube, namespace, planted_job(name, tmp_path, model, data, replan=replan, **runs)
        )
        for name, replan in (("rp-a", True), ("rp-b", False))
    }
    dirs = {n: tmp_path / f"{n}-{m['metadata']['uid'][:8]}" for n, m in made.items()}

    def diagnose(name: str) -> str:
        st = get_job(kube, namespace, name).get("status") or {}
        return f"{name}: {json.dumps(st, indent=1)[-4000:]}\n{operator_proc.logs()[-4000:]}"

    def replan_status():
        return (get_job(kube, namespace, "rp-a").get("status") or {}).get("replan")

    with ProgressLog(dirs, replan_status) as plog:
        for name in made:
            st = wait_for(
                lambda name=name: finished(kube, namespace, name),
                timeout=2400,
                interval=2,
                message=f"{name} finished",
            )
            assert st["phase"] == "Succeeded", diagnose(name)
    seconds = time.monotonic() - t0

    # ---- 1. A switched exactly once, at the checkpoint after the decision ------------------
    plan = json.loads(kube.core.read_namespaced_config_map("rp-a-plan", namespace).data[C.PLAN_KEY])
    assert plan["placement"]["dispatcher"] == "dedup" and plan["epSize"] == 2
    assert "routingStatsFrom" not in plan["placement"]  # launched on no statistics
    gen = placement_of(kube, namespace, "rp-a")
    assert gen.generation == 1, diagnose("rp-a")
    assert gen.permutation != plan["placement"]["permutation"]
    prog_a = progress_of(kube, namespace, "rp-a")
    applied = prog_a["placement"]["appliedAtStep"]
    assert prog_a["placement"]["generation"] == 1 and prog_a["placement"]["message"] == ""
    assert prog_a["step"] == STEPS

    h = applied_switch(kube, namespace, wait_for, "rp-a")
    assert h["generation"] == 1 and h["decidedAtStep"] == gen.decided_at_step
    assert h["appliedAtStep"] == applied
    assert applied > h["decidedAtStep"] and applied % EVERY == 0 and applied < STEPS, h
    before, after = h["predictedCrossGroupBytesBefore"], h["predictedCrossGroupBytesAfter"]
    assert after < before, h
    reasons = [e.reason for e in events_for(kube, namespace, "rp-a")]
    assert reasons.count(C.R_PLACEMENT_UPDATED) == 1, reasons

    # ---- 4. B never re-places --------------------------------------------------------------
    st_b = get_job(kube, namespace, "rp-b")["status"]
    assert not st_b.get("placementHistory") and not st_b.get("replan"), st_b
    assert C.R_PLACEMENT_UPDATED not in [e.reason for e in events_for(kube, namespace, "rp-b")]
    prog_b = progress_of(kube, namespace, "rp-b")
    assert (prog_b.get("placement") or {}).get("generation", 0) == 0, prog_b.get("placement")
    try:
        assert placement_of(kube, namespace, "rp-b").generation == 0
    except Exception as exc:  # noqa: BLE001 - no ConfigMap at all: nothing to re-place either
        assert getattr(exc, "status", None) == 404, exc

    # ---- 2. the losses: a function preserving switch ---------------------------------------
    losses = losses_of(dirs)
    la, lb = losses["rp-a"], losses["rp-b"]
    assert len(la) == len(lb) == STEPS
    assert la[:applied] == lb[:applied]  # the same placement, tokens and arithmetic before it
    assert close(la, lb), (la, lb)
    max_rel = max_rel_diff(la, lb)

    # ---- 3. the bytes the trainers counted over the same steps after the switch ------------
    end = {n: p["moe"]["allToAllBytesSinceStart"] for n, p in (("rp-a", prog_a), ("rp-b", prog_b))}
    assert end["rp-a"]["steps"] == end["rp-b"]["steps"] == STEPS
    at, counted = counted_after_switch(plog, end, "rp-a", "rp-b", applied)
    figures = {
        **switch_figures(counted, at, STEPS, before, after, "rp-a", "rp-b"),
        "countedCrossGroupBytesPerStepAfterSwitch": {
            n: round(c / (STEPS - at)) for n, c in counted.items()
        },
        "decidedAtStep": h["decidedAtStep"],
        "appliedAtStep": applied,
        "switchSeconds": prog_a["placement"]["seconds"],
        "lossMaxRelDiff": max_rel,
        "lossesA": la,
        "lossesB": lb,
        "replanChecks": plog.checks,
        "wallSeconds": round(seconds, 1),
    }
    print(json.dumps(figures, indent=1))
    _write_results(figures)
    assert counted["rp-a"] < counted["rp-b"], figures


def _write_results(figures: dict) -> None:
    setup = {
        "model": "tiny-mixtral (8 experts, top-2, 4 layers) with planted domain-dependent "
        "routing (tests/planted_routing.py), CPU, gloo",
        "nodes": "2 node ranks x 1 rank (2 NVLink groups), EP 2, dispatcher dedup",
        "data": "Text: arithmetic (tests/planted_routing.py arithmetic_text)",
        "shape": f"seqLen {SEQ_LEN} x globalBatch {GLOBAL_BATCH}, learning rate 1e-3",
        "steps": STEPS,
        "checkpointEverySteps": EVERY,
        "replan": {"everySteps": EVERY, "minPredictedGainPercent": MIN_GAIN},
        "jobs": {"rp-a": "replan, no routingStatsFrom", "rp-b": "the same without replan"},
    }
    write_results("MOE_REPLAN_RESULTS", "tests/test_replan_trainer_cluster.py", setup, figures)
