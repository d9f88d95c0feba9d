"""Errors of the planning core.

A bad document or spec raises :class:`DocumentError`, the contracts package's error type (the
operator and the trainer share it), whose message names the document, the field path and the
offending value, e.g. ``TopologyReport gpus[3].pciBusId: '18:00' is not a PCI bus id``.
"""

from __future__ import annotations

from moe_contracts.errors import (DocumentError, check_kind_version, field_path, from_validation_error,
                                  read_json_document)

__all__ = ["DocumentError", "check_kind_version", "field_path", "from_validation_error", "read_json_document"]
