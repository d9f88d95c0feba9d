"""Pure helpers for the MoETrainingJob status: metav1-style conditions and the derived phase.

Conditions follow the Kubernetes API conventions: ``type``, ``status`` ("True" / "False" /
"Unknown"), a CamelCase ``reason``, a human ``message``, ``observedGeneration`` and
``lastTransitionTime``, which changes only when ``status`` flips (a new reason or message alone
keeps the old time). Everything here works on plain dicts so the reconciler can diff and patch.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from . import constants as C

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


def now_iso(now: dt.datetime | None = None) -> str:
    now = now or dt.datetime.now(dt.UTC)
    return now.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text)


def get_condition(conditions: list[dict[str, Any]] | None, ctype: str) -> dict[str, Any] | None:
    for cond in conditions or ():
        if cond.get("type") == ctype:
            return cond
    return None


def is_true(conditions: list[dict[str, Any]] | None, ctype: str) -> bool:
    cond = get_condition(conditions, ctype)
    return cond is not None and cond.get("status") == TRUE


@dataclass(frozen=True)
class Transition:
    """A condition whose status flipped (or appeared): what an Event reports."""

    type: str
    status: str
    reason: str
    message: str
    previous: str | None


def set_condition(
    conditions: list[dict[str, Any]] | None,
    ctype: str,
    status: str,
    reason: str,
    message: str,
    *,
    generation: int,
    now: str,
    field: str | None = None,
) -> tuple[list[dict[str, Any]], Transition | None]:
    """Return a new condition list with ``ctype`` set, and the transition if the status flipped
    or the reason changed (both worth an Event). Order of the list is kept; new types go last.
    ``field``: the spec field a person has to change (a refusal's), kept on the condition.
    """
    if status not in (TRUE, FALSE, UNKNOWN):
        raise ValueError(f"condition status {status!r} is not True/False/Unknown")
    out: list[dict[str, Any]] = []
    found = None
    for cond in conditions or ():
        if cond.get("type") == ctype:
            found = cond
        else:
            out.append(dict(cond))
    new = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": now
        if found is None or found.get("status") != status
        else found.get("lastTransitionTime", now),
    }
    if field:
        new["field"] = field
    if found is None:
        out.append(new)
    else:
        out.insert([c.get("type") for c in conditions or ()].index(ctype), new)
    transition = None
    if found is None or found.get("status") != status or found.get("reason") != reason:
        transition = Transition(
            ctype, status, reason, message, None if found is None else found.get("status")
        )
    return out, transition


def phase_of(conditions: list[dict[str, Any]] | None) -> str:
    """One word for ``kubectl get``: derived from the conditions, never stored on its own."""

    def cond(t: str) -> dict[str, Any]:
        return get_condition(conditions, t) or {}

    if cond(C.COND_FAILED).get("status") == TRUE:
        return "Failed"
    if cond(C.COND_SUCCEEDED).get("status") == TRUE:
        return "Succeeded"
    if cond(C.COND_SUSPENDED).get("status") == TRUE:
        return "Suspended"
    running = cond(C.COND_RUNNING)
    if running.get("status") == TRUE:
        return "Running"
    if running.get("reason") == C.R_RESTARTING:
        return "Restarting"
    if not conditions:
        return "Pending"
    for ctype, phase in (
        (C.COND_MODEL_INSPECTED, "Inspecting"),
        (C.COND_DATA_PREPARED, "PreparingData"),
    ):
        if cond(ctype) and cond(ctype).get("status") != TRUE:
            return phase
    if cond(C.COND_TOPOLOGY).get("status") != TRUE:
        return "Discovering"
    if cond(C.COND_PLANNED).get("status") != TRUE:
        return "Planning"
    if cond(C.COND_UPGRADE_VERIFIED).get("status") != TRUE:
        return "Gating"
    return "Launching"


def event_type_for(t: Transition) -> str:
    """Kubernetes Event type: Warning for things a person should look at."""
    bad = (
        (t.type == C.COND_FAILED and t.status == TRUE)
        or (t.type == C.COND_HEALTHY and t.status == FALSE)
        or (
            t.type
            in (
                C.COND_SPEC_ACCEPTED,
                C.COND_PLANNED,
                C.COND_TOPOLOGY,
                C.COND_RECONCILED,
                C.COND_MODEL_INSPECTED,
                C.COND_DATA_PREPARED,
                C.COND_UPGRADE_VERIFIED,  # SmokeTestFailed, ImageDigestsDiffer, ...
            )
            and t.status == FALSE
        )
        or (t.type == C.COND_UPGRADE_VERIFIED and t.reason == C.R_GATE_SKIPPED)
        or (t.type == C.COND_RUNNING and t.reason == C.R_RESTARTING)
    )
    return "Warning" if bad else "Normal"
