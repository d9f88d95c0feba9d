"""``TrainerExit`` v1 (docs/contracts.md): why a trainer rank failed (termination message).

A failing rank writes it to its own termination file (``$MOE_TERMINATION_LOG``); the pod's node
launcher passes the first failing rank's document on as the pod's one message; the operator reads
it from the worker pod's ``state.terminated.message`` (:func:`parse_trainer_exit`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ._base import Doc, Int, Str, read_document

EXIT_KIND, EXIT_VERSION = "TrainerExit", 1
TERMINATION_LIMIT = 4096  # bytes the kubelet keeps of a termination message
# cause -> exit code (docs/contracts.md table); `Signalled` is 128 + N
CAUSES = {
    "CheckpointNotWritable": 78,
    "CheckpointVolumeFull": 75,
    "DataNotFound": 78,
    "BadData": 78,
    "OutOfMemory": 75,
    "BadConfig": 78,
    "NonFiniteLoss": 65,
    "RendezvousFailed": 75,
    "LostPeer": 75,
    "IOError": 75,
    "Unexpected": 1,
    "Signalled": None,
}


class TrainerExit(Doc):
    kind: Literal["TrainerExit"] = "TrainerExit"
    version: Literal[1] = 1
    cause: Str = Field(min_length=1)
    exit_code: Int | None = None
    rank: Int | None = None
    node_rank: Int | None = None
    message: Str = ""


def exit_doc(cause: str, code: int, message: str, *, rank: int | None = None) -> dict[str, Any]:
    """The document a rank (or the launcher, ``rank`` None) writes."""
    doc: dict[str, Any] = {
        "kind": EXIT_KIND,
        "version": EXIT_VERSION,
        "cause": cause,
        "exitCode": code,
    }
    if rank is not None:
        doc["rank"] = rank
    doc["message"] = message
    return doc


def parse_trainer_exit(text: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """A TrainerExit v1 (JSON text or decoded); returns the document, raises DocumentError."""
    return read_document(EXIT_KIND, (EXIT_VERSION,), TrainerExit, text)[0]
