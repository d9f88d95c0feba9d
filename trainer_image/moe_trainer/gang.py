"""A gang of local rank processes: start them, prefix their output, stop them together.

One implementation for every place that runs several ranks on one machine: the worker pod's
node launcher (``moe_trainer.launch.node_main``), the local multi-rank runs of tests and
benchmarks (``launch.launch``) and the smoke test (``moe_trainer.gate.main``).

Why not ``torchrun`` / ``torch.distributed.elastic``: its agent reports any failed worker as
``ChildFailedError`` and exits 1, so the trainer's exit codes (65 non-finite loss, 75 retryable,
78 bad config: the operator's failure policy) would be lost; it runs its own rendezvous across
nodes on top of the trainer's, and its restarts duplicate the operator's gang restarts. What is
kept from it: one process per rank with torchrun-style env, output prefixed per rank, the first
failure stops the others, signals are forwarded with a bounded grace period.

Semantics:
- each rank runs in its own session (so a signal to this process is not also delivered to the
  ranks by the terminal or a node agent that signals the group: forwarding is explicit) and gets
  SIGKILL if this process dies (``PR_SET_PDEATHSIG``), as a container's processes would;
- SIGTERM / SIGINT to this process are forwarded to every rank; ranks still alive after
  ``grace_seconds`` are killed;
- the first rank that exits non-zero stops the others: SIGTERM, then SIGKILL after
  ``stop_seconds``; its code (a signal N reads 128+N) is the gang's exit code. Ranks found dead
  in the same poll: one killed by a signal counts as first (the others may have exited because
  they lost it), else the lowest rank.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

GRACE_SECONDS = 25.0  # worker pods get 30 s (terminationGracePeriodSeconds) before SIGKILL
STOP_SECONDS = 5.0  # after a rank failed: how long the others get to exit on SIGTERM
TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1


_prctl: Callable[..., int] | None
try:  # resolved here: the child must not dlopen after fork
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def exit_code(returncode: int) -> int:
    """Popen's returncode as a shell / container runtime reports it (-N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Result:
    codes: list[int | None]  # by rank; None: still running when the wait ended
    first_failure: int | None = None  # the rank that exited non-zero first
    signal: int | None = None  # SIGTERM / SIGINT this process received
    timed_out: bool = False
    tails: list[collections.deque[str]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The first failing rank's code; 0 when every rank finished; 124 on a timeout."""
        if self.first_failure is not None:
            return int(self.codes[self.first_failure] or 0) or 1
        if self.timed_out:
            return 124
        if self.signal is not None and any(c != 0 for c in self.codes):
            return 128 + self.signal
        return 0

    def describe(self, labels: Sequence[str] | None = None) -> str:
        names = labels or [f"rank{r}" for r in range(len(self.codes))]
        if self.first_failure is not None:
            r = self.first_failure
            head = f"{names[r]} exited with code {self.codes[r]} first"
        elif self.timed_out:
            head = "timed out"
        else:
            head = "all ranks finished" if self.exit_code == 0 else "stopped"
        if self.signal is not None:
            head += f" (launcher got {signal.Signals(self.signal).name})"
        return f"{head}; exit codes {dict(zip(names, self.codes, strict=True))}"


class Gang:
    """``Gang(cmds, envs).run()``; ``cmds[r]`` / ``envs[r]``: rank r's argv and full environment."""

    def __init__(
        self,
        cmds: Sequence[Sequence[str]],
        envs: Sequence[dict[str, str]],
        *,
        labels: Sequence[str] | None = None,
        out: IO[str] | None = None,
        log_paths: Sequence[str | os.PathLike[str]] | None = None,
        grace_seconds: float = GRACE_SECONDS,
        stop_seconds: float = STOP_SECONDS,
        timeout: float | None = None,
        forward_signals: bool = True,
    ):
        if len(cmds) != len(envs) or not cmds:
            raise ValueError(
                f"need one env per command, got {len(cmds)} commands, {len(envs)} envs"
            )
        self.cmds, self.envs = [list(c) for c in cmds], [dict(e) for e in envs]
        self.labels = list(labels or [f"rank{r}" for r in range(len(cmds))])
        self.out = out
        self.log_paths = list(log_paths) if log_paths else None
        self.grace, self.stop_after, self.timeout = grace_seconds, stop_seconds, timeout
        self.forward_signals = forward_signals
        self.procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._signal: int | None = None
        self._kill_at: float | None = None

    # ---- output ----------------------------------------------------------------------------
    def _pump(
        self, stream: IO[bytes], tail: collections.deque[str], label: str, log: IO[bytes] | None
    ) -> None:
        out = self.out if self.out is not None else sys.stdout
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            tail.append(line)
            if log is not None:
                log.write(raw)
                log.flush()
            else:
                with self._lock:
                    out.write(f"[{label}] {line}\n")
                    out.flush()
        stream.close()

    # ---- signals -----------------------------------------------------------------------------
    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self._signal is None:
            self._signal = signum
            self._kill_at = time.monotonic() + self.grace
        self._send(signum)

    # ---- run ---------------------------------------------------------------------------------
    def run(self) -> Result:
        restore = {}
        if self.forward_signals and threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                restore[s] = signal.signal(s, self._on_signal)
        logs: list[IO[bytes] | None] = [None] * len(self.cmds)
        pumps: list[threading.Thread] = []
        tails: list[collections.deque[str]] = [
            collections.deque(maxlen=TAIL_LINES) for _ in self.cmds
        ]
        try:
            for cmd, env in zip(self.cmds, self.envs, strict=True):
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=_die_with_parent,
                    )
                )
            for r, p in enumerate(self.procs):  # threads only after every fork (preexec_fn)
                if self.log_paths:
                    logs[r] = open(self.log_paths[r], "ab")  # noqa: SIM115 - closed in `finally`
                t = threading.Thread(
                    target=self._pump,
                    args=(p.stdout, tails[r], self.labels[r], logs[r]),
                    daemon=True,
                    name=f"gang-{self.labels[r]}",
                )
                t.start()
                pumps.append(t)
            if self._signal is not None:  # arrived while starting: forward it now
                self._send(self._signal)
            res = self._wait()
        finally:
            if any(p.poll() is None for p in self.procs):
                self._send(signal.SIGKILL)
            for p in self.procs:
                p.wait()
            for t in pumps:
                t.join(timeout=5)
            for f in logs:
                if f is not None:
                    f.close()
            for s, h in restore.items():
                signal.signal(s, h)
        res.tails = tails
        res.codes = [
            exit_code(p.returncode) if p.returncode is not None else None for p in self.procs
        ]
        return res

    def _wait(self) -> Result:
        res = Result(codes=[None] * len(self.procs))
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        stop_at: float | None = None
        while True:
            alive = 0
            failed_now = []
            for r, p in enumerate(self.procs):
                rc = p.poll()
                if rc is None:
                    alive += 1
                    continue
                res.codes[r] = exit_code(rc)
                if rc != 0:
                    failed_now.append((rc >= 0, r))
            if failed_now and res.first_failure is None and self._signal is None:
                # Several ranks found dead in one poll: which went first is unknown, but a rank
                # killed by a signal cannot have been reacting to its peers, while one that
                # exited on its own may have (a lost peer), so the killed one speaks first.
                res.first_failure = min(failed_now)[1]
                stop_at = time.monotonic() + self.stop_after
                self._send(signal.SIGTERM)
            res.signal = self._signal
            if not alive:
                break
            now = time.monotonic()
            if (stop_at is not None and now >= stop_at) or (
                self._kill_at is not None and now >= self._kill_at
            ):
                self._send(signal.SIGKILL)
            if deadline is not None and now >= deadline:
                res.timed_out = True
                self._send(signal.SIGKILL)
                break
            time.sleep(0.05)
        if res.first_failure is None and self._signal is not None:
            # ranks that died of the forwarded signal: the first non-zero one speaks for the pod
            bad = [r for r, c in enumerate(res.codes) if c not in (None, 0)]
            res.first_failure = bad[0] if bad else None
        return res
