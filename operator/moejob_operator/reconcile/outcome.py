"""What a reconcile stage says when it cannot hand on a result: two exception types, in the
style of kopf's ``TemporaryError`` / ``PermanentError``.

- :class:`NotYet` (temporary): a precondition is missing but may appear (nodes, topology
  reports, routing statistics of an earlier job, a smoke-test verdict). ``delay``: the seconds
  after which the pass wants to run again. ``failed``: an attempt failed and is being retried
  (the stage's condition reads ``False`` rather than ``Unknown``).
- :class:`Refused` (permanent): the job cannot run as specified. ``reason`` is the condition
  reason (``InvalidSpec``, ``InsufficientMemory``, ``PlanFailed``, ...); ``field`` is the spec
  field a person has to change (``spec.placement.expertParallelSize``), None when no single
  field is to blame.

A stage returns its result (a spec, topology reports, a plan, a gate verdict) or raises one of
these; the reconcile pass (:func:`moejob_operator.reconcile.job.reconcile`) reads them in one
place and turns them into conditions, Events, the job's failure and the requeue delay.
"""

from __future__ import annotations

from .. import constants as C
from ..core.errors import FieldError


class StageOutcome(Exception):
    """A stage that stopped the pass: ``reason`` (a condition reason) and a message for people."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class NotYet(StageOutcome):
    """Temporary: run the pass again after ``delay`` seconds."""

    def __init__(self, reason: str, message: str, delay: float, *, failed: bool = False) -> None:
        super().__init__(reason, message)
        self.delay = float(delay)
        self.failed = failed

    def __repr__(self) -> str:
        return f"NotYet({self.reason!r}, {self.message!r}, delay={self.delay})"


class Refused(StageOutcome):
    """Permanent: the job cannot run as specified; ``field`` names what to change (or None)."""

    def __init__(self, reason: str, message: str, field: str | None = None) -> None:
        super().__init__(reason, message)
        self.field = field

    @classmethod
    def invalid_spec(cls, exc: FieldError) -> Refused:
        """``InvalidSpec`` from a spec error (``spec.SpecError``: its ``field``, its message)."""
        return cls(C.R_INVALID_SPEC, str(exc), exc.field)

    def __repr__(self) -> str:
        return f"Refused({self.reason!r}, {self.message!r}, field={self.field!r})"
