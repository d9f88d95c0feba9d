"""Checkpoints: DeepSpeed engine state + the trainer's own state, and the fault-injection hook.

Layout under the checkpoint dir ($MOE_CHECKPOINT_DIR, else the plan's training.checkpointDir):
  ds/latest                      DeepSpeed's pointer to the newest tag ("step-<n>")
  ds/step-<n>/...                DeepSpeed model/optimizer/scheduler shards (save_checkpoint)
  ds/step-<n>/trainer_state.pt   step, data position, routing accumulators, health counters
                                 (written by rank 0; identical on every rank)
  ds/step-<n>/rng_rank<r>.pt     torch/numpy/python RNG states of rank r
A tag is complete once DeepSpeed has rewritten `latest`, which it does after all shards are on
disk; the trainer's own files are written before that, so `latest` never points at a half tag.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

TAG_RE = re.compile(r"^step-(\d+)$")


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
    tag_dir.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tag_dir / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(trainer_state, tag_dir / "trainer_state.pt")
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
    at = os.environ.get("MOE_FAULT_EXIT_AT_STEP")
    if not at or int(at) != step:
        return None
    code = int(os.environ.get("MOE_FAULT_EXIT_CODE", "75"))
    if ckpt_dir:
        marker = Path(ckpt_dir) / f"fault-injected-step-{step}"
        if marker.exists():
            return None
    return code


def mark_fault(step: int, ckpt_dir: str | os.PathLike | None, rank: int) -> None:
    if ckpt_dir and rank == 0:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        (Path(ckpt_dir) / f"fault-injected-step-{step}").write_text(f"{step}\n")
