"""The DeepSpeed upgrade gate, pure: what is verified, the verdicts, when they expire, what to do.

A job may launch only on an *identity* that passed the smoke test (`moe-smoke`, docs/gate.md) on
this cluster. The rooms:

- :mod:`.config`    the operator-wide settings (``GateConfig``, ``GateError``)
- :mod:`.identity`  what a verdict vouches for (``Identity``), its key and the derived names
- :mod:`.decision`  the smoke Job as observed, the verdict to store, what to do (``decide``)
- :mod:`.messages`  condition reasons and messages
- :mod:`.digests`   which build of a tag-only image the gang runs (digest pinning, re-pushed
                    tags, mixed digests on the nodes, revocation)
- :mod:`.golden`    the golden values kept per smoke plans and hardware

The documents (SmokeVerdict, SmokeGolden, GateVerdict) are read by :mod:`moe_contracts.gate`.
Everything here works on plain dicts and dataclasses; :mod:`moejob_operator.reconcile.gate`
does the API calls. This package namespace re-exports the names its users need.
"""

from .config import (
    DEFAULT_FAIL_TTL_SECONDS,
    DEFAULT_PASS_TTL_SECONDS,
    DEFAULT_SMOKE_DEADLINE_SECONDS,
    GateConfig,
    GateError,
)
from .decision import (
    WAIT_SECONDS,
    Decision,
    SmokeObservation,
    decide,
    is_current,
    observe,
    verdict_from_observation,
)
from .identity import (
    LABEL_GATE_KEY,
    SMOKE_JOB_PREFIX,
    STORE_PREFIX,
    VERDICT_KEY,
    Identity,
    digest_of,
    identity_for,
    pinned,
    repository_of,
    smoke_job_name,
    store_name,
)
from .messages import (
    R_CACHED_VERDICT,
    R_IMAGE_DIGEST_CHANGED,
    R_IMAGE_DIGESTS_DIFFER,
    R_SMOKE_TEST_FAILED,
    R_SMOKE_TEST_PASSED,
    R_SMOKE_TEST_RUNNING,
    failure_text,
    skip_audit,
    skip_message,
)

__all__ = [
    "DEFAULT_FAIL_TTL_SECONDS",
    "DEFAULT_PASS_TTL_SECONDS",
    "DEFAULT_SMOKE_DEADLINE_SECONDS",
    "LABEL_GATE_KEY",
    "R_CACHED_VERDICT",
    "R_IMAGE_DIGESTS_DIFFER",
    "R_IMAGE_DIGEST_CHANGED",
    "R_SMOKE_TEST_FAILED",
    "R_SMOKE_TEST_PASSED",
    "R_SMOKE_TEST_RUNNING",
    "SMOKE_JOB_PREFIX",
    "STORE_PREFIX",
    "VERDICT_KEY",
    "WAIT_SECONDS",
    "Decision",
    "GateConfig",
    "GateError",
    "Identity",
    "SmokeObservation",
    "decide",
    "digest_of",
    "failure_text",
    "identity_for",
    "is_current",
    "observe",
    "pinned",
    "repository_of",
    "skip_audit",
    "skip_message",
    "smoke_job_name",
    "store_name",
    "verdict_from_observation",
]
