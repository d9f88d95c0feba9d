"""The job's own inputs as the pass sees them: the model directory (inspection before planning,
a re-check before the first launch), the prepared data, and the model the trainer exported.

Thin glue between the reconcile pass (``job.py``: which stage reports the outcome) and the
stages (:mod:`.inspect`, :mod:`.dataprep`): conditions and ``status`` here, pods and documents
there.
"""

from __future__ import annotations

from typing import Any

from moe_contracts.plan import MoEPlan
from moe_contracts.progress import TrainerProgress

from .. import constants as C
from ..spec import JobSpec
from ..status import TRUE
from . import dataprep, inspect, planning


def inspected(p: Any, spec: JobSpec) -> inspect.Inspected | None:
    """The inspection stage (raises NotYet / Refused); ModelInspected=True once accepted."""
    found = inspect.ensure_model(p.client, p.job, spec, p.status)
    if found is not None:
        p.cond(C.COND_MODEL_INSPECTED, TRUE, C.R_MODEL_INSPECTED, found.message)
    return found


def prepared(p: Any, spec: JobSpec, model: inspect.Inspected | None) -> planning.Inputs:
    """The data-preparation stage (raises NotYet / Refused), then what the planner needs."""
    resolved = model.model if model is not None else planning.resolve_model(spec)
    vocab = resolved.spec.vocab_size if resolved is not None else 0
    data = dataprep.ensure_data(p.client, p.job, spec, p.status, model, vocab)
    if data is not None:
        p.cond(C.COND_DATA_PREPARED, TRUE, C.R_DATA_PREPARED, data.message)
    has_tokenizer = model is not None and model.report.tokenizer.present
    return planning.Inputs(
        model=model.model if model is not None else None,
        content_hash=model.report.content_hash if model is not None else None,
        tokenizer=spec.model.path if has_tokenizer else None,
        data=data.data if data is not None else None,
    )


def recheck(p: Any, spec: JobSpec, plan: MoEPlan) -> None:
    """Right before the first launch: the model directory still is the one planned for."""
    msg = inspect.recheck(p.client, p.job, spec, plan, p.status)
    if msg is not None:
        p.cond(C.COND_MODEL_INSPECTED, TRUE, C.R_MODEL_INSPECTED, msg)


def exported(p: Any, doc: TrainerProgress) -> None:
    """The trainer's latest export (TrainerProgress ``output``) -> ``status.output`` and an
    Event when a new one appears."""
    out = doc.output
    if out is None:
        return
    new = {"path": out.path, "bytes": out.bytes, "sha256": out.sha256}
    if out.step is not None:
        new["step"] = out.step
    old = p.status.get("output") or {}
    if (old.get("path"), old.get("sha256")) != (new["path"], new["sha256"]):
        at = f" at step {out.step}" if out.step is not None else ""
        p.event(
            "Normal",
            C.R_MODEL_EXPORTED,
            f"exported the model{at} to {out.path} ({out.bytes} bytes, sha256 {out.sha256[:16]})",
        )
    p.status["output"] = new
