"""The bad-input corpus against the real API server and the running operator: each manifest is
refused by the CRD schema, or ends Failed with the expected reason, an Event naming the field,
and no children."""

from __future__ import annotations

import pytest
import yaml
from kubernetes.client.rest import ApiException

from moejob_operator import constants as C
from operator_harness import (
    apply_job,
    children,
    condition,
    events_for,
    get_job,
    module_operator,
    seed_topology,
)
from test_spec_badspecs import BAD, expectation

pytestmark = pytest.mark.cluster


operator_proc = module_operator("operator-bad")


def test_bad_specs_are_refused(kube, namespace, operator_proc, wait_for):
    seed_topology(kube, namespace)
    accepted = {}
    for path in BAD:
        kind, field = expectation(path)
        doc = yaml.safe_load(path.read_text())
        try:
            apply_job(kube, namespace, doc)
        except ApiException as exc:
            assert exc.status == 422, f"{path.name}: {exc.status} {exc.body}"
            assert kind == "schema", (
                f"{path.name}: the server refused it ({exc.body[:300]}); expected {kind}"
            )
            continue
        assert kind != "schema", f"{path.name}: the server accepted what its schema should refuse"
        accepted[doc["metadata"]["name"]] = (kind, field)

    pending: list[str] = []

    def all_failed():
        pending[:] = [
            n
            for n in accepted
            if condition(get_job(kube, namespace, n), C.COND_FAILED).get("status") != "True"
        ]
        return not pending

    try:
        wait_for(all_failed, timeout=90, message="every accepted bad spec Failed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; not Failed: {pending}\n{operator_proc.logs()}") from None

    for name, (kind, field) in accepted.items():
        job = get_job(kube, namespace, name)
        failed = condition(job, C.COND_FAILED)
        assert failed["reason"] == kind, f"{name}: {failed}"
        assert job["status"]["phase"] == "Failed"
        # Events trail their pass by up to a few seconds (the poster yields to passes)
        events = wait_for(
            lambda: [
                e
                for e in events_for(kube, namespace, name)
                if e.reason == kind and e.type == "Warning"
            ],
            timeout=10,
            message=f"{name}: {kind} Warning event",
        )
        assert len(events) == 1, f"{name}: {len(events)} {kind} Warning events"
        if field != "spec":
            assert field in events[0].message, (
                f"{name}: event {events[0].message!r} does not name {field}"
            )
        assert children(kube, namespace, name) == [], f"{name} created children"
