"""Publish a TopologyReport into a ConfigMap through the Kubernetes API (:mod:`moe_trainer.kubeapi`:
urllib, the pod's service account). Create first; on 409
(it exists: an earlier discovery of this node) replace it with PUT, unconditionally (no
resourceVersion), because the newest report of a node is the true one.
"""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

from moe_contracts import env as E
from moe_trainer.kubeapi import SA_DIR, api_request, service_url

TERMINATION_LOG = Path("/dev/termination-log")
TOPOLOGY_KEY = E.TOPOLOGY_KEY  # docs/contracts.md (moe_contracts.env)
LABEL_COMPONENT = "moe-operator.io/component"
LABEL_NODE = "moe-operator.io/node"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_GPU_SET = "moe-operator.io/gpu-uuid-set"  # sha256 of the sorted GPU UUIDs
ANNOTATION_BOOT_ID = "moe-operator.io/boot-id"  # host boot id at discovery time


class PublishError(Exception):
    """The report could not be written to the API server (retryable: EXIT_PUBLISH_FAILED)."""


def gpu_set_digest(report: dict) -> str:
    uuids = sorted(str(g.get("uuid")) for g in report.get("gpus", []))
    return hashlib.sha256(",".join(uuids).encode()).hexdigest()[:16]


def label_value(text: str) -> str:
    """A node name as a label value (<= 63 chars of [-A-Za-z0-9_.], alphanumeric at the ends)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in text)
    if len(cleaned) > 63:
        cleaned = cleaned[:54] + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return cleaned.strip("-_.") or "unknown"


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def configmap_body(report: dict, name: str, namespace: str) -> dict:
    annotations = {ANNOTATION_GPU_SET: gpu_set_digest(report)}
    if (bid := boot_id()) is not None:
        annotations[ANNOTATION_BOOT_ID] = bid
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                LABEL_COMPONENT: "topology",
                LABEL_NODE: label_value(report["node"]),
                LABEL_MANAGED_BY: "moe-operator",
            },
            "annotations": annotations,
        },
        "data": {TOPOLOGY_KEY: json.dumps(report, separators=(",", ":"))},
    }


class ApiConfig:
    """Where and how to reach the API server from inside a pod. `MOE_KUBE_API` (a base URL) and
    `MOE_KUBE_TOKEN_FILE` / `MOE_KUBE_CA_FILE` override the in-cluster defaults (local clusters)."""

    def __init__(self, base_url: str, token: str | None, ca_file: str | None):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.ca_file = ca_file

    @classmethod
    def from_env(cls) -> ApiConfig:
        base = os.environ.get("MOE_KUBE_API") or service_url()
        if not base:
            raise PublishError(
                "not in a pod: KUBERNETES_SERVICE_HOST is unset (and MOE_KUBE_API is not given)"
            )
        token_file = Path(os.environ.get("MOE_KUBE_TOKEN_FILE", SA_DIR / "token"))
        ca_file = Path(os.environ.get("MOE_KUBE_CA_FILE", SA_DIR / "ca.crt"))
        token = token_file.read_text().strip() if token_file.exists() else None
        return cls(base, token, str(ca_file) if ca_file.exists() else None)

    def request(
        self, method: str, path: str, body: dict | None = None, *, attempts: int = 4
    ) -> tuple[int, dict]:
        """(HTTP status, decoded body). Transport errors are retried: an API server that refuses
        a request (403) may close the connection while a larger body is still being sent, which
        the client sees as an EOF/reset, not as the 403 (seen here against kube-apiserver 1.20,
        about one try in ten with a 17 KB body); the next try usually reads the answer."""
        for attempt in range(attempts):
            try:
                return self._request_once(method, path, body)
            except PublishError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def _request_once(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        data = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
        req = api_request(method, self.base_url + path, data, self.token)
        context = None
        if self.base_url.startswith("https://"):
            context = ssl.create_default_context(cafile=self.ca_file)
        try:
            with urllib.request.urlopen(req, timeout=15, context=context) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            try:
                payload = json.loads(err.read() or b"{}")
            except (json.JSONDecodeError, OSError):
                payload = {}
            return err.code, payload
        except (urllib.error.URLError, OSError) as err:
            raise PublishError(f"{method} {self.base_url}{path}: {err}") from err


def publish_configmap(report: dict, name: str, namespace: str, api: ApiConfig | None = None) -> str:
    """Create or replace ConfigMap `namespace/name` holding the report; returns 'created' or
    'replaced'. Raises PublishError with the API server's message on any other answer."""
    api = api or ApiConfig.from_env()
    body = configmap_body(report, name, namespace)
    collection = f"/api/v1/namespaces/{namespace}/configmaps"
    status, payload = api.request("POST", collection, body)
    if status in (200, 201):
        return "created"
    if status == 409:
        try:
            status, payload = api.request("PUT", f"{collection}/{name}", body)
        except PublishError as err:
            raise PublishError(
                f"{err} (a refused update can look like this: may this pod's "
                f"ServiceAccount update configmaps/{name}?)"
            ) from err
        if status == 200:
            return "replaced"
    raise PublishError(
        f"ConfigMap {namespace}/{name}: HTTP {status}: {payload.get('message', payload)}"
    )


def summary(report: dict) -> str:
    """One line for /dev/termination-log and the log: node, GPU count and model, link kinds."""
    gpus = report["gpus"]
    names = sorted({str(g.get("name")) for g in gpus})
    kinds = sorted({link["remote"] for g in gpus for link in g["nvlinks"]})
    links = sum(len(g["nvlinks"]) for g in gpus)
    return (
        f"node={report['node']} source={report['source']} gpus={len(gpus)} "
        f"model={'/'.join(names)} nvlinks={links}({','.join(kinds) or 'none'}) "
        f"gpuSet={gpu_set_digest(report)}"
    )


def write_termination_log(text: str, path: Path | None = None) -> bool:
    """Write `text` (<= 4 KiB, the kubelet's limit) when the file exists; True if written."""
    path = path or TERMINATION_LOG
    if not path.exists():
        return False
    try:
        path.write_text(text[:4096])
        return True
    except OSError:
        return False
