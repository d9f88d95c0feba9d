"""Pure decisions of the reconcile loop: what to do with the worker gang, which nodes to use,
when deadlines and TTLs fire, how trainer progress maps onto the status. No API calls here.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from moe_contracts.errors import DocumentError
from moe_contracts.exit import parse_trainer_exit
from moe_contracts.progress import TrainerProgress

from .. import constants as C


# ---- worker pods ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PodView:
    """What the gang logic needs from one worker pod."""

    name: str
    uid: str
    node_rank: int
    attempt: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    exit_code: int | None  # trainer container's exit code once terminated
    deleting: bool
    node: str | None
    cause: str | None = None  # why it exited: TrainerExit.cause, or OutOfMemory (OOMKilled)
    cause_message: str = ""

    @classmethod
    def from_pod(cls, pod: dict[str, Any]) -> PodView:
        meta, status = pod["metadata"], pod.get("status") or {}
        labels = meta.get("labels") or {}
        code, cause, why = None, None, ""
        for cs in status.get("containerStatuses") or ():
            term = (cs.get("state") or {}).get("terminated")
            if term is not None:
                code = term.get("exitCode")
                cause, why = exit_cause(term)
        return cls(
            name=meta["name"],
            uid=meta.get("uid", ""),
            node_rank=_label_int(labels, C.LABEL_NODE_RANK),
            attempt=_label_int(labels, C.LABEL_ATTEMPT),
            phase=status.get("phase") or "Pending",
            exit_code=code,
            deleting=bool(meta.get("deletionTimestamp")),
            node=(pod.get("spec") or {}).get("nodeName"),
            cause=cause,
            cause_message=why,
        )

    def describe(self) -> str:
        """``exit code 78`` plus the cause the worker reported, for condition messages."""
        what = (
            f"exit code {self.exit_code}"
            if self.exit_code is not None
            else "no exit code (pod failed)"
        )
        if self.cause:
            what += f", {self.cause}" + (f": {self.cause_message}" if self.cause_message else "")
        return what


def _label_int(labels: dict[str, str], key: str) -> int:
    try:
        return int(labels.get(key, -1))
    except (TypeError, ValueError):
        return -1  # someone relabelled the pod: it is stale


# Causes a worker reports that a person can act on: the Failed reason names them directly.
KNOWN_CAUSES = {
    "CheckpointNotWritable": C.R_CHECKPOINT_NOT_WRITABLE,
    "CheckpointVolumeFull": C.R_CHECKPOINT_VOLUME_FULL,
    "DataNotFound": C.R_DATA_NOT_FOUND,
    "OutOfMemory": C.R_OUT_OF_MEMORY,
}
MESSAGE_TAIL = 300


def exit_cause(term: dict[str, Any]) -> tuple[str | None, str]:
    """(cause, message) from a terminated container state: the trainer's TrainerExit document
    (docs/contracts.md), or the runtime's OOMKilled."""
    if term.get("reason") == "OOMKilled":
        return "OutOfMemory", "the container exceeded its memory limit (OOMKilled)"
    try:
        doc = parse_trainer_exit(term.get("message") or "")
    except DocumentError:
        return None, ""
    return doc["cause"][:64], " ".join(str(doc.get("message", "")).split())[-MESSAGE_TAIL:]


def is_permanent(code: int | None) -> bool:
    return code in C.PERMANENT_EXIT_CODES


@dataclass
class GangDecision:
    """``action``: one of
    wait      - nothing to do until something changes
    create    - create ``create_ranks`` (current attempt)
    delete    - delete ``delete`` (stale pods of an older attempt) and wait for them to go
    restart   - bump the attempt, delete the gang, relaunch from the checkpoint;
                ``counts_against_backoff`` is False when a person deleted a worker pod
    fail      - stop (and delete ``delete``); ``reason``/``message`` say why
    succeed   - every node rank finished with exit 0
    """

    action: str
    create_ranks: list[int] = field(default_factory=list)
    delete: list[PodView] = field(default_factory=list)
    reason: str = ""
    message: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    counts_against_backoff: bool = True


def _live(pods: list[PodView]) -> list[PodView]:
    return [p for p in pods if not p.deleting and p.phase in ("Pending", "Running", "Unknown")]


def decide_gang(
    pods: list[PodView],
    *,
    count: int,
    attempt: int,
    failed_restarts: int,
    backoff_limit: int,
    gang_complete: bool,
) -> GangDecision:
    """The gang policy as one function of the observed worker pods.

    ``gang_complete``: every rank of ``attempt`` was created once already (so a missing rank
    now was deleted by someone, not "not created yet"). Pods being deleted are ignored except
    that their names are still taken; pods of an older attempt are stale and go first, so two
    generations never rendezvous with each other.
    """
    going = [p for p in pods if p.deleting]
    here = [p for p in pods if not p.deleting]
    stale = [p for p in here if p.attempt != attempt or not 0 <= p.node_rank < count]
    current = {p.node_rank: p for p in here if p not in stale}
    counts = {"pending": 0, "running": 0, "succeeded": 0, "failed": 0}
    for p in current.values():
        counts[
            {"Running": "running", "Succeeded": "succeeded", "Failed": "failed"}.get(
                p.phase, "pending"
            )
        ] += 1

    failed = sorted((p for p in current.values() if p.phase == "Failed"), key=lambda p: p.node_rank)
    permanent = [p for p in failed if is_permanent(p.exit_code)]
    if permanent:
        p = permanent[0]
        return GangDecision(
            "fail",
            reason=KNOWN_CAUSES.get(p.cause or "", C.R_PERMANENT_WORKER_FAILURE),
            counts=counts,
            delete=_live(here),
            message=f"worker {p.name} (node rank {p.node_rank}) exited with permanent "
            f"{p.describe()}; not retried",
        )
    if failed:
        # a worker that says why first (the others often only lost their peer)
        p = min(failed, key=lambda x: (x.cause not in KNOWN_CAUSES, x.node_rank))
        what = p.describe()
        if failed_restarts >= backoff_limit:
            return GangDecision(
                "fail",
                reason=KNOWN_CAUSES.get(p.cause or "", C.R_BACKOFF_LIMIT_EXCEEDED),
                counts=counts,
                delete=_live(here),
                message=f"worker {p.name} failed ({what}) after {failed_restarts} gang "
                f"restart(s); backoffLimit is {backoff_limit}",
            )
        return GangDecision(
            "restart",
            counts=counts,
            reason=C.R_RESTARTING,
            delete=here,
            message=f"worker {p.name} failed ({what}); restarting the gang from the "
            f"latest checkpoint (restart {failed_restarts + 1} of {backoff_limit})",
        )
    if stale:
        return GangDecision(
            "delete",
            delete=stale,
            counts=counts,
            reason=C.R_RESTARTING,
            message="deleting the previous gang's pods",
        )
    if len(current) == count and all(p.phase == "Succeeded" for p in current.values()):
        return GangDecision(
            "succeed",
            counts=counts,
            reason=C.R_TRAINING_FINISHED,
            message=f"all {count} node ranks finished",
        )
    missing = [r for r in range(count) if r not in current]
    if missing and gang_complete and current:
        return GangDecision(
            "restart",
            counts=counts,
            reason=C.R_RESTARTING,
            delete=here,
            counts_against_backoff=False,
            message=f"worker pod(s) of node rank(s) {missing} disappeared; restarting "
            "the gang from the latest checkpoint",
        )
    taken = {p.node_rank for p in going}
    creatable = [r for r in missing if r not in taken]
    if creatable:
        return GangDecision(
            "create",
            create_ranks=creatable,
            counts=counts,
            reason=C.R_LAUNCHING,
            message=f"creating node rank(s) {creatable}",
        )
    return GangDecision("wait", counts=counts)


# ---- nodes ------------------------------------------------------------------------------------
def node_ready(node: dict[str, Any]) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for cond in (node.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready":
            ready: bool = cond.get("status") == "True"
            return ready
    return False


def candidate_nodes(
    nodes: list[dict[str, Any]],
    *,
    node_names: list[str] | None,
    selectors: list[dict[str, str] | None],
) -> list[str]:
    """Ready nodes the job may use, sorted by name (``node_names`` keeps the user's order). The
    selectors apply to named nodes too: the worker pods carry ``scheduling.nodeSelector``, so a
    named node without those labels could never run its rank."""
    ready = {n["metadata"]["name"]: n for n in nodes if node_ready(n)}

    def matches(name: str) -> bool:
        labels = ready[name]["metadata"].get("labels") or {}
        return all(labels.get(k) == v for sel in selectors if sel for k, v in sel.items())

    if node_names:
        return [n for n in node_names if n in ready and matches(n)]
    return [name for name in sorted(ready) if matches(name)]


def excluded_nodes(
    nodes: list[dict[str, Any]],
    *,
    node_names: list[str] | None,
    selectors: list[dict[str, str] | None],
    limit: int = 5,
) -> str:
    """Why nodes the job names (or, without names, the ready nodes) are not candidates: absent,
    not Ready, or missing a selector's label (``node b lacks disktype=ssd``); '' when none is
    excluded. At most ``limit`` nodes are named, the rest counted."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    wanted = {k: v for sel in selectors if sel for k, v in sel.items()}
    reasons = []
    for name in node_names or sorted(by_name):
        node = by_name.get(name)
        if node is None:
            reasons.append(f"node {name} does not exist")
            continue
        if not node_ready(node):
            if node_names:
                reasons.append(f"node {name} is not Ready")
            continue
        labels = node["metadata"].get("labels") or {}
        bad = [f"{k}={v}" for k, v in wanted.items() if labels.get(k) != v]
        if bad:
            have = ", ".join(f"{k}={labels[k]}" if k in labels else f"no {k}" for k in wanted)
            reasons.append(f"node {name} lacks {', '.join(bad)} (has {have})")
    if not reasons:
        return ""
    more = f", and {len(reasons) - limit} more" if len(reasons) > limit else ""
    return "; ".join(reasons[:limit]) + more


# ---- time -------------------------------------------------------------------------------------
def seconds_left(start: dt.datetime | None, now: dt.datetime, limit: int | None) -> float | None:
    """Seconds until ``start + limit`` (negative once past), None when there is no limit."""
    if start is None or limit is None:
        return None
    return (start + dt.timedelta(seconds=limit) - now).total_seconds()


# ---- progress ---------------------------------------------------------------------------------
PROGRESS_FIELDS = (
    "step",
    "totalSteps",
    "loss",
    "tokensPerSecond",
    "etaSeconds",
    "phase",
    "updatedAt",
)


def progress_status(prog: TrainerProgress) -> dict[str, Any]:
    """The ``status.progress`` block from a TrainerProgress v1 document."""
    doc = prog.model_dump(by_alias=True)
    out = {k: doc[k] for k in PROGRESS_FIELDS if doc.get(k) is not None}
    for k in ("loss", "tokensPerSecond", "etaSeconds"):
        if isinstance(out.get(k), float):
            out[k] = round(out[k], 4)  # printer columns; full precision lives in the ConfigMap
    if prog.checkpoint is not None and prog.checkpoint.step is not None:
        out["checkpointStep"] = prog.checkpoint.step
    return out


def health_findings(prog: TrainerProgress) -> list[dict[str, str]]:
    """Trainer health findings (``health`` of TrainerProgress), Warning severity first."""
    out = [
        {"type": f.type, "severity": f.severity, "message": f.message[:512]} for f in prog.health
    ]
    return sorted(out, key=lambda f: (f["severity"] != "Warning", f["type"]))
