"""The one error type for a bad document, and the helpers every contract reader uses.

A message always names the document, the field path and the offending value, e.g.
``TopologyReport gpus[3].pciBusId: '18:00' is not a PCI bus id``, so a person can fix the input
without reading a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError


class DocumentError(ValueError):
    """A document (TopologyReport, RoutingStats, MoEPlan, ...) is missing or invalid."""


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """``('gpus', 3, 'pciBusId')`` -> ``'gpus[3].pciBusId'``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_validation_error(document: str, exc: ValidationError) -> DocumentError:
    """Turn a pydantic ValidationError into a DocumentError naming the first bad field.

    Validators raise ``ValueError("'<value>' is not ...")`` (field level) or
    ``ValueError("<path>: '<value>' ...")`` (model level); both read naturally here.
    """
    lines = []
    for err in exc.errors(include_url=False):
        path = field_path(err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "value_error":
            msg = msg.removeprefix("Value error, ")
            lines.append(f"{document} {path}: {msg}" if path else f"{document} {msg}")
        elif err.get("type") == "missing":
            lines.append(f"{document} {path}: required field is missing")
        else:
            lines.append(f"{document} {path}: {short(err.get('input'))} is invalid ({msg})")
    return DocumentError("; ".join(lines) if lines else f"{document}: invalid document")


def check_kind_version(document: str, obj: Any, versions: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """Refuse anything that is not a mapping with the expected ``kind`` and a known ``version``."""
    if not isinstance(obj, dict):
        raise DocumentError(f"{document}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("kind") != document:
        raise DocumentError(f"{document} kind: {short(obj.get('kind'))} is not {document!r}")
    version = obj.get("version")
    if isinstance(version, bool) or version not in versions:
        raise DocumentError(
            f"{document} version: {short(version)} is not a known version {list(versions)}"
        )
    return obj


# A document another party writes (the trainer's progress, routing statistics, exit message) is
# read under limits: no larger than a ConfigMap can hold, and nesting deep enough to exhaust the
# parser's recursion is a DocumentError like any other malformed input, not a crash.
MAX_DOCUMENT_BYTES = 1 << 20


def loads_document(document: str, text: str | bytes) -> Any:
    """``json.loads`` that raises DocumentError naming the document (also for one over
    :data:`MAX_DOCUMENT_BYTES` or nested too deep to parse)."""
    if isinstance(text, str | bytes) and len(text) > MAX_DOCUMENT_BYTES:
        raise DocumentError(
            f"{document}: {len(text)} bytes, larger than the {MAX_DOCUMENT_BYTES} a reader accepts"
        )
    try:
        return json.loads(text)
    except RecursionError:
        raise DocumentError(f"{document}: nested too deeply") from None
    except (ValueError, TypeError) as exc:
        raise DocumentError(f"{document}: not JSON ({str(exc)[:80]})") from None


def read_json_document(
    document: str, path: str | Path, *, what: str = "file", hint: str = ""
) -> Any:
    """The decoded JSON of ``path``; a missing file or bad JSON raises ``DocumentError`` naming
    the document (``MoEPlan: no such file 'x.json'``)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DocumentError(f"{document}: no such {what} {str(path)!r}{hint}") from None
    except OSError as exc:
        raise DocumentError(f"{document}: {what} {str(path)!r} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise DocumentError(f"{document} {path}: not JSON ({exc})") from None
