"""Fault injection for tests: every test-only hook of the operator and the trainer, in one place.

Dev tooling (operator/dev, moe-operator-dev): the images do not install it. Product code reaches
it through one function per program, which returns this module or None:

- the operator: ``moejob_operator.admission.test_faults(policy)``, only when it was started with
  ``MOE_OPERATOR_TEST_MODE=1`` (the tests' harness sets it; the chart never does);
- the trainer: ``moe_trainer.checkpoint.test_faults()``, whenever this module is importable (a
  developer's venv; never an image).

Operator (docs/operator.md, "Test hooks"):

- ``MOE_OPERATOR_CRASH_AT=<point>`` (one of ``CRASH_POINTS``): the operator process exits (code 3)
  right there, so a test can kill it mid-launch at a chosen point and check that a restarted one
  converges (``crashpoint``, ``crash_at``).
- Job annotations ``moe-operator.io/fault-*`` become the trainer's ``MOE_FAULT_*`` variables on
  the worker pods (``trainer_env``).

Trainer (docs/contracts.md, "Trainer fault injection"):

- ``MOE_FAULT_EXIT_AT_STEP=<n>`` + ``MOE_FAULT_EXIT_CODE=<c>`` (default 75): every rank exits with
  ``c`` right after step ``n``, once per checkpoint dir (``exit_due``, ``mark_exit``).
- ``MOE_FAULT_NAN_AT_STEP=<n>``: the loss of step ``n`` is NaN (``nan_due``).
- ``MOE_FAULT_HOLD_CHECKPOINT_AT_STEP=<n>``: rank 0 stops half-way through writing checkpoint
  ``n`` until it is signalled, once per checkpoint dir (``hold_checkpoint``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from moe_contracts import env as E

log = logging.getLogger("moe_faults")

# ---- operator ------------------------------------------------------------------------------

CRASH_ENV = "MOE_OPERATOR_CRASH_AT"
CRASH_POINTS = ("after-plan", "after-rbac", "after-first-worker", "after-restart-status")
CRASH_EXIT_CODE = 3

GROUP = "moe-operator.io"
FAULT_ANNOTATIONS = {
    f"{GROUP}/fault-exit-at-step": E.FAULT_EXIT_AT_STEP,
    f"{GROUP}/fault-exit-code": E.FAULT_EXIT_CODE,
    f"{GROUP}/fault-hold-checkpoint-at-step": E.FAULT_HOLD_CHECKPOINT_AT_STEP,
    # not a fault: where the trainer saves its logits on a fixed batch (tests compare exports)
    f"{GROUP}/test-logits-dir": E.TEST_LOGITS_DIR,
}


def crash_at(env: Mapping[str, str] = os.environ) -> str | None:
    """The crash point ``MOE_OPERATOR_CRASH_AT`` names, if any."""
    return env.get(CRASH_ENV) or None


def crashpoint(point: str) -> None:
    """Exit the process here (no cleanup, as a kill would) when ``MOE_OPERATOR_CRASH_AT`` names
    ``point``."""
    if point not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {point!r}; known: {', '.join(CRASH_POINTS)}")
    if crash_at() == point:
        log.warning("%s=%s: exiting now", CRASH_ENV, point)
        os._exit(CRASH_EXIT_CODE)


def trainer_env(annotations: Mapping[str, str] | None) -> dict[str, str]:
    """The job's ``moe-operator.io/fault-*`` annotations as the trainer's ``MOE_FAULT_*`` env."""
    ann = annotations or {}
    return {env: str(ann[key]) for key, env in FAULT_ANNOTATIONS.items() if key in ann}


# ---- trainer -------------------------------------------------------------------------------

HOLD_LIMIT_SECONDS = 600.0


def _step(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def nan_due(step: int) -> bool:
    """Poison the loss of ``step`` (``MOE_FAULT_NAN_AT_STEP``)."""
    return _step(E.FAULT_NAN_AT_STEP) == step


def _marker(ckpt_dir, step: int) -> Path:
    return Path(ckpt_dir) / f"fault-injected-step-{step}"


def exit_due(step: int, ckpt_dir: str | os.PathLike | None) -> int | None:
    """The exit code to leave with right after ``step`` (``MOE_FAULT_EXIT_AT_STEP`` /
    ``MOE_FAULT_EXIT_CODE``), once per checkpoint dir: the marker ``mark_exit`` leaves lets the
    restarted attempt run through."""
    if _step(E.FAULT_EXIT_AT_STEP) != step:
        return None
    if ckpt_dir and _marker(ckpt_dir, step).exists():
        return None
    return int(os.environ.get(E.FAULT_EXIT_CODE, "75"))


def mark_exit(step: int, ckpt_dir: str | os.PathLike | None, rank: int) -> None:
    if ckpt_dir and rank == 0:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        _marker(ckpt_dir, step).write_text(f"{step}\n")


def hold_checkpoint(
    step: int, ckpt_dir: str | os.PathLike, rank: int, signalled: Callable[[], bool]
) -> None:
    """Rank 0 stops half-way through writing checkpoint ``step`` (its own files written,
    DeepSpeed's shards not yet), leaves ``checkpoint-write-started-step-<n>`` in the checkpoint
    dir and waits there until ``signalled()`` (a test deletes the pod), once per checkpoint dir
    (``MOE_FAULT_HOLD_CHECKPOINT_AT_STEP``)."""
    if rank != 0 or _step(E.FAULT_HOLD_CHECKPOINT_AT_STEP) != step:
        return
    marker = Path(ckpt_dir) / f"checkpoint-write-started-step-{step}"
    if marker.exists():
        return
    marker.write_text(f"{step}\n")
    log.warning("fault injection: holding checkpoint step-%d half-written until signalled", step)
    deadline = time.monotonic() + HOLD_LIMIT_SECONDS
    while not signalled() and time.monotonic() < deadline:
        time.sleep(0.05)
