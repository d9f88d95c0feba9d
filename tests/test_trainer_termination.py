"""Why a worker exited, end to end of the contract (docs/contracts.md "TrainerExit"): the trainer
classifies its failure and writes a TrainerExit document to the termination-message file; the
operator's gang logic reads it from the pod and names known causes in the Failed reason."""

from __future__ import annotations

import errno
import json

from moe_trainer.inputs.data import DataError
from moe_trainer.train import EXIT_CONFIG, EXIT_RETRYABLE, classify, write_termination
from moejob_operator import constants as C
from moejob_operator.reconcile import machine


def test_classify_known_causes():
    ck = "/ckpt/job-1234abcd"
    assert classify(OSError(errno.EROFS, "Read-only file system", f"{ck}/step-5"), ck) == (
        "CheckpointNotWritable",
        EXIT_CONFIG,
    )
    assert classify(PermissionError(errno.EACCES, "Permission denied", ck), ck) == (
        "CheckpointNotWritable",
        EXIT_CONFIG,
    )
    assert classify(OSError(errno.ENOSPC, "No space left on device", f"{ck}/x"), ck) == (
        "CheckpointVolumeFull",
        EXIT_RETRYABLE,
    )
    assert classify(OSError(errno.EACCES, "Permission denied", "/data/x"), ck) == (
        "IOError",
        EXIT_RETRYABLE,
    )
    assert classify(DataError("training.data.path: '/data' does not exist"), ck) == (
        "DataNotFound",
        EXIT_CONFIG,
    )
    assert classify(DataError("training.data: token id 9 >= model vocab_size 8"), ck) == (
        "BadData",
        EXIT_CONFIG,
    )
    assert classify(MemoryError(), ck)[0] == "OutOfMemory"
    assert classify(RuntimeError("Connection reset by peer"), ck)[0] == "LostPeer"
    assert classify(KeyError("x"), ck)[0] == "Unexpected"


def test_termination_document_written_only_where_the_kubelet_made_the_file(tmp_path):
    path = tmp_path / "termination-log"
    write_termination("DataNotFound", 78, "x" * 10_000, path=str(path))
    assert not path.exists()
    path.write_text("")
    write_termination("DataNotFound", 78, "x" * 10_000, path=str(path))
    doc = json.loads(path.read_text())
    assert doc["kind"] == "TrainerExit" and doc["cause"] == "DataNotFound" and doc["exitCode"] == 78
    assert len(path.read_bytes()) <= 4096


def pod(rank: int, code: int, *, message: str | None = None, reason: str = "Error") -> dict:
    term = {"exitCode": code, "reason": reason}
    if message is not None:
        term["message"] = message
    return {
        "metadata": {
            "name": f"j-worker-{rank}",
            "uid": f"u{rank}",
            "labels": {C.LABEL_NODE_RANK: str(rank), C.LABEL_ATTEMPT: "0"},
        },
        "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": term}}]},
    }


def exit_doc(cause: str, code: int, msg: str) -> str:
    return json.dumps(
        {"kind": "TrainerExit", "version": 1, "cause": cause, "exitCode": code, "message": msg}
    )


def decide(*pods, failed_restarts=0, backoff_limit=3):
    return machine.decide_gang(
        [machine.PodView.from_pod(p) for p in pods],
        count=len(pods),
        attempt=0,
        failed_restarts=failed_restarts,
        backoff_limit=backoff_limit,
        gang_complete=True,
    )


def test_known_causes_become_the_failed_reason():
    d = decide(
        pod(
            0, 78, message=exit_doc("CheckpointNotWritable", 78, "[Errno 30] Read-only file system")
        ),
        pod(1, 75, message=exit_doc("LostPeer", 75, "gloo")),
    )
    assert d.action == "fail" and d.reason == C.R_CHECKPOINT_NOT_WRITABLE
    assert "Read-only file system" in d.message and "exit code 78" in d.message
    # retryable with a known cause: the restart says why; at the backoff limit the reason names it
    full = exit_doc("CheckpointVolumeFull", 75, "No space left on device")
    d = decide(pod(0, 75, message=exit_doc("LostPeer", 75, "peer")), pod(1, 75, message=full))
    assert (
        d.action == "restart" and "CheckpointVolumeFull" in d.message and "j-worker-1" in d.message
    )
    d = decide(pod(0, 75, message=full), pod(1, 75), failed_restarts=3)
    assert d.action == "fail" and d.reason == C.R_CHECKPOINT_VOLUME_FULL
    d = decide(pod(0, 137, reason="OOMKilled"), pod(1, 75), failed_restarts=3)
    assert d.reason == C.R_OUT_OF_MEMORY and "OOMKilled" in d.message
    # no document (an older trainer, a crash): the reasons stay as they were
    d = decide(pod(0, 78, message="some log tail"), pod(1, 0))
    assert d.reason == C.R_PERMANENT_WORKER_FAILURE
