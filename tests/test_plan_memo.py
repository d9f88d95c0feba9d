"""The Controller's plan memo (reconcile.planning.PlanMemo): jobs with the same inputs share one
planner run, each gets its own job name, nothing a caller changes leaks into the memo, the memo is
bounded, and without one every plan is computed."""

from __future__ import annotations

from moe_contracts import plan as contract
from moejob_operator import constants as C
from moejob_operator.builders import configmaps
from moejob_operator.builders.common import JobRef
from moejob_operator.controller import Controller
from moejob_operator.core.topology import load_topology
from moejob_operator.reconcile import planning
from moejob_operator.spec import parse_spec

SPEC = {"image": "img", "model": {"preset": "tiny-mixtral"}, "device": "GPU"}


def _reports():
    return {n: load_topology("nvswitch-h100-8").model_copy(update={"node": n}) for n in ("a",)}


def _counting(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = planning._make_plan

    def counted(job, *a, **k):
        calls.append(job.name)
        return real(job, *a, **k)

    monkeypatch.setattr(planning, "_make_plan", counted)
    return calls


def test_same_inputs_plan_once_per_memo(monkeypatch):
    calls = _counting(monkeypatch)
    memo, spec = planning.PlanMemo(), parse_spec(SPEC)
    one = planning.make_plan(None, JobRef("ns", "one", "u1"), spec, _reports(), memo=memo)
    one.raw["placement"]["strategy"] = "changed by a caller"  # must not reach the memo
    two = planning.make_plan(None, JobRef("ns", "two", "u2"), spec, _reports(), memo=memo)
    assert calls == ["one"] and len(memo) == 1
    assert (one.job_name, two.job_name) == ("one", "two")
    assert two.placement is not None and two.placement.strategy != "changed by a caller"
    other = parse_spec({**SPEC, "training": {"steps": 7}})
    planning.make_plan(None, JobRef("ns", "three", "u3"), other, _reports(), memo=memo)
    assert calls == ["one", "three"] and len(memo) == 2
    planning.make_plan(None, JobRef("ns", "four", "u4"), spec, _reports())  # no memo
    assert calls == ["one", "three", "four"]


def test_the_memo_is_bounded_and_owned_by_the_controller():
    memo = planning.PlanMemo(size=2)
    for key in "abc":
        memo.put(key, {"k": key})
    assert len(memo) == 2 and memo.get("a") is None and memo.get("c") == {"k": "c"}
    assert memo.get("b") == {"k": "b"}  # used: now the newest
    memo.put("d", {"k": "d"})
    assert memo.get("c") is None and memo.get("b") is not None
    # runtime state lives in the Controller: two controllers share nothing
    assert Controller().plan_memo is not Controller().plan_memo


def test_a_new_plan_is_serialised_once(monkeypatch):
    """make_plan's size check and the plan ConfigMap share the plan's one serialisation
    (MoEPlan.sorted_json), byte for byte what the contract's plan_json writes."""
    dumps: list[bool] = []
    real = contract._dumps

    def counted(doc, *, sort_keys):
        dumps.append(sort_keys)
        return real(doc, sort_keys=sort_keys)

    monkeypatch.setattr(contract, "_dumps", counted)
    spec = parse_spec(SPEC)
    plan = planning.make_plan(None, JobRef("ns", "one", "u1"), spec, _reports())
    cm = configmaps.plan_configmap(JobRef("ns", "one", "u1"), plan, spec.immutable_hash())
    assert dumps == [True]  # the size check serialised it; the ConfigMap reused the text
    assert plan.sorted_json() is plan.sorted_json() is cm["data"][C.PLAN_KEY]
    monkeypatch.setattr(contract, "_dumps", real)
    assert cm["data"][C.PLAN_KEY] == contract.plan_json(plan.raw, sort_keys=True)
    # the memo is no field: a plan that has serialised equals one that has not
    assert plan == contract.parse_plan(plan.raw, complete=True)
