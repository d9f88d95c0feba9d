"""Child processes in their own process groups, stopped for sure.

Every process the control plane or the node agent starts goes through ``spawn``: it runs in a new
session (so it leads its own process group and a signal to the group reaches all its children),
its output goes to a log file, and its pid is recorded in ``SPAWNED`` so tests can prove that
nothing survives.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

SPAWNED: set[int] = set()  # every pid (= process group id) ever started here
_lock = threading.Lock()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # best effort: the parent still stops its children
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(
    argv: list[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    die_with_parent: bool = False,
) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new process group, stdout+stderr appended to ``log_path``.

    ``die_with_parent`` asks the kernel to SIGKILL the child when the thread that started it
    dies (a safety net if the parent is killed with SIGKILL); use it only from long-lived threads.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    with _lock:
        SPAWNED.add(proc.pid)
    return proc


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (zombies of our own children excluded)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds for zombies too: look for a live member in /proc.
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != b"Z":
            return True
    return False


def stop(proc: subprocess.Popen, grace_seconds: float = 5.0) -> int | None:
    """SIGTERM the process group, wait up to ``grace_seconds``, then SIGKILL it; reap the leader."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_alive(pgid):
            return proc.returncode
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    deadline = time.monotonic() + 5
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.returncode


def survivors(pids=None) -> list[int]:
    """The process groups among ``pids`` (default: all ever spawned) that still have a live
    member."""
    with _lock:
        candidates = sorted(SPAWNED if pids is None else pids)
    return [p for p in candidates if group_alive(p)]
