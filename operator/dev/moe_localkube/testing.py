"""Helpers shared by the test fixtures (tests/conftest.py) and anything else that drives a local
cluster: typed client bundle, polling, kubectl wrapper."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class WaitTimeout(AssertionError):
    """``wait_for`` gave up; the message carries the last value seen."""


# A wait's timeout is a deadline for declaring failure, never a measurement: on a loaded machine
# (CI, or several test sessions on 2 cores) an Event or a pod can take many times its usual
# seconds, so no wait gives up sooner than this. Timing goals live in benchmarks/.
MIN_WAIT_SECONDS = float(os.environ.get("MOE_TEST_MIN_WAIT_SECONDS", "60"))


def wait_for(
    predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2, message: str = ""
) -> Any:
    """Call ``predicate`` until it returns something truthy; return that value.

    Exceptions from ``predicate`` count as "not yet" (the last one is reported on timeout), so
    ``wait_for(lambda: core.read_namespaced_pod(...).status.phase == "Running")`` is fine even
    before the pod exists. ``timeout`` is raised to at least ``MIN_WAIT_SECONDS``.
    """
    timeout = max(timeout, MIN_WAIT_SECONDS)
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - reported on timeout
            last = exc
        if time.monotonic() >= deadline:
            raise WaitTimeout(
                f"timed out after {timeout}s waiting for {message or predicate}; last: {last!r}"
            )
        time.sleep(interval)


def crd_established(kube: Kube, name: str, timeout: float = 60.0) -> None:
    """Wait for CRD ``name``'s ``Established`` condition. (``kubectl wait --for=condition=...``
    fails instead of waiting while a just-created CRD has no ``status.conditions`` yet.)"""

    def established() -> bool:
        cur = kube.apiext.read_custom_resource_definition(name)
        conditions = cur.status.conditions if cur.status is not None else None
        return any(c.type == "Established" and c.status == "True" for c in conditions or ())

    wait_for(established, timeout=timeout, message=f"CRD {name} Established")


@dataclass
class Kube:
    """API clients for one identity (the admin, in the ``kube`` fixture)."""

    api_client: Any
    core: Any  # CoreV1Api
    batch: Any  # BatchV1Api
    custom: Any  # CustomObjectsApi
    apiext: Any  # ApiextensionsV1Api
    rbac: Any  # RbacAuthorizationV1Api
    coordination: Any  # CoordinationV1Api

    @classmethod
    def from_api_client(cls, api_client) -> Kube:
        from kubernetes import client

        return cls(
            api_client=api_client,
            core=client.CoreV1Api(api_client),
            batch=client.BatchV1Api(api_client),
            custom=client.CustomObjectsApi(api_client),
            apiext=client.ApiextensionsV1Api(api_client),
            rbac=client.RbacAuthorizationV1Api(api_client),
            coordination=client.CoordinationV1Api(api_client),
        )


@dataclass
class Kubectl:
    """``kubectl`` (v1.35 client; prints a version-skew warning against the 1.20 server)."""

    path: Path
    env: dict[str, str]
    helm: Path

    def run(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        res = subprocess.run(
            [str(self.path), *args],
            env=self.env,
            input=input,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if check and res.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {res.returncode}:\n{res.stderr}")
        return res


def unique_name(prefix: str, max_len: int = 40) -> str:
    """A DNS-1123 label: ``prefix`` (sanitised, shortened) + random suffix."""
    clean = "".join(c if c.isalnum() else "-" for c in prefix.lower()).strip("-")
    clean = "-".join(p for p in clean.split("-") if p)[: max_len - 7].strip("-") or "t"
    return f"{clean}-{secrets.token_hex(3)}"


def create_namespace(kube: Kube, name: str, timeout: float = 30.0) -> str:
    """Create ``name`` and wait until its ``default`` ServiceAccount has a token secret
    (1.20's ServiceAccount admission rejects pods before that)."""
    kube.core.create_namespace(
        {"metadata": {"name": name, "labels": {"moe-operator.io/test": "true"}}}
    )

    def sa_ready():
        sa = kube.core.read_namespaced_service_account("default", name)
        return bool(sa.secrets)

    wait_for(sa_ready, timeout=timeout, message=f"ServiceAccount {name}/default with a token")
    return name


def delete_namespace(kube: Kube, name: str) -> None:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        kube.core.delete_namespace(name, _request_timeout=10)
    except ApiException as exc:
        if exc.status != 404:
            raise
    except HTTPError:
        pass  # the control plane is already gone (interrupted session): nothing left to delete


def operator_command(*, metrics_port: int = 0) -> list[str]:
    """The operator as a local process: ``moectl operator -A --no-leader-election`` (the chart's
    entrypoint with one replica; its flags are in charts/moe-operator/templates/deployment.yaml),
    with this interpreter and ports the OS picks unless ``metrics_port`` is given."""
    return [
        sys.executable,
        "-m",
        "moejob_operator.cli",
        "operator",
        "-A",
        "--no-leader-election",
        "--health-port=0",
        f"--metrics-port={metrics_port}",
    ]
