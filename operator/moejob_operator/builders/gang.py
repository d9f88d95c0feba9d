"""Gang admission (``spec.scheduling.gang``): which gang scheduler admits a job's worker pods as
one unit, the name of each gang attempt's group, and Volcano's PodGroup for it.

Kueue (plain pods): a pod-group label and a total-count annotation on every pod (no object).
Volcano: a ``scheduling.volcano.sh/v1beta1`` PodGroup (``minMember`` = the gang's pod count),
created before the pods and owned by the job; each pod names it in the
``scheduling.k8s.io/group-name`` annotation and asks for the ``volcano`` scheduler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from .. import constants as C
from ..spec import Scheduling
from .common import JobRef, child_metadata

Gang = Literal["Kueue", "Volcano", "None"]
GANGS: tuple[Gang, ...] = ("Kueue", "Volcano", "None")


def resolve(sched: Scheduling, volcano_installed: Callable[[], bool] | None = None) -> Gang:
    """The gang scheduler for ``sched.gang``. Auto (or absent): Kueue when the pods carry a Kueue
    queue name; None when the user names a Volcano PodGroup of their own in ``podAnnotations``;
    Volcano when ``volcano_installed()`` (the cluster serves PodGroups; asked only here, and not
    at all when it is None); else None."""
    if sched.gang in ("Kueue", "Volcano", "None"):
        return sched.gang
    if C.KUEUE_QUEUE_LABEL in (sched.pod_labels or {}):
        return "Kueue"
    if C.VOLCANO_GROUP_NAME_ANNOTATION in (sched.pod_annotations or {}):
        return "None"
    if volcano_installed is not None and volcano_installed():
        return "Volcano"
    return "None"


def group_name(job: JobRef, attempt: int) -> str:
    """The group of gang attempt ``attempt``: Kueue's pod-group label value (at most 63 chars)
    and Volcano's PodGroup name; the job's uid keeps two jobs' groups apart."""
    return f"{job.name[:40]}-{job.uid[:8]}-a{attempt}"


def pod_fields(
    job: JobRef, sched: Scheduling, gang: Gang, attempt: int, count: int
) -> tuple[dict[str, str], dict[str, str], str | None]:
    """(labels, annotations, schedulerName or None) a worker pod of the attempt gets for ``gang``
    (``count``: the gang's pod count). Volcano: the user's ``schedulerName`` is kept when set
    (e.g. a second Volcano scheduler under another name)."""
    name = group_name(job, attempt)
    if gang == "Kueue":  # admitted whole or not at all
        return (
            {C.KUEUE_POD_GROUP_LABEL: name},
            {C.KUEUE_TOTAL_COUNT_ANNOTATION: str(count)},
            sched.scheduler_name,
        )
    if gang == "Volcano":
        return (
            {},
            {C.VOLCANO_GROUP_NAME_ANNOTATION: name},
            sched.scheduler_name or C.VOLCANO_SCHEDULER,
        )
    return {}, {}, sched.scheduler_name


def volcano_pod_group(job: JobRef, sched: Scheduling, attempt: int, count: int) -> dict[str, Any]:
    """The PodGroup of gang attempt ``attempt``: Volcano binds none of the ``count`` worker pods
    until it can bind all of them. Queue: ``podAnnotations['scheduling.volcano.sh/queue-name']``
    when set (else Volcano's default queue); priority: ``priorityClassName``."""
    spec: dict[str, Any] = {"minMember": count}
    queue = (sched.pod_annotations or {}).get(C.VOLCANO_QUEUE_ANNOTATION)
    if queue:
        spec["queue"] = queue
    if sched.priority_class_name:
        spec["priorityClassName"] = sched.priority_class_name
    meta = child_metadata(
        job, group_name(job, attempt), "podgroup", extra_labels={C.LABEL_ATTEMPT: str(attempt)}
    )
    return {
        "apiVersion": C.VOLCANO_API_VERSION,
        "kind": "PodGroup",
        "metadata": meta,
        "spec": spec,
    }
