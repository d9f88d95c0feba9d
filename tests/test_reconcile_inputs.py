"""The pass's glue for the job's own inputs (reconcile/inputs.py): the trainer's export report
becomes status.output with one Event per new export; the phases of the new stages."""

from __future__ import annotations

from moe_contracts.progress import parse_progress
from moejob_operator import constants as C
from moejob_operator.reconcile import inputs
from moejob_operator.status import phase_of


class FakePass:
    def __init__(self):
        self.status: dict = {}
        self.events: list[tuple[str, str, str]] = []

    def event(self, etype, reason, message):
        self.events.append((etype, reason, message))


def _progress(output=None):
    doc = {"kind": "TrainerProgress", "version": 1, "phase": "Training", "step": 4, "totalSteps": 8}
    if output is not None:
        doc["output"] = output
    return parse_progress(doc)


def test_export_report_becomes_status_output_with_one_event_per_export():
    p = FakePass()
    inputs.exported(p, _progress())
    assert "output" not in p.status and p.events == []
    first = {"path": "/output", "bytes": 1234, "sha256": "ab" * 32, "step": 4}
    inputs.exported(p, _progress(first))
    assert p.status["output"] == first
    want = f"exported the model at step 4 to /output (1234 bytes, sha256 {'ab' * 8})"
    assert p.events == [("Normal", C.R_MODEL_EXPORTED, want)]
    inputs.exported(p, _progress(first))  # the same export again: no second Event
    assert len(p.events) == 1
    second = {**first, "sha256": "cd" * 32, "step": 8}
    inputs.exported(p, _progress(second))
    assert p.status["output"]["step"] == 8 and len(p.events) == 2


def test_phases_of_the_new_stages():
    def cond(t, s):
        return {"type": t, "status": s}

    accepted = cond(C.COND_SPEC_ACCEPTED, "True")
    inspected = cond(C.COND_MODEL_INSPECTED, "True")
    assert phase_of([accepted, cond(C.COND_MODEL_INSPECTED, "Unknown")]) == "Inspecting"
    assert phase_of([accepted, inspected, cond(C.COND_DATA_PREPARED, "Unknown")]) == (
        "PreparingData"
    )
    assert phase_of([accepted, cond(C.COND_DATA_PREPARED, "True")]) == "Discovering"
