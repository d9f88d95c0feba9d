"""Errors of the planning core.

A bad document or spec raises :class:`DocumentError`, the contracts package's error type (the
operator and the trainer share it), whose message names the document, the field path and the
offending value, e.g. ``TopologyReport gpus[3].pciBusId: '18:00' is not a PCI bus id``. A bad
input of a core computation (``plan.build_plan``, ``dsconfig``) raises :class:`FieldError`,
which also carries the field, so a caller maps it to its own names without reading the text.
"""

from __future__ import annotations

from moe_contracts.errors import (
    DocumentError,
    check_kind_version,
    field_path,
    from_validation_error,
    read_json_document,
)

__all__ = [
    "DocumentError",
    "DoesNotFit",
    "FieldError",
    "check_kind_version",
    "field_path",
    "from_validation_error",
    "read_json_document",
]


class FieldError(DocumentError):
    """One named input is wrong: ``field`` (``epSize``, ``globalBatch``,
    ``deepspeed.zero_optimization.stage``) and ``detail`` (what is wrong with its value). The
    message reads ``<field>: <detail>``; callers map ``field`` to their own names (the operator:
    to the spec field a person has to change) without reading the text."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


class DoesNotFit(FieldError):
    """The job needs more memory per GPU (per process on CPU) than there is: a refusal of the
    plan as a whole, not of one input (``field`` is ``memory``)."""

    def __init__(self, detail: str) -> None:
        super().__init__("memory", detail)
