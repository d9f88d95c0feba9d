"""The local control plane: readiness, CRDs with a status subresource, clean shutdown."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from kubernetes.client.exceptions import ApiException

from moe_localkube import procs
from moe_localkube.controlplane import ControlPlane

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "localkube-test.moe-operator.io", "v1", "widgets"

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": PLURAL, "singular": "widget", "kind": "Widget", "shortNames": ["wdg"]},
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1},
                                    "mode": {
                                        "type": "string",
                                        "enum": ["Fast", "Slow"],
                                        "default": "Fast",
                                    },
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {"phase": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}


def test_readyz(control_plane):
    ctx = ssl.create_default_context(cafile=str(control_plane.ca_path))
    req = urllib.request.Request(
        f"{control_plane.server}/readyz?verbose",
        headers={"Authorization": f"Bearer {control_plane.admin_token}"},
    )
    with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
        body = resp.read().decode()
    assert resp.status == 200 and "readyz check passed" in body


def test_crd_custom_resource_and_status_subresource(kube, namespace, wait_for, kubectl):
    try:
        kube.apiext.create_custom_resource_definition(CRD)
    except ApiException as exc:
        if exc.status != 409:
            raise

    def established():
        crd = kube.apiext.read_custom_resource_definition(f"{PLURAL}.{GROUP}")
        return any(
            c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
        )

    wait_for(established, timeout=30, message="CRD Established")
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": "w1"},
        "spec": {"size": 3},
    }
    # The first CR create is what kills an apiserver built with the broken reflect2.
    created = wait_for(
        lambda: kube.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, body
        ),
        timeout=20,
        message="custom resource created",
    )
    assert created["spec"] == {"size": 3, "mode": "Fast"}, "structural-schema defaulting"

    # Status sent to the main resource is ignored; through the subresource it sticks.
    kube.custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        "w1",
        {"status": {"phase": "Ignored"}},
        _content_type="application/merge-patch+json",
    )
    assert "status" not in kube.custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "w1"
    )
    kube.custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        "w1",
        {"status": {"phase": "Ready"}},
        _content_type="application/merge-patch+json",
    )
    got = kube.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w1")
    assert got["status"] == {"phase": "Ready"}
    assert got["metadata"]["generation"] == 1, "status writes do not bump the generation"

    with pytest.raises(ApiException, match="Unprocessable Entity") as err:
        kube.custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            {**body, "metadata": {"name": "bad"}, "spec": {"size": 0}},
        )
    assert "spec.size" in err.value.body

    out = kubectl.run("get", "wdg", "-n", namespace).stdout
    header, row = out.splitlines()[:2]
    assert header.split()[:3] == ["NAME", "SIZE", "PHASE"]
    assert row.split()[:3] == ["w1", "3", "Ready"]


def test_second_control_plane_starts_and_leaves_nothing(tmp_path):
    with ControlPlane(tmp_path, controller_manager=False, scheduler=False) as cp:
        pids = set(cp.pids)
        assert len(pids) == 2, "etcd and kube-apiserver"
        assert procs.survivors(pids) == sorted(pids)
        api = cp.api_client()
        from kubernetes import client

        assert any(
            ns.metadata.name == "default" for ns in client.CoreV1Api(api).list_namespace().items
        )
        api.close()
    assert procs.survivors(pids) == []


def test_failed_start_leaves_nothing(tmp_path, monkeypatch):
    from moe_localkube import binaries

    real = binaries.resolve_kube_binaries()
    fake = dict(real)
    fake["kube-apiserver"] = tmp_path / "no-such-apiserver"
    monkeypatch.setattr(binaries, "resolve_kube_binaries", lambda **kw: fake)
    cp = ControlPlane(tmp_path / "run", controller_manager=False, scheduler=False, ready_timeout=10)
    with pytest.raises(FileNotFoundError, match="no-such-apiserver"):
        cp.start()
    assert cp.pids, "etcd had been started"
    assert procs.survivors(cp.pids) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_parent_signal_stops_every_process(tmp_path, sig):
    script = textwrap.dedent(f"""
        import json, signal, sys, time
        from moe_localkube.controlplane import ControlPlane
        # A shell's background job (nohup ... &, some CI runners) starts with SIGINT ignored and
        # Python keeps it so; give the parent what Ctrl-C in a terminal gets.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with ControlPlane({str(tmp_path)!r}, controller_manager=False, scheduler=False) as cp:
            print(json.dumps(sorted(cp.pids)), flush=True)
            time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2 and procs.survivors(pids) == pids
        parent.send_signal(sig)
        parent.wait(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode != 0
    assert procs.survivors(pids) == []
