"""The bad-input corpus (tests/badspecs/*.yaml) without a cluster: every manifest is refused by
the operator's own checks, with the field the header names. The cluster test
(test_operator_badspecs.py) checks what the API server and the running operator make of them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from moejob_operator.admission import Policy
from moejob_operator.builders.common import JobRef
from moejob_operator.core.topology import load_topology
from moejob_operator.reconcile import planning
from moejob_operator.reconcile.outcome import Refused

BAD = sorted((Path(__file__).parent / "badspecs").glob("*.yaml"))
# the policy the tests' operators read from their environment (conftest: host paths under the
# temp directory), as test_operator_badspecs.py runs the same manifests
POLICY = Policy.from_env(os.environ)


def expectation(path: Path) -> tuple[str, str | None]:
    m = re.search(r"^# expect: (\S+)(?: (\S+))?$", path.read_text(), re.MULTILINE)
    assert m, f"{path.name} has no '# expect:' header"
    return m.group(1), m.group(2)


def test_corpus_is_big_enough():
    assert len(BAD) >= 25
    kinds = {expectation(p)[0] for p in BAD}
    assert {"schema", "InvalidSpec", "InsufficientMemory"} <= kinds


def _refusal(doc: dict) -> Refused:
    """The operator's validate and plan stages (planning.accept, planning.make_plan)."""
    try:
        spec = planning.accept(doc["metadata"]["name"], doc["spec"], POLICY)
        reports = {}
        for node in ("node-a", "node-b"):
            rep = load_topology("nvswitch-h100-8").model_copy(update={"node": node})
            reports[node] = rep
        planning.make_plan(None, JobRef("ns", doc["metadata"]["name"], "uid-1234"), spec, reports)
    except Refused as exc:
        return exc
    raise AssertionError(f"{doc['metadata']['name']} was accepted")


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_operator_refuses_every_bad_spec(path):
    kind, field = expectation(path)
    exc = _refusal(yaml.safe_load(path.read_text()))
    if kind == "InvalidSpec":
        assert (exc.reason, exc.field) == ("InvalidSpec", field), repr(exc)
        assert exc.message.startswith(f"{field}: "), repr(exc)
    elif kind == "InsufficientMemory":
        assert exc.reason == "InsufficientMemory" and exc.field is None, repr(exc)
        assert "GiB" in exc.message
    else:  # the server's schema refuses these; the operator must too (rules enforced twice)
        assert exc.reason == "InvalidSpec" and exc.field and exc.field.startswith("spec"), repr(exc)
