"""MoEPlan placement.replicas (docs/contracts.md, "Replicated experts"): the contract's checks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from moe_contracts.plan import PlanError, parse_plan

PLAN = Path(__file__).parent / "fixtures" / "plans" / "tiny_mixtral_autoep.json"


def _plan() -> dict:
    doc = json.loads(PLAN.read_text())
    pl = doc["placement"]
    pl["dispatcher"] = "dedup"
    return doc


def _replicas(doc: dict) -> list[dict]:
    pl = doc["placement"]
    E, P = pl["numExperts"], pl["epSize"]
    n = E // P
    out = []
    for row in pl["permutation"]:
        home = {e: slot // n for slot, e in enumerate(row)}
        holders = [[home[e]] for e in range(E)]
        hot = row[0]
        holders[hot] = [home[hot]] + [r for r in range(P) if r != home[hot]]
        serve = [[p if p in holders[e] else holders[e][0] for e in range(E)] for p in range(P)]
        out.append({"holders": holders, "serve": serve})
    return out


def test_a_plan_with_replicas_parses_and_keeps_them():
    doc = _plan()
    if doc["placement"]["epSize"] < 2:
        pytest.skip("fixture has one EP rank")
    doc["placement"]["replicas"] = _replicas(doc)
    plan = parse_plan(doc)
    rep = plan.placement.replicas
    assert rep is not None and len(rep) == doc["placement"]["numLayers"]
    assert [list(h) for h in rep[0].holders] == doc["placement"]["replicas"][0]["holders"]


@pytest.mark.parametrize(
    ("breaks", "words"),
    [
        (
            lambda r, pl: r[0]["holders"].__setitem__(
                pl["permutation"][0][0], [1 - r[0]["holders"][pl["permutation"][0][0]][0]]
            ),
            "must start with the home rank",
        ),
        (lambda r, pl: r[0]["serve"][0].__setitem__(0, 99), "holds no copy of expert 0"),
        (lambda r, pl: r[0]["holders"][0].append(r[0]["holders"][0][0]), "are not distinct"),
        (lambda r, pl: r.pop(), "layers, numLayers is"),
        (lambda r, pl: pl.__setitem__("dispatcher", "autoep"), "'dedup' dispatcher only"),
    ],
)
def test_inconsistent_replicas_are_refused_with_the_field(breaks, words):
    doc = _plan()
    if doc["placement"]["epSize"] < 2:
        pytest.skip("fixture has one EP rank")
    reps = _replicas(doc)
    doc["placement"]["replicas"] = reps
    bad = copy.deepcopy(doc)
    breaks(bad["placement"]["replicas"], bad["placement"])
    with pytest.raises(PlanError, match="placement") as err:
        parse_plan(bad)
    assert words in str(err.value)
