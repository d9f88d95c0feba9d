"""`moe-train`: the trainer entry point every worker pod runs.

In a worker pod (``NPROC_PER_NODE`` set, ``RANK`` not) it is the node launcher
(``moe_trainer.launch.node_main``), which starts one rank per planned GPU of the node, each
``python -m moe_trainer.train`` with ``RANK`` set; with ``RANK`` set (or no launcher env: a single
local process) it is one rank.

Exit codes (docs/contracts.md): 0 finished; 75 retryable (lost peer, rendezvous timeout, I/O);
78 bad plan/config/model, read-only checkpoint volume; 65 non-finite loss; anything else is
unexpected (treated as retryable). A failing worker also writes a TrainerExit document (the cause
in one word and the error) to ``/dev/termination-log``, which the operator reads from the pod's
``state.terminated.message``.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence

from moe_contracts import env as E
from moe_contracts.exit import TERMINATION_LIMIT, exit_doc
from moe_contracts.plan import PlanError, load_plan, resolve_plan_path

log = logging.getLogger("moe_trainer")

EXIT_OK, EXIT_DATAERR, EXIT_RETRYABLE, EXIT_CONFIG, EXIT_UNEXPECTED = 0, 65, 75, 78, 1


# Communication failures surface as plain RuntimeErrors from gloo (and sometimes NCCL): a lost
# peer is retryable, the gang restarts from the latest checkpoint.
COMM_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "gloo",
    "NCCL",
    "ProcessGroup",
    "c10d",
    "remote worker",
    "timed out",
    "Timed out",
)


def is_comm_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in COMM_FAILURE_MARKERS)


TERMINATION_LOG = "/dev/termination-log"
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
_FULL = (errno.ENOSPC, errno.EDQUOT)


def classify(exc: BaseException, ckpt_dir: str | None) -> tuple[str, int]:
    """(cause, exit code) of a failure the trainer caught (docs/contracts.md "TrainerExit")."""
    from moe_trainer.inputs.data import DataError

    if isinstance(exc, OSError) and exc.errno in _NOT_WRITABLE + _FULL:
        where = str(exc.filename or "")
        if not ckpt_dir or where.startswith(str(ckpt_dir).rstrip("/").rsplit("/", 1)[0]):
            if exc.errno in _FULL:
                return "CheckpointVolumeFull", EXIT_RETRYABLE
            return "CheckpointNotWritable", EXIT_CONFIG  # a read-only volume stays read-only
    if isinstance(exc, DataError):
        text = str(exc)
        missing = "does not exist" in text or "holds no text" in text or "no .npy" in text
        return ("DataNotFound" if missing else "BadData"), EXIT_CONFIG
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return "OutOfMemory", EXIT_RETRYABLE
    if isinstance(exc, (OSError, TimeoutError)):
        return "IOError", EXIT_RETRYABLE
    if is_comm_failure(exc):
        return "LostPeer", EXIT_RETRYABLE
    return "Unexpected", EXIT_UNEXPECTED


def write_termination(cause: str, code: int, message: str, path: str | None = None) -> None:
    """The TrainerExit v1 document, into the kubelet's termination-message file when it exists."""
    path = path or os.environ.get(E.TERMINATION_LOG) or TERMINATION_LOG
    if not os.path.exists(path):
        return
    doc = exit_doc(cause, code, message[:3000], rank=int(os.environ.get(E.RANK, "0") or 0))
    try:
        with open(path, "w") as f:
            f.write(json.dumps(doc)[:TERMINATION_LIMIT])
    except OSError as exc:
        log.warning("termination message not written: %s", exc)


def _failed(cause: str, code: int, message: str) -> int:
    write_termination(cause, code, message)
    return code


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moe-train", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", help="MoEPlan v1 JSON (default $MOE_PLAN, then /etc/moe/plan.json)")
    ap.add_argument(
        "--checkpoint-dir",
        help="default $MOE_CHECKPOINT_DIR, then the plan's training.checkpointDir",
    )
    ap.add_argument("--cpu", action="store_true", help="ignore GPUs (gloo on CPU)")
    return ap.parse_args(argv)


def run(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("MOE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # torch 2.13 deprecates the collectives DeepSpeed 0.19.8 calls every step; keep logs readable.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    try:
        plan = load_plan(resolve_plan_path(args.plan))
    except PlanError as exc:
        log.error("bad plan: %s", exc)
        return _failed("BadConfig", EXIT_CONFIG, f"bad plan: {exc}")

    from moe_trainer import distenv
    from moe_trainer.inputs.data import DataError
    from moe_trainer.model.models import ModelError
    from moe_trainer.trainer import NonFiniteLoss, Trainer

    ckpt_dir = (
        args.checkpoint_dir or os.environ.get(E.CHECKPOINT_DIR) or plan.training.checkpoint_dir
    )
    try:
        force_cpu = args.cpu or plan.device == "cpu"
        env = distenv.read_env(plan.world_size, [r.gpu for r in plan.ranks], force_cpu=force_cpu)
    except distenv.RendezvousError as exc:
        log.error("rendezvous: %s", exc)
        return _failed("BadConfig", EXIT_CONFIG, f"rendezvous: {exc}")
    distenv.set_cpu_threads(env)
    trainer = None
    try:
        try:
            distenv.init_distributed(env)
        except (RuntimeError, OSError, TimeoutError) as exc:
            log.error("rendezvous failed: %s", exc)
            return _failed("RendezvousFailed", EXIT_RETRYABLE, f"rendezvous failed: {exc}")
        trainer = Trainer(plan, env, ckpt_dir)
        try:
            trainer.build()
        except DataError as exc:
            log.error("bad data: %s", exc)
            return _failed(classify(exc, ckpt_dir)[0], EXIT_CONFIG, str(exc))
        except (ModelError, PlanError, ValueError) as exc:
            log.error("bad model/data/config: %s", exc)
            return _failed("BadConfig", EXIT_CONFIG, str(exc))
        trainer.resume()
        from moe_trainer.model.export import save_plan, write_test_logits

        if env.rank == 0:
            save_plan(plan, ckpt_dir)  # what moe-export needs to restore this checkpoint

        write_test_logits(trainer, "start")
        code = trainer.run()
        if code == EXIT_OK:
            write_test_logits(trainer, "final")
        return code
    except NonFiniteLoss as exc:
        log.error("%s", exc)
        return _failed("NonFiniteLoss", EXIT_DATAERR, str(exc))
    except (PlanError, ModelError) as exc:
        log.error("bad config: %s", exc)
        return _failed("BadConfig", EXIT_CONFIG, str(exc))
    except Exception as exc:
        cause, code = classify(exc, ckpt_dir)
        if cause == "Unexpected":
            log.exception("unexpected failure")
        else:
            log.error("%s (exit %d): %s", cause, code, exc)
        return _failed(cause, code, f"{type(exc).__name__}: {exc}")
    finally:
        if trainer is not None:
            trainer.close()


def main(argv: Sequence[str] | None = None) -> None:
    from moe_trainer import launch

    if launch.is_pod_entry():
        code = launch.node_main(argv)
    else:
        from moe_trainer.checkpoint import install_signal_handlers

        install_signal_handlers()
        code = run(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: process-group destructors can hang when a peer is gone.
    os._exit(code)


if __name__ == "__main__":
    main()
