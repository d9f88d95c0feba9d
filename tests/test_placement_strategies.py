"""The placement strategy table (``core/placement/strategies.py``) is the one source of the value
set: the spec, the CRD, the CLI, the planner and the held-out estimate all follow it."""

import argparse
import typing
from pathlib import Path

import numpy as np
import pytest
import yaml

from moejob_operator import cli, spec
from moejob_operator.core.placement import heldout, solve, strategies
from moejob_operator.core.routing import synthetic_trace
from moejob_operator.core.topology import ClusterTopology

CRD = Path(__file__).resolve().parents[1] / "crds" / "moetrainingjob.yaml"


def _crd_strategy():
    doc = yaml.safe_load(CRD.read_text())
    props = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    return props["spec"]["properties"]["placement"]["properties"]["strategy"]


def test_spec_and_crd_offer_exactly_the_table_rows_with_a_spec_name():
    offered = [s.spec_name for s in strategies.REGISTRY if s.spec_name is not None]
    field = spec.Placement.model_fields["strategy"]
    assert list(typing.get_args(field.annotation)) == offered
    assert field.default == strategies.DEFAULT.spec_name
    crd = _crd_strategy()
    assert crd["enum"] == offered
    assert crd["default"] == strategies.DEFAULT.spec_name


def test_the_planner_gets_the_rows_plan_name_for_each_spec_spelling():
    for row in strategies.REGISTRY:
        if row.spec_name is None:
            continue
        parsed = spec.parse_spec(
            {
                "image": "img",
                "model": {"preset": "tiny-mixtral"},
                "placement": {"strategy": row.spec_name},
            }
        )
        assert strategies.BY_SPEC_NAME[parsed.placement.strategy].name == row.name


def test_cli_choices_and_default_are_the_table():
    parser = argparse.ArgumentParser()
    cli.add_plan(parser.add_subparsers())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    plan = sub.choices["plan"]
    action = next(a for a in plan._actions if a.dest == "strategy")
    assert tuple(action.choices) == strategies.NAMES
    assert action.default == strategies.DEFAULT.name


def test_unknown_name_names_the_choices():
    topo = ClusterTopology.synthetic(nodes=1, gpus_per_node=2, group_size=2)
    with pytest.raises(ValueError, match=r"unknown placement strategy 'nope'.*topology_aware"):
        solve("nope", topo, None, ep_size=2, num_experts=4, num_layers=1)


@pytest.mark.parametrize("row", strategies.REGISTRY, ids=lambda r: r.name)
def test_each_row_solves_falls_back_as_declared_and_orders_ranks_as_declared(row):
    topo = ClusterTopology.synthetic(nodes=2, gpus_per_node=2, group_size=2)
    st = synthetic_trace(2, 8, 2, 500, seed=3)
    p = solve(row.name, topo, st, ep_size=4, num_experts=8, num_layers=2)
    assert not p.fell_back
    want = np.arange(4) if row.keeps_gpu_order else topo.gpu_order()
    assert (p.rank2gpu == want).all()
    bare = solve(row.name, topo, None, ep_size=4, num_experts=8, num_layers=2)
    assert bare.fell_back == row.needs_stats
    if row.needs_stats:
        assert (bare.permutation == np.tile(np.arange(8), (2, 1))).all()
        assert bare.notes and "fell back to contiguous" in bare.notes[0]
    # the held-out estimate raises only the fitted rows' in-sample ratio
    raised = heldout.heldout_estimate(p, 0.5, top_k=2) > 0.5
    assert raised == row.fitted
