"""The upgrade gate's operator-wide settings (Helm values -> env of the operator pod), pure."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_contracts.errors import DocumentError

DEFAULT_PASS_TTL_SECONDS = 7 * 24 * 3600
DEFAULT_FAIL_TTL_SECONDS = 3600
DEFAULT_SMOKE_DEADLINE_SECONDS = 1800  # the smoke Job's activeDeadlineSeconds (pull + JIT + run)
_TRUE = ("1", "true", "yes", "on", "enabled")
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")  # a DNS subdomain


class GateError(DocumentError):
    """A gate setting is invalid (the documents' errors are ``moe_contracts``' DocumentError)."""


@dataclass(frozen=True)
class GateConfig:
    """Operator-wide gate settings (Helm values -> env of the operator pod)."""

    enabled: bool = True
    namespace: str = "default"  # where verdicts and smoke Jobs live
    pass_ttl_seconds: int = DEFAULT_PASS_TTL_SECONDS
    fail_ttl_seconds: int = DEFAULT_FAIL_TTL_SECONDS
    deadline_seconds: int = DEFAULT_SMOKE_DEADLINE_SECONDS
    command: tuple[str, ...] | None = None  # replaces `moe-smoke` (dev clusters, tests)
    extra_args: tuple[str, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    image_pull_secrets: tuple[str, ...] = ()  # Secrets in ``namespace`` the smoke pods pull with

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, default_namespace: str = "default") -> GateConfig:
        """MOE_GATE_ENABLED, MOE_GATE_NAMESPACE (else MOE_OPERATOR_NAMESPACE, else
        POD_NAMESPACE), MOE_GATE_PASS_TTL_SECONDS, MOE_GATE_FAIL_TTL_SECONDS,
        MOE_GATE_DEADLINE_SECONDS, MOE_GATE_SMOKE_COMMAND (JSON list), MOE_GATE_SMOKE_EXTRA_ARGS
        (JSON list), MOE_GATE_NODE_SELECTOR (JSON object), MOE_GATE_IMAGE_PULL_SECRETS (JSON list
        of Secret names in the gate's namespace)."""

        def seconds(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            if not raw.isdigit() or int(raw) < 1:
                raise GateError(f"{name}: {raw!r} is not a positive number of seconds")
            return int(raw)

        def json_env(name: str, typ: type[list[Any]] | type[dict[str, Any]]) -> Any:
            raw = env.get(name)
            if not raw:
                return None
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise GateError(f"{name}: {raw!r} is not JSON ({exc.msg})") from None
            ok = isinstance(value, typ) and all(
                isinstance(x, str) for x in (value.values() if isinstance(value, dict) else value)
            )
            if not ok:
                raise GateError(
                    f"{name}: {raw!r} is not a JSON {'object' if typ is dict else 'list'} of "
                    "strings"
                )
            return value

        command = json_env("MOE_GATE_SMOKE_COMMAND", list)
        if command is not None and not command:
            raise GateError("MOE_GATE_SMOKE_COMMAND: an empty command")
        pull_secrets = tuple(json_env("MOE_GATE_IMAGE_PULL_SECRETS", list) or ())
        for name in pull_secrets:
            if not _SECRET_NAME.fullmatch(name) or len(name) > 253:
                raise GateError(f"MOE_GATE_IMAGE_PULL_SECRETS: {name!r} is not a Secret name")
        return cls(
            enabled=env.get("MOE_GATE_ENABLED", "true").strip().lower() in _TRUE,
            namespace=env.get("MOE_GATE_NAMESPACE")
            or env.get("MOE_OPERATOR_NAMESPACE")
            or env.get("POD_NAMESPACE")
            or default_namespace,
            pass_ttl_seconds=seconds("MOE_GATE_PASS_TTL_SECONDS", DEFAULT_PASS_TTL_SECONDS),
            fail_ttl_seconds=seconds("MOE_GATE_FAIL_TTL_SECONDS", DEFAULT_FAIL_TTL_SECONDS),
            deadline_seconds=seconds("MOE_GATE_DEADLINE_SECONDS", DEFAULT_SMOKE_DEADLINE_SECONDS),
            command=tuple(command) if command else None,
            extra_args=tuple(json_env("MOE_GATE_SMOKE_EXTRA_ARGS", list) or ()),
            node_selector=dict(json_env("MOE_GATE_NODE_SELECTOR", dict) or {}),
            image_pull_secrets=pull_secrets,
        )
