"""Checkpoints: DeepSpeed engine state + the trainer's own state, and the way to the test faults.

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
import functools
import logging
import os
import random
import re
import signal
import sys
from pathlib import Path

import numpy as np
import torch

TAG_RE = re.compile(r"^step-(\d+)$")
log = logging.getLogger("moe_trainer.checkpoint")

_writing = 0  # > 0 while this process is inside save()
_pending_signal: int | None = None


def _exit_on(signum: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)  # no interpreter teardown: process-group destructors can hang


def _on_signal(signum, _frame) -> None:
    global _pending_signal
    if _writing:
        if _pending_signal is None:
            log.warning(
                "%s during a checkpoint write: finishing the write, then exiting",
                signal.Signals(signum).name,
            )
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
        log.warning(
            "checkpoint step-%d written; exiting on %s", step, signal.Signals(_pending_signal).name
        )
        _exit_on(_pending_signal)


@functools.cache
def test_faults():
    """The fault-injection hooks (docs/contracts.md, "Trainer fault injection"): the dev
    package's ``moe_faults`` where it is installed (a developer's venv), else None: the images do
    not install it. The only way the trainer reaches them."""
    try:
        import moe_faults
    except ImportError:
        return None
    return moe_faults


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
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
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
        faults = test_faults()
        if faults is not None:
            faults.hold_checkpoint(
                step, ckpt_dir, rank, signalled=lambda: _pending_signal is not None
            )
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
