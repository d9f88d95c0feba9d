"""Re-placement during a job with expert copies (#33), through ``moe_trainer.train``: 4 gloo
processes as 2 nodes x 2 ranks (EP 4, 8 experts, top-2, the dedup dispatcher). The plan carries
copies; generation 1 of the PlacementUpdate (the file stand-in of the ConfigMap, seeded with
generation 0 = the plan's permutation and copies, as the operator does) brings a new permutation
and other copies. The switch is applied at the next checkpoint; the losses equal the run that never
re-placed (copies compute with their home's weights, so a switch preserves the function); the
progress document's copy-sync bytes are the new copies'; a resume from the post-switch checkpoint
runs the checkpoint's copies, not the plan's, and continues identically."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from moe_contracts import placement_update as PU
from test_dedup_replicas_training import EXTRA, GROUPS, PERM, copies, two_by_two_doc
from test_replace import write_when
from test_trainer_autoep import run

pytestmark = pytest.mark.slow
STEPS, EVERY = 8, 2
P = len(GROUPS)
NEW = [[4, 1, 6, 3, 0, 5, 2, 7], [0, 2, 7, 5, 1, 6, 3, 4]]
# extra holders per original expert after the switch: 3 copies (one in the same group), against
# the launch's 7 (EXTRA)
EXTRA_NEW = [{1: [3], 4: [1]}, {4: [1]}]
ROW = 3 * 64 * 128 * 4  # fp32 w1 + w2 + w3 of one tiny-mixtral expert


def cross_group_copies(reps: list[dict]) -> int:
    return sum(GROUPS[r] != GROUPS[h[0]] for layer in reps for h in layer["holders"] for r in h[1:])


def plan(tmp: Path) -> Path:
    doc = two_by_two_doc()
    # no persistent parameter: experts and router rows are gathered from moved partitions
    doc["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    doc["placement"]["replicas"] = copies(PERM, EXTRA)
    doc["training"].update(steps=STEPS, checkpointEverySteps=EVERY)
    path = tmp / "plan.json"
    path.write_text(json.dumps(doc))
    return path


def losses(ckpt: Path) -> list[float]:
    return json.loads((ckpt / "losses.json").read_text())["losses"]


def progress(ckpt: Path) -> dict:
    return json.loads((ckpt / "progress.json").read_text())


def close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("replace_replicas")
    path = plan(base)
    update = base / "placement.json"
    seed = PU.PlacementUpdate(generation=0, permutation=PERM, replicas=copies(PERM, EXTRA))
    update.write_text(PU.dumps(seed))
    out = {"ref": base / "ref", "switched": base / "switched"}
    assert run(out["ref"], plan=path, nproc=P) == [0] * P
    # generation 1 arrives once checkpoint step-2 is being written: applied at step 4 (6 if late)
    gen1 = PU.PlacementUpdate(
        generation=1, permutation=NEW, decided_at_step=2, replicas=copies(NEW, EXTRA_NEW)
    )
    stop = threading.Event()
    writer = write_when(update, PU.dumps(gen1), out["switched"] / "ds" / "step-2", stop)
    try:
        assert (
            run(out["switched"], plan=path, nproc=P, MOE_TEST_PLACEMENT_FILE=str(update)) == [0] * P
        )
    finally:
        stop.set()
        writer.join()
    applied = progress(out["switched"])["placement"]["appliedAtStep"]
    assert applied in (2 * EVERY, 3 * EVERY), applied
    out["applied"] = applied
    # resume from the post-switch checkpoint with the same plan (its copies fit PERM only)
    resumed = out["resumed"] = base / "resumed"
    shutil.copytree(out["switched"] / "ds" / f"step-{applied}", resumed / "ds" / f"step-{applied}")
    (resumed / "ds" / "latest").write_text(f"step-{applied}")
    assert run(resumed, plan=path, nproc=P, MOE_TEST_PLACEMENT_FILE=str(update)) == [0] * P
    return out


def test_the_switch_with_copies_is_applied_and_keeps_the_losses(runs):
    prog = progress(runs["switched"])["placement"]
    assert prog["generation"] == 1 and prog["message"] == "", prog
    a, b = losses(runs["ref"]), losses(runs["switched"])
    assert len(a) == STEPS and a[-1] < a[0]
    assert close(a, b), (a, b)


def test_the_new_copies_serve_after_the_switch(runs):
    sync = {
        k: progress(runs[k])["moe"]["replicaSyncBytesPerStepByTier"] for k in runs if k != "applied"
    }
    for name, reps in (("ref", copies(PERM, EXTRA)), ("switched", copies(NEW, EXTRA_NEW))):
        n = cross_group_copies(reps)
        assert sync[name]["crossGroup"] == 2 * n * ROW, (name, sync)
    assert cross_group_copies(copies(NEW, EXTRA_NEW)) < cross_group_copies(copies(PERM, EXTRA))
    assert sync["switched"]["intraGroup"] == 2 * ROW  # expert 4's copy on rank 1, home rank 0
    tag = runs["switched"] / "ds" / f"step-{runs['applied']}" / "trainer_state.pt"
    state = torch.load(tag, weights_only=False)["placement"]
    assert state["generation"] == 1 and state["permutation"] == NEW
    got = [
        {"holders": [list(h) for h in r["holders"]], "serve": [list(s) for s in r["serve"]]}
        for r in state["replicas"]
    ]
    assert got == copies(NEW, EXTRA_NEW)


def test_a_resume_after_the_switch_runs_the_checkpoints_copies(runs):
    a, b = losses(runs["switched"]), losses(runs["resumed"])
    assert close(a, b), (a, b)
    got = progress(runs["resumed"])
    assert got["placement"]["generation"] == 1
    assert (
        got["moe"]["replicaSyncBytesPerStepByTier"]
        == progress(runs["switched"])["moe"]["replicaSyncBytesPerStepByTier"]
    )
