"""The discovery stage: a fresh TopologyReport for every candidate node, from the namespace's
``moe-topology-<node>`` cache or by running a discovery pod there.

:func:`ensure_reports` returns :class:`Discovered` or raises :class:`~.outcome.NotYet`:
``InsufficientNodes`` (fewer ready nodes match than ``spec.nodes.count``), ``DiscoveryPending``
(discovery pods running) or ``DiscoveryFailed`` (``failed``: a pod failed and runs again).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from dataclasses import dataclass
from typing import Any

from moe_contracts.topology import TopologyReport, parse_topology

from .. import constants as C
from ..builders import discovery as D
from ..builders.common import JobRef, owner_reference
from ..core.errors import DocumentError
from ..spec import AUTO, JobSpec
from . import machine
from .client import Client
from .outcome import NotYet

MAX_CANDIDATES = 64
MESSAGE_TAIL = 200  # characters of a failed discovery pod's termination message in the condition


@dataclass(frozen=True)
class Discovered:
    reports: dict[str, TopologyReport]  # node -> report, in candidate order
    message: str  # for the TopologyDiscovered condition


def _discovered(reports: dict[str, TopologyReport]) -> Discovered:
    return Discovered(
        reports, f"fresh topology reports for {len(reports)} node(s): {', '.join(reports)}"
    )


_parsed: dict[tuple[str, str], TopologyReport | None] = {}
_parsed_lock = threading.Lock()
PARSED_CACHE_MAX = 1024


def _parse_cached(cm: dict[str, Any]) -> TopologyReport | None:
    """``parse_topology`` of the ConfigMap's report, once per (uid, resourceVersion): every pass of
    every job read the same few reports, and parsing one 8-GPU NVSwitch report (144 links, each
    PCI id normalised) was the largest CPU item of a launch pass in the 100-job benchmark."""
    meta = cm.get("metadata") or {}
    key = (meta.get("uid", ""), meta.get("resourceVersion", ""))
    if all(key):
        with _parsed_lock:
            if key in _parsed:
                return _parsed[key]
    try:
        report = parse_topology(json.loads(cm["data"][C.TOPOLOGY_KEY]))
    except (ValueError, DocumentError):
        report = None
    if all(key):
        with _parsed_lock:
            if len(_parsed) >= PARSED_CACHE_MAX:
                _parsed.clear()
            _parsed[key] = report
    return report


def _fresh(
    cm: dict[str, Any] | None, node: dict[str, Any], now: dt.datetime
) -> TopologyReport | None:
    """The cached report when it is current (age, boot id: D.cached_report_is_current) and valid."""
    if cm is None or not D.cached_report_is_current(cm, node, now=now)[0]:
        return None
    return _parse_cached(cm)


def _termination_message(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or ():
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("message"):
            return " ".join(term["message"].split())[-MESSAGE_TAIL:]
    return ""


def ensure_reports(
    client: Client, body: dict[str, Any], spec: JobSpec, now: dt.datetime
) -> Discovered:
    job = JobRef.from_body(body)
    nodes = {n["metadata"]["name"]: n for n in client.list_nodes()}
    selectors = [spec.nodes.node_selector, spec.scheduling.node_selector]
    candidates = machine.candidate_nodes(
        list(nodes.values()), node_names=spec.nodes.node_names, selectors=selectors
    )[:MAX_CANDIDATES]
    # count Auto: at least one node, and a report from every candidate (the sizing chooses)
    auto_count = spec.nodes.count == AUTO
    least = 1 if auto_count else int(spec.nodes.count)
    need = max(len(candidates), 1) if auto_count else least
    if len(candidates) < least:
        why = machine.excluded_nodes(
            list(nodes.values()), node_names=spec.nodes.node_names, selectors=selectors
        )
        raise NotYet(
            C.R_NO_CANDIDATE_NODES,
            f"{len(candidates)} ready node(s) match the job, "
            f"spec.nodes.count is {spec.nodes.count}" + (f": {why}" if why else ""),
            15.0,
        )
    reports: dict[str, TopologyReport] = {}
    missing = []
    for node in candidates:
        cm = client.get_configmap_cached(job.namespace, D.topology_configmap_name(node))
        report = _fresh(cm, nodes[node], now)
        if report is not None:
            reports[node] = report
        else:
            missing.append(node)
    # enough fresh reports: no need to probe the rest
    if len(reports) >= need or not missing:
        if len(reports) < least:
            raise NotYet(
                C.R_DISCOVERY_FAILED,
                f"only {len(reports)} node(s) have a topology report",
                2.0,
                failed=True,
            )
        return _discovered(reports)

    # ServiceAccount, Role (may update every candidate's report), RoleBinding; pods below
    owner = owner_reference(job)
    for obj in D.discovery_children(
        job.name, candidates, namespace=job.namespace, image=spec.image, owner=owner
    )[:3]:
        client.create(obj)
    # Discovery pods are per node and namespace (moe-discovery-<node>): another job's may be
    # running for the same node already; its report serves this job too.
    pods = {
        p["metadata"]["name"]: p
        for p in client.list_pods(
            job.namespace, {C.LABEL_COMPONENT: D.COMPONENT, C.LABEL_MANAGED_BY: C.MANAGED_BY}
        )
    }
    failed, rerun = [], []
    tolerations = [
        t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations or ()
    ]
    for node in missing:
        name = D.discovery_pod_name(node)
        pod = pods.get(name)
        if pod is None:
            client.create(
                D.discovery_pod(
                    node,
                    namespace=job.namespace,
                    image=spec.image,
                    service_account=D.discovery_account_name(job.name),
                    owner=owner,
                    job_name=job.name,
                    image_pull_policy=spec.image_pull_policy,
                    tolerations=tolerations,
                )
            )
            continue
        phase = (pod.get("status") or {}).get("phase")
        if phase not in ("Failed", "Succeeded"):
            continue
        if phase == "Succeeded":
            # The pod publishes before it exits: the cached read above may predate its report.
            report = _fresh(
                client.get_configmap(job.namespace, D.topology_configmap_name(node)),
                nodes[node],
                now,
            )
            if report is not None:
                reports[node] = report
                continue
        # finished without a (current) report: show why and run a new pod
        view = machine.PodView.from_pod(pod)
        if phase == "Failed":
            why = _termination_message(pod)
            failed.append(f"{node} (exit code {view.exit_code}{': ' + why if why else ''})")
        else:
            rerun.append(node)  # an earlier run's pod: its report has aged out since
        client.delete_pod(job.namespace, name, uid=view.uid)
    if all(node in reports for node in missing):  # every pod had published after all
        return _discovered(reports)
    if failed:
        raise NotYet(
            C.R_DISCOVERY_FAILED,
            f"discovery failed on {', '.join(failed)}; retrying",
            10.0,
            failed=True,
        )
    raise NotYet(
        C.R_DISCOVERY_PENDING, f"discovery running on {', '.join(missing)}", 1.0 if rerun else 2.0
    )
