"""The spec's Auto fields on the operator side (no cluster): which fields the sizing gets, Auto
refused on CPU before discovery, the worker pods' values from the plan with the job's hashes
unchanged, ``status.sizing`` with measured / predicted tokens/s."""

from __future__ import annotations

import pytest

from moe_contracts.plan import parse_plan
from moejob_operator import admission
from moejob_operator import constants as C
from moejob_operator.builders.common import JobRef
from moejob_operator.core.sizing import plan_sized
from moejob_operator.core.topology import load_topology
from moejob_operator.reconcile import planning, sizing
from moejob_operator.reconcile.outcome import Refused
from moejob_operator.spec import parse_spec

BASE = {"image": "img", "model": {"preset": "bench-mixtral"}, "device": "GPU"}
AUTO = {
    **BASE,
    "nodes": {"count": "Auto", "gpusPerNode": "Auto"},
    "training": {"globalBatch": 32, "microBatch": "Auto", "activationCheckpointing": "Auto"},
}


def test_auto_fields_follow_the_spec():
    auto = sizing.auto_fields(parse_spec(AUTO))
    assert (auto.nodes, auto.gpus_per_node, auto.micro_batch, auto.activation_checkpointing) == (
        True,
        True,
        True,
        True,
    )
    assert not auto.ep_size and auto.persistence
    user = {
        **AUTO,
        "deepspeedOverrides": {"zero_optimization": {"stage3_param_persistence_threshold": 7}},
    }
    assert not sizing.auto_fields(parse_spec(user)).persistence
    assert not sizing.auto_fields(parse_spec(BASE)).any  # nothing Auto: the planner as before


def test_auto_on_cpu_is_refused_before_discovery():
    with pytest.raises(Refused) as info:
        planning.accept("j", {**AUTO, "device": "CPU"}, admission.Policy())
    assert info.value.reason == C.R_INVALID_SPEC
    assert info.value.field == "spec.nodes.count"
    assert "Auto sizes GPU jobs" in info.value.message


def _plan(spec):
    reports = {n: load_topology("nvswitch-h100-8").model_copy(update={"node": n}) for n in "ab"}
    job = JobRef("ns", "j", "uid")
    req = planning.plan_request(job, spec, ["a", "b"], reports, None, 0)
    return parse_plan(plan_sized(req, sizing.auto_fields(spec)).document, complete=True)


def test_sized_spec_carries_the_plan_and_the_hashes_stay_the_written_specs():
    spec = parse_spec(AUTO)
    plan = _plan(spec)
    sized = sizing.sized_spec(spec, plan)
    ch = plan.sizing["chosen"]
    assert (sized.nodes.count, sized.nodes.gpus_per_node, sized.training.micro_batch) == (
        ch["nodeCount"],
        ch["gpusPerNode"],
        ch["microBatch"],
    )
    assert sized.nodes.world_size == plan.world_size
    assert spec.immutable_hash() == parse_spec(AUTO).immutable_hash()
    assert sizing.sized_spec(parse_spec(BASE), plan) == parse_spec(BASE)


def test_status_compares_measured_with_predicted():
    plan = _plan(parse_spec(AUTO))
    status: dict = {}
    sizing.status(status, plan)
    s = status["sizing"]
    assert s["predictedTokensPerSecond"] == round(plan.sizing["predictedTokensPerSecond"])
    assert "measuredVsPredicted" not in s
    status["progress"] = {"tokensPerSecond": s["predictedTokensPerSecond"] * 1.1}
    sizing.status(status, plan)
    assert status["sizing"]["measuredVsPredicted"] == "1.100"
    sizing.status(status, parse_plan({k: v for k, v in plan.raw.items() if k != "sizing"}))
    assert "sizing" not in status
