"""The data-preparation stage: JSONL and Parquet data are tokenized once, by one pod, before
planning, into memory-mapped shards under ``<cache>/prepared-data/<key>`` that every worker
reads (``builders.prepare``, ``moe_trainer.prepare_data``).

:func:`ensure_data` returns :class:`Prepared` (the plan's ``training.data``) or raises
:class:`~.outcome.NotYet` (``DataPreparing``, with progress in ``status.data``; ``DataPrepFailed``
with ``failed`` while a crashed pod is retried) or :class:`~.outcome.Refused` (``InvalidData``:
the pod's report names the file and row, e.g. a missing field, an empty file, an undecodable
row, a chat format without a chat template; ``DataPrepFailed`` after repeated crashes). The pod
finds an earlier run's shards by their key and only checks them (``status.data.reused``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_contracts import env as E
from moe_contracts.data import DataPrepReport, parse_data_report
from moe_contracts.errors import DocumentError

from .. import constants as C
from ..builders import prepare as B
from ..builders.common import JobRef
from ..spec import JobSpec
from .client import Client
from .inspect import Inspected, ensure_children, find_pod, run_pod
from .outcome import NotYet, Refused

FIELD = "spec.data"


@dataclass(frozen=True)
class Prepared:
    data: dict[str, Any]  # the plan's training.data
    message: str  # for the DataPrepared condition


def data_status(r: DataPrepReport) -> dict[str, Any]:
    out = {
        "phase": r.phase,
        "path": r.path,
        "key": r.key,
        "reused": r.reused,
        "files": r.files,
        "filesDone": r.files_done,
        "documents": r.documents,
        "tokens": r.tokens,
        "lossTokens": r.loss_tokens,
        "rows": r.rows,
    }
    return {k: v for k, v in out.items() if v is not None}


def _report(cm: dict[str, Any]) -> DataPrepReport | None:
    raw = (cm.get("data") or {}).get(E.DATA_REPORT_KEY)
    if not raw:
        return None
    try:
        return parse_data_report(raw)
    except DocumentError as exc:
        raise Refused(
            C.R_DATA_PREP_FAILED,
            f"{FIELD}: the data-prepare pod's report is not a DataPrepReport v1 ({exc})",
            FIELD,
        ) from None


def refusal(r: DataPrepReport) -> Refused:
    e = r.error
    where = ""
    if e is not None and e.file:
        where = f"{e.file}" + (f" row {e.row}" if e.row is not None else "") + ": "
    code = f" ({e.code})" if e is not None else ""
    return Refused(
        C.R_INVALID_DATA,
        f"{FIELD}: {where}{e.message if e is not None else 'preparation failed'}{code}",
        FIELD,
    )


def ensure_data(
    client: Client,
    job: JobRef,
    spec: JobSpec,
    status: dict[str, Any],
    model: Inspected | None,
    vocab_size: int,
) -> Prepared | None:
    """The prepared data (None: the spec's data kind needs no preparation)."""
    if not spec.data.prepared:
        return None
    name = B.data_configmap_name(job)
    cm = ensure_children(client, job, spec, name, B.COMPONENT_PREPARE)
    report = _report(cm)
    if report is None or report.phase == "Preparing":
        # the pod reports, then exits: a finished pod's last report may be newer than our read
        pod = find_pod(client, job, B.prepare_pod_name(job), B.COMPONENT_PREPARE)
        if (pod or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"):
            report = (
                _report(client.get_owned_configmap(job.namespace, name, job.uid) or {}) or report
            )
    if report is not None and report.phase == "Failed":
        raise refusal(report)
    if report is not None and report.phase == "Done" and report.path:
        status["data"] = data_status(report)
        how = "reused shards prepared earlier" if report.reused else "prepared"
        msg = (
            f"{how}: {report.documents} documents, {report.tokens} tokens "
            f"({report.loss_tokens} in the loss), {report.rows} rows of "
            f"{spec.training.seq_len + 1} tokens in {report.path}"
        )
        return Prepared({"kind": "prepared", "path": report.path}, msg)
    state = status.setdefault("data", {})
    if report is not None:
        state.update(data_status(report))
    tokenizer = spec.model.path if model is not None and model.report.tokenizer.present else None
    wait = run_pod(
        client,
        job,
        B.prepare_pod(job, spec, tokenizer=tokenizer, vocab_size=vocab_size),
        B.COMPONENT_PREPARE,
        state,
        f"preparing {spec.data.kind} data from {spec.data.path}",
        (C.R_DATA_PREPARING, C.R_DATA_PREP_FAILED),
    )
    if report is not None and not wait.failed:
        wait = NotYet(
            C.R_DATA_PREPARING,
            f"preparing {spec.data.kind} data: {report.files_done}/{report.files} files, "
            f"{report.documents} documents, {report.tokens} tokens so far",
            wait.delay,
        )
    raise wait
