"""The upgrade gate's documents (docs/contracts.md, docs/gate.md).

- ``SmokePlans`` v1: the operator renders the smoke test's cases (each a complete MoEPlan) into
  ConfigMap ``moe-smoke-<key>-<attempt>``; ``moe-smoke`` reads them (:func:`parse_smoke_plans`).
- ``SmokeVerdict`` v3: ``moe-smoke`` writes it (stdout, ``--output``, compacted into the
  termination log); the operator's gate and ``moectl smoke`` read it (:func:`parse_smoke_verdict`).
- ``GateVerdict`` v1: the operator's stored verdict per gate identity, ConfigMap
  ``moe-gate-<key>`` (:func:`parse_gate_verdict`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import Field, model_validator

from ._base import Bool, Doc, Float, Int, Str, read_document, validate
from .errors import DocumentError, check_kind_version
from .plan import PlanError, parse_plan

SMOKE_PLANS_KIND, SMOKE_PLANS_VERSION = "SmokePlans", 1
SMOKE_KIND, SMOKE_VERSION = "SmokeVerdict", 3
VERDICT_KIND, VERDICT_VERSION = "GateVerdict", 1

# Check kinds, in the order a passing run reports them: `imports`, per case the phase-1 checks,
# per case `resume`, `fused_adam` (docs/gate.md describes each).
CASE_CHECKS = (
    "capabilities",
    "initialize",
    "partition",
    "permutation",
    "numerics",
    "dispatch",
    "checkpoint",
)
CHECKS = ("imports", *CASE_CHECKS, "resume", "fused_adam")


def expected_checks(cases: list[str]) -> list[tuple[str, str | None]]:
    """(check, case) of a passing SmokeVerdict v3 over ``cases``, in order."""
    out: list[tuple[str, str | None]] = [("imports", None)]
    out += [(c, n) for n in cases for c in CASE_CHECKS]
    out += [("resume", n) for n in cases]
    return [*out, ("fused_adam", None)]


# ---- SmokePlans v1 ------------------------------------------------------------------------------
class SmokeCase(Doc):
    name: Str = Field(min_length=1)
    plan: dict[str, Any]


class SmokePlans(Doc):
    kind: Literal["SmokePlans"] = "SmokePlans"
    version: Literal[1] = 1
    device: Literal["cpu", "cuda"] = "cpu"
    cases: tuple[SmokeCase, ...] = Field(min_length=1)


def parse_smoke_plans(doc: Any) -> SmokePlans:
    """Check a SmokePlans v1 document: every case a MoEPlan the trainer's reader accepts, all of
    one world size (one run). Raises DocumentError."""
    check_kind_version(SMOKE_PLANS_KIND, doc, (SMOKE_PLANS_VERSION,))
    plans = validate(SMOKE_PLANS_KIND, SmokePlans, doc)
    worlds = set()
    for i, case in enumerate(plans.cases):
        try:
            worlds.add(parse_plan(case.plan).world_size)
        except PlanError as exc:
            raise DocumentError(
                f"{SMOKE_PLANS_KIND} cases[{i}] ({case.name}).plan: {exc}"
            ) from None
    if len(worlds) != 1:
        raise DocumentError(
            f"{SMOKE_PLANS_KIND} cases: world sizes {sorted(worlds)}; one run needs one"
        )
    return plans


# ---- SmokeVerdict v3 ----------------------------------------------------------------------------
class SmokeCheck(Doc):
    name: Str
    case: Str | None = None
    passed: Bool
    seconds: Float
    message: Str


class SmokeVerdict(Doc):
    kind: Literal["SmokeVerdict"] = "SmokeVerdict"
    version: Literal[3] = 3
    passed: Bool
    failed_check: Str | None  # required, null when passed
    failed_case: Str | None = None
    cases: list[Any]
    checks: tuple[SmokeCheck, ...]
    exception: Str | None  # required, null when passed
    versions: dict[str, Any]
    duration_seconds: Float
    # per case: {"loss": [..], "gradNorm": [..], "update": {group: [..]}} per compared step
    golden: dict[str, Any] | None = None
    golden_drift: dict[str, Any] | None = None  # vs --golden: {"against": .., "cases": {..}}

    @model_validator(mode="after")
    def _consistent(self) -> SmokeVerdict:
        if self.passed and self.failed_check is not None:
            raise ValueError(f"failedCheck: {self.failed_check!r} given but passed is true")
        if not self.passed and self.failed_check is None:
            raise ValueError("failedCheck: required when passed is false")
        if self.passed and not all(c.passed for c in self.checks):
            raise ValueError("passed: true but a check failed")
        return self


def parse_smoke_verdict(text: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """Check a SmokeVerdict v3 (JSON text or decoded); returns it. Raises DocumentError."""
    return read_document(SMOKE_KIND, (SMOKE_VERSION,), SmokeVerdict, text)[0]


# ---- GateVerdict v1 -----------------------------------------------------------------------------
def parse_time(text: str) -> dt.datetime:
    """RFC 3339 (``2026-11-29T14:00:00Z``) -> an aware datetime; ValueError when it is not one."""
    return dt.datetime.fromisoformat(text)


class GateVerdict(Doc):
    kind: Literal["GateVerdict"] = "GateVerdict"
    version: Literal[1] = 1
    identity: dict[str, Any]
    attempt: Int
    passed: Bool
    verified_at: Str
    expires_at: Str

    @model_validator(mode="after")
    def _times(self) -> GateVerdict:
        for key, raw in (("verifiedAt", self.verified_at), ("expiresAt", self.expires_at)):
            try:
                parse_time(raw)
            except ValueError:
                raise ValueError(f"{key}: {raw!r} is not an RFC 3339 time") from None
        return self


def parse_gate_verdict(text: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """Check a GateVerdict v1 read back from the store; returns it. Raises DocumentError."""
    return read_document(VERDICT_KIND, (VERDICT_VERSION,), GateVerdict, text)[0]


# ---- SmokeGolden v1 ----------------------------------------------------------------------------
GOLDEN_KIND, GOLDEN_VERSION = "SmokeGolden", 1


class SmokeGolden(Doc):
    kind: Literal["SmokeGolden"] = "SmokeGolden"
    version: Literal[1] = 1
    golden_key: Str  # what the values are comparable over: the smoke plans and the hardware
    against: dict[str, Any]  # the image that produced them: image, digest, verifiedAt, versions
    cases: dict[str, dict[str, Any]]


def parse_smoke_golden(text: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """Check a SmokeGolden v1 (the golden values of the last image that passed the same smoke
    plans on the same hardware: the operator keeps them in the verdict ConfigMap and hands them
    to the next smoke run). Raises DocumentError."""
    return read_document(GOLDEN_KIND, (GOLDEN_VERSION,), SmokeGolden, text)[0]


def _series_drift(now: list[Any], before: list[Any]) -> float:
    worst = 0.0
    for a, b in zip(now, before, strict=False):
        if not (isinstance(a, int | float) and isinstance(b, int | float)):
            continue
        if a != a or b != b:  # NaN
            return float("inf")
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst


def golden_drift(now: dict[str, Any] | None, before: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per case of ``before`` (a SmokeGolden's ``cases``) also in ``now`` (a SmokeVerdict's
    ``golden``): the largest relative change over the compared steps of the loss, the gradient
    norm and any group's update norm."""
    out: dict[str, dict[str, float]] = {}
    for case, prev in before.items():
        cur = (now or {}).get(case)
        if not cur:
            continue
        updates = [
            _series_drift(cur.get("update", {}).get(g, []), series)
            for g, series in prev.get("update", {}).items()
        ]
        out[case] = {
            "loss": round(_series_drift(cur.get("loss", []), prev.get("loss", [])), 6),
            "gradNorm": round(_series_drift(cur.get("gradNorm", []), prev.get("gradNorm", [])), 6),
            "update": round(max(updates, default=0.0), 6),
        }
    return out
