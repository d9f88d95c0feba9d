"""Which build a tag-only image is on the gang's nodes, before launch: the digest probe pods.

One short pod per planned node (``builders.digest_probe``), created once and read on every pass
until each has reported the digest its runtime ran (``containerStatuses[].imageID``); the gate
(:mod:`.gate`) decides with :func:`moejob_operator.core.gate.digests.resolve` and deletes them.
All calls go through the Client (pods in the job's namespace, like the workers).
"""

from __future__ import annotations

from typing import Any

from .. import constants as C
from ..builders import digest_probe as B
from ..builders.common import JobRef
from ..core.gate import digest_of
from ..core.gate.digests import PENDING
from ..spec import JobSpec
from .client import Client


def _reported(pod: dict[str, Any]) -> str | None:
    """The digest the pod's container ran, None when its runtime reported none, PENDING while it
    has not started."""
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or ():
        state = cs.get("state") or {}
        if "running" in state or "terminated" in state:
            return digest_of(cs.get("imageID"))
    return PENDING


def _probes(client: Client, job: JobRef) -> dict[str, dict[str, Any]]:
    pods = client.list_pods(job.namespace, {C.LABEL_JOB: job.name, C.LABEL_COMPONENT: B.COMPONENT})
    return {p["metadata"]["name"]: p for p in pods}


def node_digests(
    client: Client, body: dict[str, Any], spec: JobSpec, nodes: list[str]
) -> dict[str, str | None]:
    """``{node: digest | None | PENDING}`` for the job's ``nodes``; creates the probes missing."""
    job = JobRef.from_body(body)
    pods = _probes(client, job)
    out: dict[str, str | None] = {}
    for i, node in enumerate(nodes):
        pod = pods.get(B.probe_name(job, i))
        if pod is not None and (
            pod["spec"].get("nodeName") != node or pod["metadata"].get("deletionTimestamp")
        ):
            if not pod["metadata"].get("deletionTimestamp"):
                client.delete_pod(
                    job.namespace, pod["metadata"]["name"], uid=pod["metadata"]["uid"]
                )
            out[node] = PENDING  # a probe of an earlier plan: wait until it is gone
            continue
        if pod is None:
            client.create(B.probe_pod(job, spec, node, i))
            out[node] = PENDING
            continue
        out[node] = _reported(pod)
    return out


def delete_probes(client: Client, body: dict[str, Any]) -> None:
    job = JobRef.from_body(body)
    for name, pod in _probes(client, job).items():
        if not pod["metadata"].get("deletionTimestamp"):
            client.delete_pod(job.namespace, name, uid=pod["metadata"]["uid"])
