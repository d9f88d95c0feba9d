"""Stage results as types, without a cluster: the planner's errors carry their field
(core.errors.FieldError), the plan stage maps that field to the spec (planning.SPEC_FIELD, no
message parsing), and the pass turns NotYet / Refused into conditions, Events, the failure and
the requeue delay in one place (reconcile.job._settle), driven through reconcile() against the
in-memory client the other pass tests use."""

from __future__ import annotations

import pytest

import test_deferred_launch
from moejob_operator import constants as C
from moejob_operator.builders.common import JobRef
from moejob_operator.core import models
from moejob_operator.core.errors import DoesNotFit, FieldError
from moejob_operator.core.plan import PlanRequest, TrainingOptions, build_plan
from moejob_operator.core.topology import load_topology
from moejob_operator.reconcile import gate, planning, topology
from moejob_operator.reconcile import job as J
from moejob_operator.reconcile.outcome import NotYet, Refused
from moejob_operator.spec import parse_spec
from test_deferred_launch import SETTINGS
from test_reconcile_errors import Client, cond

job = test_deferred_launch.job  # the fixture: examples/tiny-cpu.yaml, gate disabled


def request(**over) -> PlanRequest:
    args = dict(global_batch=8, seq_len=64, device="cpu", nodes=["a", "b"], procs_per_node=2)
    args.update(over)
    return PlanRequest("j", "ns", models.resolve_model("tiny-mixtral"), None, **args)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"ep_size": 3}, "epSize"),
        ({"global_batch": 6}, "globalBatch"),
        ({"micro_batch": 3}, "microBatch"),
        ({"strategy": "best"}, "strategy"),
        ({"dispatcher": "fast"}, "dispatcher"),
        ({"device": "tpu"}, "device"),
        (
            {"ds_overrides": {"zero_optimization": {"stage": 7}}},
            "deepspeed.zero_optimization.stage",
        ),
        ({"procs_per_node": 0}, "nodes/procsPerNode"),
    ],
)
def test_planner_errors_carry_their_field(over, field):
    with pytest.raises(FieldError) as exc:
        build_plan(request(**over))
    assert exc.value.field == field and str(exc.value) == f"{field}: {exc.value.detail}"


def test_a_job_that_does_not_fit_is_does_not_fit():
    with pytest.raises(DoesNotFit, match=r"^memory: the job needs .* GiB per process") as exc:
        build_plan(request(cpu_memory_bytes=2**20))
    assert exc.value.field == "memory"


@pytest.mark.parametrize(
    ("error", "reason", "field"),
    [
        (
            FieldError("epSize", "3 does not divide the number of experts 8"),
            C.R_INVALID_SPEC,
            "spec.placement.expertParallelSize",
        ),
        (
            FieldError("globalBatch", "6 is not divisible"),
            C.R_INVALID_SPEC,
            "spec.training.globalBatch",
        ),
        (
            FieldError("deepspeed.zero_optimization.stage", "7 is not 0, 1, 2 or 3"),
            C.R_PLAN_FAILED,
            None,
        ),
        (FieldError("worldSize", "0 must be >= 1"), C.R_PLAN_FAILED, None),
        (DoesNotFit("the job needs 9.0 GiB per GPU"), C.R_INSUFFICIENT_MEMORY, None),
    ],
)
def test_the_plan_stage_maps_the_field_not_the_message(error, reason, field):
    out = planning.refusal(error)
    assert (out.reason, out.field) == (reason, field)
    if field:  # the condition names the spec field, then the core's detail
        assert out.message == f"{field}: {error.detail}"
    else:
        assert out.message == str(error)


def test_the_plan_stage_refuses_with_the_spec_field(job):
    """A valid spec the discovered GPUs cannot serve: the core's ``gpusPerNode`` error becomes
    InvalidSpec on ``spec.nodes.gpusPerNode``."""
    job["spec"].update(device="GPU", nodes={"count": 1, "gpusPerNode": 16})
    job["spec"]["training"]["globalBatch"] = 32
    spec = parse_spec(job["spec"])
    fixture = load_topology("nvswitch-h100-8")
    reports = {n: fixture.model_copy(update={"node": n}) for n in ("a", "b")}
    with pytest.raises(Refused) as exc:
        planning.make_plan(None, JobRef("ns", "j", "u"), spec, reports)
    assert (exc.value.reason, exc.value.field) == (C.R_INVALID_SPEC, "spec.nodes.gpusPerNode")
    assert exc.value.message == (
        "spec.nodes.gpusPerNode: 16 requested but node 'a' has 8 GPU(s) discovered"
    )


def test_a_refused_plan_fails_the_job_with_one_event(job):
    job["spec"]["model"] = {"preset": "deepseek-v3"}  # does not fit in the nodes' memory
    job["spec"].pop("placement", None)
    c = Client()
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body=job) is None
    assert cond(c, C.COND_PLANNED)["reason"] == C.R_INSUFFICIENT_MEMORY
    assert cond(c, C.COND_FAILED)["reason"] == C.R_INSUFFICIENT_MEMORY
    # Planned=False flips quietly: the Failed Event says it
    assert [e[1] for e in c.events] == [C.R_DISCOVERED, C.R_INSUFFICIENT_MEMORY]
    assert c.status["phase"] == "Failed" and not [w for w in c.writes if w.startswith("Pod/")]


def test_an_invalid_spec_fails_the_job_naming_the_field(job):
    job["spec"]["training"]["globalBatch"] = 0
    c = Client()
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body=job) is None
    failed = cond(c, C.COND_FAILED)
    assert failed["reason"] == C.R_INVALID_SPEC
    assert failed["message"].startswith("spec.training.globalBatch")
    assert cond(c, C.COND_SPEC_ACCEPTED)["status"] == "False" and len(c.events) == 1
    # the field a person has to change, on the conditions as a field of its own (Refused.field)
    assert failed["field"] == cond(c, C.COND_SPEC_ACCEPTED)["field"] == "spec.training.globalBatch"


def test_a_refusal_without_a_field_to_blame_names_none(job):
    job["spec"]["model"] = {"preset": "deepseek-v3"}  # does not fit: no single field is to blame
    job["spec"].pop("placement", None)
    c = Client()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    assert "field" not in cond(c, C.COND_FAILED) and "field" not in cond(c, C.COND_PLANNED)


def test_discovery_not_yet_sets_its_condition_and_the_delay(job, monkeypatch):
    def pending(*_a, **_k):
        raise NotYet(C.R_DISCOVERY_PENDING, "discovery running on node-a", 2.0)

    def failing(*_a, **_k):
        raise NotYet(
            C.R_DISCOVERY_FAILED, "discovery failed on node-a (exit code 1)", 10.0, failed=True
        )

    c = Client()
    monkeypatch.setattr(topology, "ensure_reports", pending)
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body=job) == 2.0
    assert (cond(c, C.COND_TOPOLOGY)["status"], cond(c, C.COND_TOPOLOGY)["reason"]) == (
        "Unknown",
        C.R_DISCOVERY_PENDING,
    )
    assert cond(c, C.COND_PLANNED) == {} and cond(c, C.COND_FAILED) == {}
    monkeypatch.setattr(topology, "ensure_reports", failing)
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body={**job, "status": c.status}) == 10.0
    assert (cond(c, C.COND_TOPOLOGY)["status"], cond(c, C.COND_TOPOLOGY)["reason"]) == (
        "False",
        C.R_DISCOVERY_FAILED,
    )


def test_gate_outcomes(job, monkeypatch):
    """NotYet: UpgradeVerified=Unknown and the gate's delay; Refused: UpgradeVerified=False with
    its own Event, then Failed; the plan is kept either way, no worker pod."""

    def waiting(*_a, **_k):
        raise NotYet(C.R_GATE_PENDING, "smoke test running", 5.0)

    def refused(*_a, **_k):
        raise Refused("SmokeTestFailed", "the smoke test failed: train")

    c = Client()
    monkeypatch.setattr(gate, "check", waiting)
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body=job) == 5.0
    assert cond(c, C.COND_UPGRADE_VERIFIED)["status"] == "Unknown"
    assert "ConfigMap/j-plan" in c.writes and not [w for w in c.writes if w.startswith("Pod/")]
    monkeypatch.setattr(gate, "check", refused)
    c.events.clear()
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body={**job, "status": c.status}) is None
    assert cond(c, C.COND_UPGRADE_VERIFIED)["status"] == "False"
    assert cond(c, C.COND_FAILED)["reason"] == "SmokeTestFailed"
    assert [e[1] for e in c.events] == ["SmokeTestFailed", "SmokeTestFailed"]
    assert not [w for w in c.writes if w.startswith("Pod/")]


def test_training_options_default_is_not_shared():
    assert request().training == TrainingOptions() and request().training is not request().training
