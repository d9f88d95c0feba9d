"""Helpers for the operator's cluster tests: install the CRD, run the real operator (kopf, as a
subprocess so a test can kill it at any point), apply jobs, read conditions."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml
from kubernetes.client.rest import ApiException

from moe_localkube import procs
from moe_localkube.testing import (
    create_namespace,
    delete_namespace,
    operator_command,
    unique_name,
)
from moejob_operator import constants as C

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / "moetrainingjob.yaml"


def install_crd(kube) -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    try:
        kube.apiext.create_custom_resource_definition(crd)
    except ApiException as exc:
        if exc.status != 409:
            raise
        cur = kube.apiext.read_custom_resource_definition(crd["metadata"]["name"])
        crd["metadata"]["resourceVersion"] = cur.metadata.resource_version
        kube.apiext.replace_custom_resource_definition(crd["metadata"]["name"], crd)
    deadline = time.monotonic() + 120  # a deadline for failing, not a measurement
    while time.monotonic() < deadline:
        cur = kube.apiext.read_custom_resource_definition(crd["metadata"]["name"])
        if any(c.type == "Established" and c.status == "True" for c in cur.status.conditions or ()):
            return
        time.sleep(0.2)
    raise AssertionError("CRD not established")


class Operator:
    """``moectl operator -A --no-leader-election`` (the chart's entrypoint, one replica) against
    the test control plane."""

    def __init__(self, control_plane, log_dir: Path):
        self.cp = control_plane
        self.log_dir = Path(log_dir)
        self.proc = None
        self.starts = 0

    def start(self, **env: str) -> Operator:
        self.starts += 1
        full = dict(os.environ, KUBECONFIG=str(self.cp.kubeconfig), **env)
        full.pop("MOE_OPERATOR_CRASH_AT", None) if "MOE_OPERATOR_CRASH_AT" not in env else None
        self.log = self.log_dir / f"operator-{self.starts}.log"
        self.proc = procs.spawn(
            operator_command(),
            self.log,
            env=full,
        )
        return self

    # kopf logs this once it has credentials, right before it starts its watches
    READY_LINE = "Initial authentication has finished"

    def wait_ready(self, timeout: float = 300) -> Operator:
        """Wait until the process is up (its ready line), so that a test's own deadlines time
        the operator's work and not its start on a loaded machine (imports take seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            if self.READY_LINE in text:
                return self
            if self.proc is None or self.proc.poll() is not None:
                raise AssertionError(f"operator exited before it was ready:\n{text[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"operator not ready after {timeout:.0f}s:\n{self.logs()}")

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, grace_seconds=5)
            self.proc = None

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except Exception:  # noqa: BLE001 - still running, or no process: no exit code
            return None

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace")[-6000:]
            for p in sorted(self.log_dir.glob("operator-*.log"))
        )


def apply_job(kube, namespace: str, manifest: dict) -> dict:
    return kube.custom.create_namespaced_custom_object(
        C.GROUP, C.VERSION, namespace, C.PLURAL, manifest
    )


def get_job(kube, namespace: str, name: str) -> dict:
    return kube.custom.get_namespaced_custom_object(C.GROUP, C.VERSION, namespace, C.PLURAL, name)


def launched(
    kube, namespace: str, name: str, wait_for, attempt: int = 0, timeout: float = 30
) -> dict:
    """The job once its status records the launch of ``attempt``: a first launch writes status
    after the worker pods and the trainer's other children (reconcile/gang.py _complete_launch),
    so a test that saw the pods waits for this before it reads status."""

    def done():
        job = get_job(kube, namespace, name)
        return (job.get("status") or {}).get("gangComplete") == attempt and job

    return wait_for(
        done, timeout=timeout, message=f"{name}: status records launch attempt {attempt}"
    )


def condition(job: dict, ctype: str) -> dict:
    for c in (job.get("status") or {}).get("conditions") or ():
        if c["type"] == ctype:
            return c
    return {}


def events_for(kube, namespace: str, name: str) -> list:
    evs = kube.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
    return evs.items


def example(name: str, **overrides) -> dict:
    """``examples/<name>`` with ``overrides`` replacing whole spec fields. The example's
    ``runPolicy.activeDeadlineSeconds`` is dropped unless the test passes a ``runPolicy``: a
    wall-clock deadline would make the test's outcome depend on the machine's load (the test
    waits for a condition, under its own generous timeout, instead)."""
    doc = yaml.safe_load((ROOT / "examples" / name).read_text())
    doc["metadata"].update(overrides.pop("metadata", {}))
    if "runPolicy" not in overrides:
        doc["spec"].get("runPolicy", {}).pop("activeDeadlineSeconds", None)
    for k, v in overrides.items():
        doc["spec"][k] = v
    return doc


def seed_topology(
    kube, namespace: str, nodes=("node-a", "node-b"), fixture="nvswitch-h100-8"
) -> None:
    """Fresh cached TopologyReports, as a discovery pod would have left them."""
    import json

    from moe_contracts.topology import report_to_json
    from moejob_operator.core.topology import load_topology
    from moejob_operator.status import now_iso

    for node in nodes:
        doc = report_to_json(load_topology(fixture))
        doc.update(node=node, collectedAt=now_iso())
        body = {
            "metadata": {"name": f"{C.TOPOLOGY_CONFIGMAP_PREFIX}{node}"},
            "data": {C.TOPOLOGY_KEY: json.dumps(doc)},
        }
        try:
            kube.core.create_namespaced_config_map(namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise


def children(kube, namespace: str, name: str) -> list[str]:
    sel = f"{C.LABEL_JOB}={name}"
    out = [
        f"pod/{p.metadata.name}"
        for p in kube.core.list_namespaced_pod(namespace, label_selector=sel).items
    ]
    out += [
        f"cm/{c.metadata.name}"
        for c in kube.core.list_namespaced_config_map(namespace, label_selector=sel).items
    ]
    out += [
        f"svc/{s.metadata.name}"
        for s in kube.core.list_namespaced_service(namespace, label_selector=sel).items
    ]
    out += [
        f"sa/{s.metadata.name}"
        for s in kube.core.list_namespaced_service_account(namespace, label_selector=sel).items
    ]
    return sorted(out)


def module_namespace(prefix: str):
    """A module-scoped namespace fixture (``name = module_namespace("moe-x")`` in the test module):
    a fresh namespace named ``prefix-<random>``, deleted after the module."""

    @pytest.fixture(scope="module")
    def namespace(kube):
        ns = create_namespace(kube, unique_name(prefix))
        yield ns
        delete_namespace(kube, ns)

    return namespace


def gate_operator(control_plane, kube, namespace: str, work: Path, stand_in: str) -> Operator:
    """A started operator (the CRD installed) with the upgrade gate on, in ``namespace``, whose
    smoke pods run ``stand_in`` (Python source, written to ``work/smoke_stand_in.py``) instead of
    ``moe-smoke`` (``MOE_GATE_SMOKE_COMMAND``)."""
    install_crd(kube)
    script = Path(work) / "smoke_stand_in.py"
    script.write_text(stand_in)
    return (
        Operator(control_plane, work)
        .start(
            MOE_OPERATOR_NAMESPACE=namespace,
            MOE_GATE_ENABLED="true",
            MOE_GATE_SMOKE_COMMAND=json.dumps([sys.executable, str(script)]),
        )
        .wait_ready()
    )


def module_operator(dirname: str = "operator"):
    """A module-scoped ``operator_proc`` fixture: the CRD installed and one real operator process
    for the module's tests (``operator_proc = module_operator()`` in the test module)."""

    @pytest.fixture(scope="module")
    def operator_proc(control_plane, kube, node_agent, tmp_path_factory):
        install_crd(kube)
        op = Operator(control_plane, tmp_path_factory.mktemp(dirname)).start().wait_ready()
        yield op
        op.stop()

    return operator_proc
