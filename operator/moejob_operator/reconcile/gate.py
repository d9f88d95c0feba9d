"""The DeepSpeed upgrade gate, as seen by the reconcile loop (issue 7 fills in the smoke test).

Until the gate lands, every job is ``UpgradeVerified=True`` with reason ``GateNotConfigured``;
``spec.gate.skip`` gives ``GateSkipped`` (audited: the reason is in the condition and a Warning
Event). The seam for the real gate is :func:`check`: it returns a :class:`Verdict`; status
``Unknown`` means "not yet" (the job waits, reason ``GatePending``), ``False`` blocks the launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import constants as C
from ..spec import JobSpec


@dataclass(frozen=True)
class Verdict:
    status: str        # "True" | "False" | "Unknown"
    reason: str
    message: str
    retry_seconds: float | None = None


def check(client, job: dict, spec: JobSpec) -> Verdict:   # noqa: ARG001 - seam for issue 7
    if spec.gate.skip:
        return Verdict("True", C.R_GATE_SKIPPED,
                       f"upgrade gate skipped for image {spec.image}: {spec.gate.skip_reason}")
    return Verdict("True", C.R_GATE_NOT_CONFIGURED,
                   f"no smoke-test gate is configured; image {spec.image} launches unverified")
