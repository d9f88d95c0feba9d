"""The operator-wide settings a reconcile pass uses: the admission policy (host paths, test
hooks) and the upgrade gate's settings.

``moectl operator`` (:mod:`moejob_operator.run`) reads them once, at start-up, from the
operator's environment (the chart sets it), keeps them in the controller's
:class:`~moejob_operator.controller.ControllerConfig` and hands them to every pass; nothing
under ``reconcile/`` reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..admission import Policy
from ..core import gate as G


@dataclass(frozen=True)
class Settings:
    """What the cluster admin set for every job.

    ``gate``: the gate's settings, or the :class:`~moejob_operator.core.gate.GateError` that
    made them invalid (the operator still runs: every job that needs the gate waits with
    ``UpgradeVerified=Unknown, GateMisconfigured`` naming the setting)."""

    policy: Policy = field(default_factory=Policy)
    gate: G.GateConfig | G.GateError = field(default_factory=G.GateConfig)

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, default_namespace: str = "default") -> Settings:
        """``MOE_ALLOWED_HOST_PATH_PREFIXES``, ``MOE_OPERATOR_TEST_MODE``
        (:meth:`Policy.from_env`) and the ``MOE_GATE_*`` settings
        (:meth:`GateConfig.from_env <moejob_operator.core.gate.GateConfig.from_env>`; the
        gate's namespace defaults to ``default_namespace``, the one the operator runs in)."""
        gate: G.GateConfig | G.GateError
        try:
            gate = G.GateConfig.from_env(env, default_namespace=default_namespace)
        except G.GateError as exc:
            gate = exc
        return cls(policy=Policy.from_env(env), gate=gate)
