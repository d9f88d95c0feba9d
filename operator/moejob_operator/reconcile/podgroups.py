"""The job's gang scheduler, chosen once (``status.gangScheduler``), and Volcano's PodGroup per
gang attempt: created before the attempt's pods, the previous attempt's deleted when a new one
is created, the last one deleted when the job finishes or is suspended (a gang without pods
holds no queue share). Only objects this job controls are deleted."""

from __future__ import annotations

from typing import cast

from .. import constants as C
from ..builders import gang as G
from ..spec import JobSpec
from .client import controller_uid
from .jobpass import Pass

STATUS_KEY = "gangScheduler"


def scheduler(p: Pass, spec: JobSpec) -> G.Gang:
    """The gang scheduler of the job's attempts: ``spec.scheduling.gang`` resolved against the
    cluster (Auto: is Volcano's PodGroup API served?) at the first launch, then kept in status,
    so that every attempt of a job is admitted the same way whatever is installed later."""
    have = p.status.get(STATUS_KEY)
    if have in G.GANGS:
        return cast(G.Gang, have)
    chosen = G.resolve(
        spec.scheduling,
        lambda: p.client.serves(C.VOLCANO_GROUP, C.VOLCANO_VERSION, C.VOLCANO_PODGROUPS),
    )
    p.status[STATUS_KEY] = chosen
    return chosen


def before_pods(p: Pass, spec: JobSpec, gang: G.Gang, attempt: int, count: int) -> None:
    """Volcano: the attempt's PodGroup (``minMember`` = ``count``) exists before its pods; the
    previous attempt's is gone. Raises ``Rejected`` when the API server refuses it for good (no
    PodGroup CRD: 404)."""
    if gang != "Volcano":
        return
    if attempt > 0:
        _delete(p, attempt - 1)
    p.client.create(G.volcano_pod_group(p.job, spec.scheduling, attempt, count))


def finished(p: Pass, attempt: int | None) -> None:
    """The job is done or suspended: its attempt's PodGroup goes (no pods for Volcano to wait
    for; a resumed job creates it again before its pods)."""
    if p.status.get(STATUS_KEY) == "Volcano" and attempt is not None:
        _delete(p, attempt)


def _delete(p: Pass, attempt: int) -> None:
    name = G.group_name(p.job, attempt)
    have = p.client.get_pod_group(p.job.namespace, name)
    if have is not None and controller_uid(have) == p.job.uid:
        p.client.delete_pod_group(p.job.namespace, name, uid=have["metadata"]["uid"])
