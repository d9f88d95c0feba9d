"""``TrainerProgress`` v1 (docs/contracts.md): rank 0 of the trainer reports, the operator reads.

The trainer builds it with :func:`progress_doc` and writes it to ``progress.json`` in the
checkpoint dir and into ConfigMap ``<job>-progress``; the operator reads it with
:func:`parse_progress` into ``status.progress`` and the Healthy condition.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Literal

from pydantic import Field

from ._base import Doc, Float, Int, Str, read_document

PROGRESS_KIND, PROGRESS_VERSION = "TrainerProgress", 1
PHASES = ("Starting", "Training", "Checkpointing", "Finished", "Failed")
HEALTH_TYPES = (
    "NonFiniteLoss",
    "RouterLogitsOutOfRange",
    "DeadExpert",
    "Straggler",
    "Fragmentation",
)


class Checkpoint(Doc):
    step: Int | None = None
    path: Str | None = None


class Health(Doc):
    type: Str = Field(min_length=1)
    severity: Str = "Warning"
    message: Str = ""


class Export(Doc):
    """The trainer's latest export of the model (``spec.output``): a Hugging Face directory."""

    path: Str = Field(min_length=1)
    bytes: Int = Field(ge=0)
    sha256: Str = Field(min_length=1)
    step: Int | None = Field(default=None, ge=0)


class PlacementStatus(Doc):
    """The placement the trainer runs (re-placement during a job,
    ``moe_contracts.placement_update``): ``generation`` 0 is the plan's own permutation;
    ``applied_at_step`` the step a later generation was applied at (None for generation 0);
    ``message`` says why an update was not applied (refused, unreadable), else empty."""

    generation: Int = Field(ge=0)
    applied_at_step: Int | None = Field(default=None, ge=0)
    seconds: Float | None = Field(default=None, ge=0)  # how long the last switch took
    message: Str = ""


class TrainerProgress(Doc):
    kind: Literal["TrainerProgress"] = "TrainerProgress"
    version: Literal[1] = 1
    phase: Literal["Starting", "Training", "Checkpointing", "Finished", "Failed"]
    step: Int = Field(ge=0)
    total_steps: Int = Field(ge=0)
    loss: Float | None = None
    tokens_per_second: Float | None = None
    eta_seconds: Float | None = None
    updated_at: Str | None = None
    checkpoint: Checkpoint | None = None
    moe: dict[str, Any] | None = None
    health: tuple[Health, ...] = ()
    routing_stats: dict[str, Any] | None = None  # the last RoutingStats publish attempt
    output: Export | None = None  # the latest export (spec.output), once there is one
    placement: PlacementStatus | None = None  # the running placement generation (optional)


def parse_progress(text: str | bytes | dict[str, Any]) -> TrainerProgress:
    """A TrainerProgress v1 (JSON text or decoded); raises DocumentError naming the field."""
    return read_document(PROGRESS_KIND, (PROGRESS_VERSION,), TrainerProgress, text)[1]


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def progress_doc(
    *,
    phase: str,
    step: int,
    total_steps: int,
    loss: float | None,
    tokens_per_second: float,
    eta_seconds: float | None,
    checkpoint: dict[str, Any] | None,
    moe: dict[str, Any],
    health: list[dict[str, Any]],
) -> dict[str, Any]:
    """The document the trainer writes; a non-finite loss or ETA becomes null (JSON has no NaN)."""
    if phase not in PHASES:
        raise ValueError(f"phase: {phase!r} is not one of {PHASES}")
    return {
        "kind": PROGRESS_KIND,
        "version": PROGRESS_VERSION,
        "phase": phase,
        "step": int(step),
        "totalSteps": int(total_steps),
        "loss": _finite(loss),
        "tokensPerSecond": float(tokens_per_second),
        "etaSeconds": _finite(eta_seconds),
        "updatedAt": now_iso(),
        "checkpoint": checkpoint,
        "moe": moe,
        "health": health,
    }
