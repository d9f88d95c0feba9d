"""The inspection and data-preparation stages against an in-memory client (the cluster tests run
them through the real API server): level-based reports, a spec edited before launch, crashed
pods retried then refused, the pre-launch re-check."""

from __future__ import annotations

import json

import pytest

import plan_fixtures
from moe_contracts import env as E
from moejob_operator import constants as C
from moejob_operator.builders.common import JobRef
from moejob_operator.core.models import preset_hf_config
from moejob_operator.reconcile import dataprep, inspect
from moejob_operator.reconcile.client import Client
from moejob_operator.reconcile.outcome import NotYet, Refused
from moejob_operator.spec import parse_spec

JOB = JobRef("ns", "ft", "0b6f6c2e-6f1d-4f43-9d0e-3f5a1f1a9b11")
SPEC = {
    "image": "img",
    "model": {"path": "/model", "volume": {"persistentVolumeClaim": {"claimName": "m"}}},
    "data": {"kind": "JSONL", "volume": {"persistentVolumeClaim": {"claimName": "d"}}},
    "checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "ck"}}},
}


class FakeClient:
    # the real ownership filters, over this fake's list_pods / get_configmap
    list_owned_pods = Client.list_owned_pods
    get_owned_configmap = Client.get_owned_configmap

    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.deleted: list[str] = []

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = json.loads(json.dumps(obj))
        return True

    def get_configmap(self, ns, name):
        return self.objects.get(("ConfigMap", name))

    def delete_configmap(self, ns, name):
        self.deleted.append(f"cm/{name}")
        self.objects.pop(("ConfigMap", name), None)

    def list_pods(self, ns, selector):
        return [
            o
            for (kind, _), o in self.objects.items()
            if kind == "Pod"
            and all(o["metadata"]["labels"].get(k) == v for k, v in selector.items())
        ]

    def delete_pod(self, ns, name, uid=None):
        self.deleted.append(f"pod/{name}")
        self.objects.pop(("Pod", name), None)

    # test helpers
    def publish(self, cm, key, doc):
        self.objects[("ConfigMap", cm)]["data"][key] = json.dumps(doc)

    def finish(self, pod, phase="Succeeded"):
        self.objects[("Pod", pod)]["status"] = {"phase": phase}


def _report(path="/model", **extra):
    doc = {
        "kind": "ModelReport",
        "version": 1,
        "path": path,
        "config": preset_hf_config("tiny-mixtral"),
        "modelType": "mixtral",
        "weightFormat": "safetensors",
        "dtypes": {"BF16": 10},
        "tokenizer": {"present": True, "vocabSize": 300},
        "contentHash": "sha256:" + "a" * 64,
    }
    doc.update(extra)
    return doc


def test_inspection_waits_for_its_pod_then_plans_from_the_report():
    client, status, spec = FakeClient(), {}, parse_spec(SPEC)
    with pytest.raises(NotYet) as info:
        inspect.ensure_model(client, JOB, spec, status)
    assert info.value.reason == C.R_INSPECTION_PENDING
    assert ("Pod", "ft-inspect") in client.objects and ("Role", "ft-prepare") in client.objects
    client.publish("ft-model", E.MODEL_REPORT_KEY, _report())
    found = inspect.ensure_model(client, JOB, spec, status)
    assert found.model.hf_config == preset_hf_config("tiny-mixtral")
    assert status["model"]["contentHash"] == "sha256:" + "a" * 64
    # a spec edited before launch: the old report and pod go, a new inspection starts
    edited = parse_spec({**SPEC, "training": {"steps": 7}})
    with pytest.raises(NotYet):
        inspect.ensure_model(client, JOB, edited, status)
    assert {"cm/ft-model", "pod/ft-inspect"} <= set(client.deleted)


def test_a_crashed_inspection_is_retried_then_refused():
    client, status, spec = FakeClient(), {}, parse_spec(SPEC)
    for attempt in range(inspect.MAX_ATTEMPTS):
        with pytest.raises(NotYet):
            inspect.ensure_model(client, JOB, spec, status)  # creates the pod
        client.finish("ft-inspect", "Failed")
        if attempt < inspect.MAX_ATTEMPTS - 1:
            with pytest.raises(NotYet) as info:
                inspect.ensure_model(client, JOB, spec, status)
            assert info.value.failed and info.value.reason == C.R_INSPECTION_FAILED
    with pytest.raises(Refused) as refused:
        inspect.ensure_model(client, JOB, spec, status)
    assert refused.value.reason == C.R_INSPECTION_FAILED and "gave up after 3" in str(refused.value)


def test_recheck_refuses_a_changed_directory():
    client, status, spec = FakeClient(), {}, parse_spec(SPEC)
    plan = plan_fixtures.plan(
        model={"family": "mixtral", "path": "/model", "contentHash": "sha256:" + "a" * 64}
    )
    with pytest.raises(NotYet):
        inspect.recheck(client, JOB, spec, plan, status)
    assert ("Pod", "ft-inspect-launch") in client.objects
    key = f"launch-{E.MODEL_REPORT_KEY}"
    client.publish("ft-model", key, _report(contentHash="sha256:" + "b" * 64))
    with pytest.raises(Refused) as info:
        inspect.recheck(client, JOB, spec, plan, status)
    assert info.value.reason == C.R_MODEL_CHANGED and info.value.field == "spec.model.path"
    client.publish("ft-model", key, _report())
    assert "unchanged since planning" in inspect.recheck(client, JOB, spec, plan, status)
    assert inspect.recheck(client, JOB, spec, plan, status) is None  # done once


def test_data_preparation_progress_done_and_refusal():
    client, status, spec = FakeClient(), {}, parse_spec(SPEC)
    with pytest.raises(NotYet) as info:
        dataprep.ensure_data(client, JOB, spec, status, None, 320)
    assert info.value.reason == C.R_DATA_PREPARING
    args = client.objects[("Pod", "ft-prepare-data")]["spec"]["containers"][0]["args"]
    assert "--tokenizer" not in args and args[args.index("--vocab-size") + 1] == "320"
    base = {"kind": "DataPrepReport", "version": 1, "key": "k", "path": "/ckpt/prepared-data/k"}
    client.publish("ft-data", E.DATA_REPORT_KEY, {**base, "phase": "Preparing", "documents": 5})
    with pytest.raises(NotYet) as info:
        dataprep.ensure_data(client, JOB, spec, status, None, 320)
    assert status["data"]["documents"] == 5 and "5 documents" in info.value.message
    done = {**base, "phase": "Done", "documents": 9, "tokens": 90, "lossTokens": 90, "rows": 3}
    client.publish("ft-data", E.DATA_REPORT_KEY, done)
    prepared = dataprep.ensure_data(client, JOB, spec, status, None, 320)
    assert prepared.data == {"kind": "prepared", "path": "/ckpt/prepared-data/k"}
    bad = {
        **base,
        "phase": "Failed",
        "error": {
            "code": "MissingField",
            "file": "a.jsonl",
            "row": 4,
            "message": "no field 'text'",
        },
    }
    client.publish("ft-data", E.DATA_REPORT_KEY, bad)
    with pytest.raises(Refused) as refused:
        dataprep.ensure_data(client, JOB, spec, status, None, 320)
    assert refused.value.reason == C.R_INVALID_DATA
    assert refused.value.message == "spec.data: a.jsonl row 4: no field 'text' (MissingField)"


def test_a_report_published_just_before_the_pod_exited_is_not_a_crash():
    client, status, spec = FakeClient(), {}, parse_spec(SPEC)
    with pytest.raises(NotYet):
        dataprep.ensure_data(client, JOB, spec, status, None, 320)
    stale = client.objects[("ConfigMap", "ft-data")]
    done = {
        "kind": "DataPrepReport",
        "version": 1,
        "phase": "Done",
        "path": "/ckpt/prepared-data/k",
    }
    client.finish("ft-prepare-data")
    # the pass's first read is stale; the report lands before the re-read
    client.get_configmap = lambda ns, name, _s=[stale]: (
        _s.pop() if _s else {**stale, "data": {E.DATA_REPORT_KEY: json.dumps(done)}}
    )
    prepared = dataprep.ensure_data(client, JOB, spec, status, None, 320)
    assert prepared.data["path"] == "/ckpt/prepared-data/k"
    assert "pod/ft-prepare-data" not in client.deleted
