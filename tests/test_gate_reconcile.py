"""reconcile.gate.check() paths that need no cluster: skip, disabled, launched jobs, API errors."""

from __future__ import annotations

import datetime as dt

from kubernetes.client.rest import ApiException

from moejob_operator import constants as C
from moejob_operator.core import gate as G
from moejob_operator.reconcile import gate
from moejob_operator.spec import parse_spec

NOW = dt.datetime(2026, 11, 29, 14, 0, tzinfo=dt.timezone.utc)
CFG = G.GateConfig(namespace="moe-system")


class ForbiddenClient:
    api = None

    def get_configmap(self, namespace, name):
        raise ApiException(status=403, reason="Forbidden")


def spec(**over):
    raw = {"image": "reg.io/trainer:1.0", "deepspeedVersion": "0.19.8", "model": {"preset": "tiny-mixtral"}}
    raw.update(over)
    return parse_spec(raw)


def body(status=None):
    return {"metadata": {"name": "j", "namespace": "ns", "uid": "u"}, "status": status or {}}


def test_api_errors_leave_the_job_waiting_with_the_reason():
    v = gate.check(ForbiddenClient(), body(), spec(), NOW, CFG)
    assert (v.status, v.reason, v.retry_seconds) == ("Unknown", C.R_GATE_PENDING, 30.0)
    assert "namespace moe-system: 403 Forbidden" in v.message


def test_skip_and_disabled_need_no_store():
    s = spec(gate={"skip": True, "skipReason": "hotfix"})
    v = gate.check(ForbiddenClient(), body(), s, NOW, CFG)
    assert (v.status, v.reason) == ("True", C.R_GATE_SKIPPED) and "hotfix" in v.message
    off = gate.check(ForbiddenClient(), body(), spec(), NOW, G.GateConfig(enabled=False))
    assert (off.status, off.reason) == ("True", C.R_GATE_NOT_CONFIGURED)


def test_a_launched_job_keeps_its_verdict():
    cond = {"type": C.COND_UPGRADE_VERIFIED, "status": "True", "reason": G.R_SMOKE_TEST_PASSED, "message": "m"}
    v = gate.check(ForbiddenClient(), body({"launchedSpec": {"image": "x"}, "conditions": [cond]}), spec(), NOW, CFG)
    assert (v.status, v.reason, v.message) == ("True", G.R_SMOKE_TEST_PASSED, "m")


def test_bad_settings_are_reported_not_raised(monkeypatch):
    monkeypatch.setenv("MOE_GATE_PASS_TTL_SECONDS", "a week")
    v = gate.check(ForbiddenClient(), body(), spec())
    assert (v.status, v.reason) == ("Unknown", gate.R_GATE_MISCONFIGURED)
    assert "MOE_GATE_PASS_TTL_SECONDS: 'a week'" in v.message

