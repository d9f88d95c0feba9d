"""The Kubernetes API from inside a pod with nothing but urllib: the trainer image carries no
Kubernetes client. Both of its API writers use this: the progress / routing-statistics
ConfigMap patches (:mod:`moe_trainer.telemetry.progress`) and topology discovery's ConfigMap publish
(:mod:`moe_trainer.discovery.publish`).

The pod's service-account token, CA bundle and namespace (:data:`SA_DIR`) and the
``KUBERNETES_SERVICE_HOST/PORT`` env the kubelet injects are all it takes.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def service_url() -> str | None:
    """``https://host:port`` of the API server from the kubelet's env (an IPv6 host in
    brackets), or None outside a pod."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if not host:
        return None
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{port}"


def api_request(
    method: str,
    url: str,
    data: bytes | None,
    token: str | None,
    content_type: str = "application/json",
) -> urllib.request.Request:
    """One JSON request to the API server, with the bearer token when there is one."""
    headers = {"Content-Type": content_type, "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return urllib.request.Request(url, data=data, method=method, headers=headers)


def read_configmap(
    name: str, sa_dir: Path = SA_DIR, timeout_s: float = 10.0
) -> dict[str, Any] | None:
    """GET ConfigMap ``name`` of the pod's namespace (the decoded object), None when it does not
    exist (404). Other failures raise (``urllib.error.URLError``, ``OSError``, ``ValueError``)."""
    import json
    import ssl
    import urllib.error

    base = service_url()
    if base is None:
        raise OSError("not in a pod (no KUBERNETES_SERVICE_HOST)")
    ns = (sa_dir / "namespace").read_text().strip()
    token = (sa_dir / "token").read_text().strip()
    req = api_request("GET", f"{base}/api/v1/namespaces/{ns}/configmaps/{name}", None, token)
    ctx = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout_s) as resp:
            obj: dict[str, Any] = json.loads(resp.read())
            return obj
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
