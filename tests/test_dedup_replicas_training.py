"""ZeRO-3 + AutoEP training with replicated experts through `moe_trainer.train` (#33): 4 gloo
processes as 2 nodes x 2 ranks (EP 4, 8 experts, top-2). 20 steps with copies (one in the other
group, and copies on both ranks of one group) follow the same run without copies; a checkpoint
written with copies resumes without them and vice versa (one copy per expert in every
checkpoint)."""

import json
import shutil
from pathlib import Path

import pytest

from test_trainer_autoep import PLAN, run

pytestmark = pytest.mark.slow
STEPS, HALF = 20, 10
E, P, GROUPS = 8, 4, [0, 0, 1, 1]
PERM = [[0, 1, 2, 3, 4, 5, 6, 7], [5, 2, 7, 0, 1, 6, 3, 4]]


# Layer 0: experts 0 and 4 get a copy in the other group, expert 6 copies on both ranks of
# group 0; layer 1: original experts 5 and 3 get copies in the other group
EXTRA = [{0: [2], 4: [0], 6: [0, 1]}, {5: [3], 3: [0, 1]}]


def copies(perm: list[list[int]], extra: list[dict[int, list[int]]]) -> list[dict]:
    """``placement.replicas`` for ``perm`` with ``extra`` holders per original expert: a token's
    expert is served on its own rank when it holds a copy, else from its group, else the home."""
    out = []
    for row, more in zip(perm, extra, strict=True):
        home = {e: slot // (E // P) for slot, e in enumerate(row)}
        holders = [[home[e], *more.get(e, [])] for e in range(E)]

        def serve(p, e, holders=holders):
            same = [r for r in holders[e] if GROUPS[r] == GROUPS[p]]
            return p if p in holders[e] else (same[0] if same else holders[e][0])

        out.append(
            {"holders": holders, "serve": [[serve(p, e) for e in range(E)] for p in range(P)]}
        )
    return out


def replicas() -> list[dict]:
    return copies(PERM, EXTRA)


def two_by_two_doc() -> dict:
    """The AutoEP test plan as 2 nodes x 2 ranks, EP over all of them, with the dedup dispatcher
    on ``PERM`` (no copies)."""
    doc = json.loads(PLAN.read_text())
    doc["worldSize"] = doc["epSize"] = P
    doc["model"]["hfConfig"]["num_local_experts"] = E
    doc["ranks"] = [
        {"rank": r, "node": f"node-{r // 2}", "nodeRank": r // 2, "localRank": r % 2, "gpu": None}
        for r in range(P)
    ]
    doc["deepspeed"]["expert_parallel"]["autoep_size"] = P
    doc["placement"].update(numExperts=E, epSize=P, permutation=PERM, dispatcher="dedup")
    return doc


def plan_for(tmp: Path, with_copies: bool) -> Path:
    doc = two_by_two_doc()
    if with_copies:
        doc["placement"]["replicas"] = replicas()
    doc["training"].update(steps=STEPS, checkpointEverySteps=HALF)
    path = tmp / f"plan-{'copies' if with_copies else 'single'}.json"
    path.write_text(json.dumps(doc))
    return path


def losses(ckpt: Path) -> list[float]:
    return json.loads((ckpt / "losses.json").read_text())["losses"]


def resume_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "ds" / f"step-{HALF}", dst / "ds" / f"step-{HALF}")
    (dst / "ds" / "latest").write_text(f"step-{HALF}")
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("replica_train")
    plans = {k: plan_for(base, k == "copies") for k in ("single", "copies")}
    out = {}
    for name, plan in plans.items():
        out[name] = base / name
        assert run(out[name], plan=plan, nproc=P) == [0] * P, name
    out["copies->single"] = resume_copy(out["copies"], base / "c2s")
    assert run(out["copies->single"], plan=plans["single"], nproc=P) == [0] * P
    out["single->copies"] = resume_copy(out["single"], base / "s2c")
    assert run(out["single->copies"], plan=plans["copies"], nproc=P) == [0] * P
    return out


def test_copies_follow_the_single_copy_loss_step_for_step(runs):
    a, b = losses(runs["single"]), losses(runs["copies"])
    assert len(a) == len(b) == STEPS
    assert a[-1] < a[0] - 0.3  # it trains
    for step, (x, y) in enumerate(zip(a, b, strict=True), 1):
        assert abs(x - y) <= 1e-4 * abs(x), (step, a, b)


def test_checkpoints_resume_with_and_without_copies(runs):
    a, b = losses(runs["single"]), losses(runs["copies"])
    c2s, s2c = losses(runs["copies->single"]), losses(runs["single->copies"])
    assert len(c2s) == len(s2c) == STEPS
    for step in range(HALF, STEPS):
        assert abs(c2s[step] - a[step]) <= 1e-4 * abs(a[step]), (step, a, c2s)
        assert abs(s2c[step] - b[step]) <= 1e-4 * abs(b[step]), (step, b, s2c)


def test_progress_reports_fewer_token_bytes_and_the_weight_sync_bytes(runs):
    moe = {
        k: json.loads((runs[k] / "progress.json").read_text())["moe"] for k in ("single", "copies")
    }
    assert moe["copies"]["dispatcher"] == "dedup"
    single = moe["single"]["allToAllBytesPerStepByTier"]["crossGroup"]
    copies = moe["copies"]["allToAllBytesPerStepByTier"]["crossGroup"]
    assert 0 < copies < single, moe
    # the copies' weights, there and back, once per layer and step (fp32 w1 + w2 + w3 per copy)
    row = 3 * 64 * 128 * 4
    n = sum(len(h) - 1 for layer in replicas() for h in layer["holders"])
    assert n == 7  # all of them across groups (= nodes)
    want = {"intraGroup": 0, "crossGroup": 2 * n * row, "crossNode": 2 * n * row}
    assert moe["copies"]["replicaSyncBytesPerStepByTier"] == want
    assert moe["single"]["replicaSyncBytesPerStepByTier"] is None
