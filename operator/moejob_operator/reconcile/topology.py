"""The discovery stage: a fresh TopologyReport for every candidate node, from the namespace's
``moe-topology-<node>`` cache or by running a discovery pod there.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from .. import constants as C
from ..builders import probe
from ..builders.common import JobRef
from ..core.errors import DocumentError
from ..core.topology import TopologyReport, parse_topology
from ..spec import JobSpec
from ..status import parse_time
from . import machine

MAX_CANDIDATES = 64


@dataclass
class Found:
    reports: dict[str, TopologyReport] = field(default_factory=dict)   # node -> report, node order
    candidates: list[str] = field(default_factory=list)
    pending: bool = False
    failed: bool = False
    message: str = ""
    retry_seconds: float = 2.0


def _fresh(cm: dict[str, Any] | None, now: dt.datetime) -> TopologyReport | None:
    raw = ((cm or {}).get("data") or {}).get(C.TOPOLOGY_KEY)
    if not raw:
        return None
    try:
        report = parse_topology(json.loads(raw))
    except (ValueError, DocumentError):
        return None
    collected = parse_time(str(json.loads(raw).get("collectedAt") or ""))
    if collected is None or (now - collected).total_seconds() > C.TOPOLOGY_REPORT_MAX_AGE_SECONDS:
        return None
    return report


def ensure_reports(client, body: dict[str, Any], spec: JobSpec, now: dt.datetime) -> Found:
    job = JobRef.from_body(body)
    candidates = machine.candidate_nodes(
        client.list_nodes(), node_names=spec.nodes.node_names,
        selectors=[spec.nodes.node_selector, spec.scheduling.node_selector])[:MAX_CANDIDATES]
    found = Found(candidates=candidates)
    if len(candidates) < spec.nodes.count:
        found.pending = True
        found.retry_seconds = 15.0
        found.message = (f"{len(candidates)} ready node(s) match the job, spec.nodes.count is "
                         f"{spec.nodes.count}")
        return found
    missing = []
    for node in candidates:
        report = _fresh(client.get_configmap(job.namespace, probe.topology_configmap_name(node)), now)
        if report is not None:
            found.reports[node] = report
        else:
            missing.append(node)
    # enough fresh reports: no need to probe the rest
    if len(found.reports) >= spec.nodes.count or not missing:
        if len(found.reports) < spec.nodes.count:
            found.pending, found.failed = True, True
            found.message = f"only {len(found.reports)} node(s) have a topology report"
            return found
        found.message = (f"fresh topology reports for {len(found.reports)} node(s): "
                         f"{', '.join(found.reports)}")
        return found

    for obj in probe.discovery_rbac(job, missing):
        client.create(obj)
    pods = {p["metadata"]["name"]: p for p in client.list_pods(
        job.namespace, {C.LABEL_JOB: job.name, C.LABEL_COMPONENT: "discovery"})}
    failed = []
    tolerations = [t.model_dump(by_alias=True, exclude_none=True)
                   for t in spec.scheduling.tolerations or ()]
    for node in missing:
        name = probe.discovery_pod_name(job, node)
        pod = pods.get(name)
        if pod is None:
            client.create(probe.discovery_pod(job, node, spec.image, spec.image_pull_policy, tolerations))
        elif (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
            # finished but no (fresh) report: show why and retry with a new pod
            view = machine.PodView.from_pod(pod)
            failed.append(f"{node} (exit code {view.exit_code})")
            client.delete_pod(job.namespace, name, uid=view.uid)
    found.pending = True
    found.failed = bool(failed)
    found.message = (f"discovery running on {', '.join(missing)}" if not failed else
                     f"discovery failed on {', '.join(failed)}; retrying")
    found.retry_seconds = 2.0 if not failed else 10.0
    return found
