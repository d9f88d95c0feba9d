"""The re-placement step of a tracking pass (reconcile/replan.py) against a fake client: when it
decides, what it writes (PlacementUpdate generation + 1, Event, status), that it waits for the
trainer to apply a generation, and that it takes its state from the ConfigMap (an operator that
stopped after writing it records the switch; nothing is switched twice)."""

from __future__ import annotations

import copy
import datetime as dt
import json

import pytest

import plan_fixtures
from moe_contracts import placement_update
from moe_contracts.plan import parse_plan
from moe_contracts.routing import encode_configmap
from moejob_operator import constants as C
from moejob_operator.builders import common, configmaps
from moejob_operator.reconcile import replan
from moejob_operator.reconcile.jobpass import Pass
from moejob_operator.reconcile.settings import Settings
from moejob_operator.spec import parse_spec
from test_core_replan import _counted, _trace, planned, planned_copies  # noqa: F401  (fixtures)

NOW = dt.datetime(2026, 12, 3, 16, 0, 0, tzinfo=dt.UTC)
UID = "0b6f6c2e-6f1d-4f43-9d0e-3f5a1f1a9b11"
BODY = {"metadata": {"name": "rp", "namespace": "ns", "uid": UID, "generation": 1}, "spec": {}}
JOB = common.JobRef.from_body(BODY)
SPEC = parse_spec(
    {
        "image": "img",
        "model": {"preset": "tiny-mixtral"},
        "placement": {"replan": {"everySteps": 10, "minPredictedGainPercent": 10}},
        "training": {"steps": 1000},  # checkpoints every 50 (default): boundaries ahead
    }
)


class FakeClient:
    def __init__(self, cms):
        self.cms = cms
        self.writes = []

    def get_owned_configmap(self, namespace, name, uid):
        cm = self.cms.get(name)
        return copy.deepcopy(cm) if cm is not None else None

    def replace_configmap(self, namespace, obj):
        self.writes.append(obj)
        self.cms[obj["metadata"]["name"]] = copy.deepcopy(obj)


def _cluster(doc, stats):
    pl = parse_plan(doc).placement
    placement = configmaps.placement_configmap(JOB, pl.permutation, pl.replicas)
    routing = {"metadata": {"name": "rp-routing-stats"}, **encode_configmap(stats.to_json()).body}
    routing.pop("binaryData")
    return FakeClient({"rp-placement": placement, "rp-routing-stats": routing})


def _progress(step, placement=None):
    doc = {"kind": "TrainerProgress", "version": 1, "phase": "Training", "step": step}
    doc["routingStats"] = {"step": step, "published": True}
    if placement is not None:
        doc["placement"] = placement
    return doc


def _pass(client, status=None):
    return Pass(client, {**BODY, "status": status or {}}, NOW, Settings())


def _generation(client):
    text = client.cms["rp-placement"]["data"][placement_update.KEY]
    return placement_update.loads(text)


def test_no_drift_never_switches(planned):  # noqa: F811
    doc, te = planned
    client = _cluster(doc, _counted(te[:, 4096:]))
    p = _pass(client)
    replan.step(p, SPEC, parse_plan(doc), _progress(10))
    assert client.writes == [] and not p.events
    assert p.status["replan"]["decision"] == "Stay"
    assert p.status["replan"]["checkedAtStep"] == 10
    assert "placementHistory" not in p.status


def test_drift_switches_once_and_waits_for_the_trainer(planned):  # noqa: F811
    doc, _ = planned
    client = _cluster(doc, _counted(_trace(11)))
    p = _pass(client)
    replan.step(p, SPEC, parse_plan(doc), _progress(9))  # not due yet
    assert client.writes == [] and "replan" not in p.status
    replan.step(p, SPEC, parse_plan(doc), _progress(10))
    got = _generation(client)
    assert got.generation == 1 and got.decided_at_step == 10
    got.check(4, 8, ep_size=4)
    assert got.predicted.cross_group_bytes_after <= 0.9 * got.predicted.cross_group_bytes_before
    assert [e[1] for e in p.events] == [C.R_PLACEMENT_UPDATED]
    assert "-> " in p.events[0][2]
    (h,) = p.status["placementHistory"]
    assert (h["generation"], h["decidedAtStep"]) == (1, 10)
    assert h["predictedCrossGroupBytesAfter"] < h["predictedCrossGroupBytesBefore"]
    # later passes: the trainer has not applied generation 1: no second decision
    status = copy.deepcopy(p.status)
    p2 = _pass(client, status)
    replan.step(p2, SPEC, parse_plan(doc), _progress(40, {"generation": 0, "appliedAtStep": 0}))
    assert len(client.writes) == 1 and not p2.events
    assert "waiting for the trainer" in p2.status["replan"]["message"]
    # applied at step 45: recorded; the same drifted statistics again at 55 -> the running
    # generation 1 was fitted to them: stay
    p3 = _pass(client, copy.deepcopy(p2.status))
    replan.step(p3, SPEC, parse_plan(doc), _progress(55, {"generation": 1, "appliedAtStep": 45}))
    assert p3.status["placementHistory"][0]["appliedAtStep"] == 45
    assert len(client.writes) == 1 and not p3.events
    assert p3.status["replan"]["decision"] == "Stay"


def test_a_written_generation_is_recorded_after_a_restart(planned):  # noqa: F811
    """The operator stopped between the ConfigMap write and the status write: the next pass takes
    the generation from the ConfigMap, records it with its Event, and does not switch again."""
    doc, _ = planned
    client = _cluster(doc, _counted(_trace(11)))
    replan.step(_pass(client), SPEC, parse_plan(doc), _progress(10))
    p = _pass(client)  # the status of before the switch
    replan.step(p, SPEC, parse_plan(doc), _progress(20))
    assert len(client.writes) == 1
    assert [e[1] for e in p.events] == [C.R_PLACEMENT_UPDATED]
    assert p.status["placementHistory"][0]["generation"] == 1


def test_without_replan_or_progress_nothing_is_read():
    class NoCalls:
        def __getattr__(self, name):
            raise AssertionError(f"unexpected call {name}")

    plain = parse_spec({"image": "img", "model": {"preset": "tiny-mixtral"}})
    replan.step(_pass(NoCalls()), plain, plan_fixtures.plan(), _progress(100))
    replan.step(_pass(NoCalls()), SPEC, plan_fixtures.plan(), None)


@pytest.mark.parametrize(
    ("progress", "step"),
    [
        ({"step": 30}, 30),
        ({"step": 30, "routingStats": {"step": 25, "published": True}}, 25),
        ({"step": 30, "routingStats": {"step": 25, "published": False}}, None),
        ({"step": True}, None),
    ],
)
def test_statistics_step(progress, step):
    assert replan._stats_step(progress) == step


def test_decoded_progress():
    assert replan.decoded(json.dumps({"a": 1})) == {"a": 1}
    assert replan.decoded("[1]") is None and replan.decoded("{") is None


def test_a_plan_it_cannot_read_is_a_status_message(planned):  # noqa: F811
    doc, _ = planned
    client = _cluster(doc, _counted(_trace(11)))
    # ranks without their NVLink groups (a plan of an older planner): nothing to score with
    ranks = [{k: v for k, v in r.items() if k != "group"} for r in doc["ranks"]]
    broken = parse_plan({**doc, "ranks": ranks})
    p = _pass(client)
    replan.step(p, SPEC, broken, _progress(10))
    assert client.writes == [] and "cannot be re-planned" in p.status["replan"]["message"]


def test_no_decision_when_the_next_checkpoint_is_the_last_step(planned):  # noqa: F811
    """Statistics whose next checkpoint boundary is the run's last step: a switch would move
    experts for no step that uses them, so the operator does not decide (nothing written)."""
    doc, _ = planned
    short = parse_spec(
        {
            "image": "img",
            "model": {"preset": "tiny-mixtral"},
            "placement": {"replan": {"everySteps": 10, "minPredictedGainPercent": 1}},
            "training": {"steps": 100},  # checkpoints every 50: the boundary after 60 is 100
        }
    )
    client = _cluster(doc, _counted(_trace(11)))  # drifted: switches when a boundary is left
    p = _pass(client, {})
    replan.step(p, short, parse_plan(doc), _progress(60))
    assert not client.writes and not p.events and "replan" not in p.status
    replan.step(
        p, short, parse_plan(doc), _progress(40)
    )  # the boundary at 50 is before the last step
    assert len(client.writes) == 1 and _generation(client).generation == 1


def test_copies_are_re_placed_with_the_experts(planned_copies):  # noqa: F811
    """A plan with copies: the seed holds them, a drift writes generation 1 with new copies that
    fit its permutation, and once the trainer runs it, the same statistics stay (the decision
    scores the running generation's copies, not the plan's)."""
    doc, _ = planned_copies
    plan = parse_plan(doc)
    client = _cluster(doc, _counted(_trace(11)))
    assert _generation(client).replicas == plan.placement.replicas
    p = _pass(client)
    replan.step(p, SPEC, plan, _progress(10))
    got = _generation(client)
    assert got.generation == 1 and got.replicas is not None, p.status["replan"]
    got.check(4, 8, ep_size=4)
    assert got.replicas != plan.placement.replicas
    assert "extra expert copies" in p.status["replan"]["message"]
    p2 = _pass(client, copy.deepcopy(p.status))
    replan.step(p2, SPEC, plan, _progress(55, {"generation": 1, "appliedAtStep": 45}))
    assert len(client.writes) == 1 and p2.status["replan"]["decision"] == "Stay"


def test_waiting_quotes_the_trainers_refusal_and_a_bad_own_document_is_skipped(
    planned_copies,  # noqa: F811
):
    """An update the trainer refused (an older image, say) leaves the operator waiting: the status
    quotes the trainer's reason. A hand-edited ConfigMap whose copies do not fit is no ground for
    a decision (skipped, not a crash)."""
    doc, _ = planned_copies
    plan = parse_plan(doc)
    client = _cluster(doc, _counted(_trace(11)))
    p = _pass(client)
    replan.step(p, SPEC, plan, _progress(10))
    assert _generation(client).generation == 1
    refused = {"generation": 0, "appliedAtStep": None, "message": "generation 1 refused: X"}
    p2 = _pass(client, copy.deepcopy(p.status))
    replan.step(p2, SPEC, plan, _progress(20, refused))
    assert "waiting for the trainer" in p2.status["replan"]["message"]
    assert "the trainer says: generation 1 refused: X" in p2.status["replan"]["message"]
    bad = json.loads(client.cms["rp-placement"]["data"][placement_update.KEY])
    bad["replicas"][0]["holders"][0] = [9]
    client.cms["rp-placement"]["data"][placement_update.KEY] = json.dumps(bad)
    p3 = _pass(client)
    replan.step(p3, SPEC, plan, _progress(55, {"generation": 1, "appliedAtStep": 45}))
    assert len(client.writes) == 1 and "replan" not in p3.status and not p3.events
