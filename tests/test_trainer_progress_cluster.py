"""The trainer's progress ConfigMap patch against a real API server, with a service-account token
that may patch only that ConfigMap (what the operator's worker Role grants)."""

import base64
import json
from pathlib import Path
from urllib.parse import urlparse

import pytest

from moe_contracts.progress import progress_doc
from moe_trainer.telemetry import progress

pytestmark = pytest.mark.cluster


def test_progress_patch_with_a_scoped_token(kube, namespace, control_plane, tmp_path, monkeypatch):
    kube.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "job-progress"}, "data": {}}
    )
    kube.rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "progress"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": ["job-progress"],
                    "verbs": ["get", "patch"],
                }
            ],
        },
    )
    kube.rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "progress"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "progress",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        },
    )
    secret = kube.core.read_namespaced_service_account("default", namespace).secrets[0].name
    token = base64.b64decode(
        kube.core.read_namespaced_secret(secret, namespace).data["token"]
    ).decode()
    (tmp_path / "token").write_text(token)
    (tmp_path / "namespace").write_text(namespace)
    (tmp_path / "ca.crt").write_bytes(Path(control_plane.ca_path).read_bytes())
    url = urlparse(control_plane.server)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", url.hostname)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(url.port))
    doc = progress_doc(
        phase="Training",
        step=4,
        total_steps=10,
        loss=3.5,
        tokens_per_second=100.0,
        eta_seconds=6.0,
        checkpoint=None,
        moe={},
        health=[],
    )
    pub = progress.ConfigMapPublisher("job-progress", sa_dir=tmp_path)
    assert pub.publish(doc, force=True), "patch failed"
    cm = kube.core.read_namespaced_config_map("job-progress", namespace)
    assert json.loads(cm.data["progress.json"])["step"] == 4
    # another ConfigMap is out of the token's reach: logged, counted, not raised
    other = progress.ConfigMapPublisher("someone-else", sa_dir=tmp_path)
    assert other.publish(doc, force=True) is False and other.failures == 1
