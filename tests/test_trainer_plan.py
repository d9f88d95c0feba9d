"""The trainer's MoEPlan v1 reader: accepts the fixture, refuses bad documents naming the field."""

import copy
import json
from pathlib import Path

import pytest

from moe_contracts.plan import PlanError, load_plan, parse_plan, resolve_plan_path

FIXTURE = Path(__file__).parent / "fixtures" / "plans" / "tiny_mixtral_autoep.json"


@pytest.fixture
def doc():
    return json.loads(FIXTURE.read_text())


def test_fixture_parses(doc):
    plan = parse_plan(doc)
    assert plan.world_size == 2 and plan.ep_size == 2 and plan.autoep_enabled
    assert plan.placement.experts_per_rank == 2
    # slot s lives on EP rank s // (E / ep): rank 1 of layer 0 holds slots 2, 3
    assert plan.placement.experts_of_ep_rank(0, 1) == (3, 1)
    assert plan.training.balance.mode == "per_layer_aux" and plan.training.balance.coef == 0.01
    assert plan.training.data.kind == "corpus"
    assert plan.training.moe_impl == "hf"
    assert not plan.placement.is_identity()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(kind="TopologyReport"), r"kind: 'TopologyReport' is not 'MoEPlan'"),
        (lambda d: d.update(version=2), r"version: 2 is not a known version"),
        (lambda d: d.pop("worldSize"), r"worldSize: required field is missing"),
        (
            lambda d: d.update(worldSize="2"),
            r"worldSize: '2' is invalid \(Input should be a valid integer\)",
        ),
        (
            lambda d: d["placement"]["permutation"].__setitem__(1, [0, 0, 1, 2]),
            r"placement.permutation\[1\]: \[0, 0, 1, 2\] is not a permutation of 0..3",
        ),
        (
            lambda d: d["placement"].update(numLayers=3),
            r"placement.permutation: has 2 rows, numLayers is 3",
        ),
        (
            lambda d: d["placement"].update(epSize=3),
            r"placement.epSize: 3 does not divide numExperts=4",
        ),
        (
            lambda d: d["deepspeed"]["expert_parallel"].update(autoep_size=1),
            r"deepspeed.expert_parallel.autoep_size: 1 differs from epSize 2",
        ),
        (
            lambda d: d["model"].update(hfConfig=None),
            r"model.hfConfig: required when model.path is null",
        ),
        (
            lambda d: d["model"]["hfConfig"].pop("model_type"),
            r"model.hfConfig.model_type: required",
        ),
        (lambda d: d["ranks"][1].update(rank=5), r"ranks\[1\].rank: 5 out of order"),
        (
            lambda d: d["training"]["balance"].update(mode="magic"),
            (
                r"training.balance.mode: 'magic' is invalid \(Input should be 'per_layer_aux', "
                r"'global_aux' or 'none'\)"
            ),
        ),
        (
            lambda d: d["training"].update(moeImpl="fast"),
            r"training.moeImpl: 'fast' is invalid \(Input should be 'hf' or 'grouped'\)",
        ),
        (
            lambda d: d["training"].update(steps=0),
            r"training.steps: 0 is invalid \(Input should be greater than or equal to 1\)",
        ),
        (
            lambda d: d["training"]["data"].update(kind="text"),
            r"training.data.path: required when data.kind is 'text'",
        ),
    ],
)
def test_bad_plans_name_the_field(doc, mutate, match):
    bad = copy.deepcopy(doc)
    mutate(bad)
    with pytest.raises(PlanError, match=match):
        parse_plan(bad)


def test_missing_and_non_json_files(tmp_path):
    with pytest.raises(PlanError, match=r"does not exist \(set --plan or MOE_PLAN\)"):
        load_plan(tmp_path / "nope.json")
    p = tmp_path / "plan.json"
    p.write_text("{not json")
    with pytest.raises(PlanError, match=r"is not JSON"):
        load_plan(p)


def test_plan_path_resolution(monkeypatch):
    monkeypatch.delenv("MOE_PLAN", raising=False)
    assert str(resolve_plan_path()) == "/etc/moe/plan.json"
    monkeypatch.setenv("MOE_PLAN", "/x/plan.json")
    assert str(resolve_plan_path()) == "/x/plan.json"
    assert str(resolve_plan_path("/cli.json")) == "/cli.json"


def test_grouped_impl_refused_with_autoep(doc):
    doc["training"]["moeImpl"] = "grouped"
    with pytest.raises(
        PlanError, match=r"training.moeImpl: 'grouped' replaces the MoE blocks AutoEP"
    ):
        parse_plan(doc)
