"""Checkpoints: DeepSpeed engine state + the trainer's own state, and the fault-injection hook.

Layout under the checkpoint dir ($MOE_CHECKPOINT_DIR, else the plan's training.checkpointDir):
  ds/latest                      DeepSpeed's pointer to the newest tag ("step-<n>")
  ds/step-<n>/...                DeepSpeed model/optimizer/scheduler shards (save_checkpoint)
  ds/step-<n>/trainer_state.pt   step, data position, routing accumulators, health counters
                                 (written by rank 0; identical on every rank)
  ds/step-<n>/rng_rank<r>.pt     torch/numpy/python RNG states of rank r
A tag is complete once DeepSpeed has rewritten `latest`, which it does after all shards are on
disk; the trainer's own files are written before that, so `latest` never points at a half tag.

SIGTERM / SIGINT (pod deletion: the node launcher forwards it to every rank): outside a
checkpoint write the rank exits at once (128 + signal); during one it finishes the write first,
so a deleted pod leaves the checkpoint it was writing complete (`install_signal_handlers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from moe_contracts import env as E

TAG_RE = re.compile(r"^step-(\d+)$")
log = logging.getLogger("moe_trainer.checkpoint")
HOLD_LIMIT_SECONDS = 600.0

_writing = 0                     # > 0 while this process is inside save()
_pending_signal: int | None = None


def _exit_on(signum: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)       # no interpreter teardown: process-group destructors can hang


def _on_signal(signum, _frame) -> None:
    global _pending_signal
    if _writing:
        if _pending_signal is None:
            log.warning("%s during a checkpoint write: finishing the write, then exiting",
                        signal.Signals(signum).name)
        _pending_signal = signum
        return
    log.warning("%s: exiting", signal.Signals(signum).name)
    _exit_on(signum)


def install_signal_handlers() -> None:
    """SIGTERM / SIGINT: exit now, or right after the checkpoint write in progress."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_signal)


@contextlib.contextmanager
def _write_guard(step: int):
    global _writing
    _writing += 1
    try:
        yield
    finally:
        _writing -= 1
    if not _writing and _pending_signal is not None:
        log.warning("checkpoint step-%d written; exiting on %s", step, signal.Signals(_pending_signal).name)
        _exit_on(_pending_signal)


def _hold_for_test(step: int, ckpt_dir, rank: int) -> None:
    """Fault injection for operator tests: MOE_FAULT_HOLD_CHECKPOINT_AT_STEP=n makes rank 0 stop
    half-way through writing checkpoint n (its own files written, DeepSpeed's shards not yet),
    leave `checkpoint-write-started-step-<n>` in the checkpoint dir and wait there until it is
    signalled (a test deletes the pod), once per checkpoint dir."""
    at = os.environ.get(E.FAULT_HOLD_CHECKPOINT_AT_STEP)
    if rank != 0 or not at or int(at) != step:
        return
    marker = Path(ckpt_dir) / f"checkpoint-write-started-step-{step}"
    if marker.exists():
        return
    marker.write_text(f"{step}\n")
    log.warning("fault injection: holding checkpoint step-%d half-written until signalled", step)
    deadline = time.monotonic() + HOLD_LIMIT_SECONDS
    while _pending_signal is None and time.monotonic() < deadline:
        time.sleep(0.05)


def tag_for(step: int) -> str:
    return f"step-{step}"


def ds_dir(ckpt_dir: str | os.PathLike) -> Path:
    return Path(ckpt_dir) / "ds"


def latest_step(ckpt_dir: str | os.PathLike | None) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    if not ckpt_dir:
        return None
    latest = ds_dir(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    m = TAG_RE.match(latest.read_text().strip())
    return int(m.group(1)) if m else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, ckpt_dir: str | os.PathLike, step: int, rank: int, trainer_state: dict) -> Path:
    """Collective: every rank calls it. Returns the tag directory."""
    import torch.distributed as dist
    tag = tag_for(step)
    tag_dir = ds_dir(ckpt_dir) / tag
    with _write_guard(step):
        tag_dir.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), tag_dir / f"rng_rank{rank}.pt")
        if rank == 0:
            torch.save(trainer_state, tag_dir / "trainer_state.pt")
        _hold_for_test(step, ckpt_dir, rank)
        dist.barrier()
        engine.save_checkpoint(str(ds_dir(ckpt_dir)), tag=tag, client_state={"step": step})
    return tag_dir


def load(engine, ckpt_dir: str | os.PathLike, step: int, rank: int) -> dict:
    """Collective: restore engine + RNG of this rank; returns the trainer state."""
    tag = tag_for(step)
    path, _client = engine.load_checkpoint(str(ds_dir(ckpt_dir)), tag=tag)
    if path is None:
        raise OSError(f"DeepSpeed could not load checkpoint {tag} from {ds_dir(ckpt_dir)}")
    tag_dir = ds_dir(ckpt_dir) / tag
    rng_file = tag_dir / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(tag_dir / "trainer_state.pt", weights_only=False)


def fault_due(step: int, ckpt_dir: str | os.PathLike | None) -> int | None:
    """Fault injection for operator tests: with MOE_FAULT_EXIT_AT_STEP=n and MOE_FAULT_EXIT_CODE=c
    the trainer exits with c right after finishing step n, once per checkpoint dir (a marker file
    `fault-injected-step-<n>` records it, so the restarted attempt runs through)."""
    at = os.environ.get(E.FAULT_EXIT_AT_STEP)
    if not at or int(at) != step:
        return None
    code = int(os.environ.get(E.FAULT_EXIT_CODE, "75"))
    if ckpt_dir:
        marker = Path(ckpt_dir) / f"fault-injected-step-{step}"
        if marker.exists():
            return None
    return code


def mark_fault(step: int, ckpt_dir: str | os.PathLike | None, rank: int) -> None:
    if ckpt_dir and rank == 0:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        (Path(ckpt_dir) / f"fault-injected-step-{step}").write_text(f"{step}\n")
