"""What the re-placement cluster tests share (tests/test_replan_trainer_cluster.py,
tests/test_replan_drift_cluster.py): the progress documents rank 0 writes, read as the run goes,
and the job's placement, progress and end."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from moe_contracts import placement_update
from moejob_operator import constants as C
from operator_harness import get_job

REL = 1e-5  # tests/test_replace.py: losses after a switch vs a never-switched run (fp32)


class ProgressLog:
    """Every progress document rank 0 writes into ``<checkpoint dir>/progress.json`` (rewritten
    each step, and held as phase Checkpointing through a checkpoint's switch and write), kept
    by step: the counters at the switch's step come from here."""

    def __init__(self, dirs: dict[str, Path], checks=None):
        self.dirs = dirs
        self.by_step: dict[str, dict[int, dict]] = {k: {} for k in dirs}
        self.checks_of = checks  # () -> job A's status.replan, polled less often
        self.checks: list[dict] = []  # every distinct status.replan seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProgressLog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            if self.checks_of is not None and n % 10 == 0:
                with contextlib.suppress(Exception):
                    got = self.checks_of()
                    if got and got not in self.checks:
                        self.checks.append(got)
            for job, d in self.dirs.items():
                try:
                    doc = json.loads((d / "progress.json").read_text())
                except (OSError, ValueError):
                    continue
                since = (doc.get("moe") or {}).get("allToAllBytesSinceStart")
                if isinstance(doc.get("step"), int) and since:
                    self.by_step[job].setdefault(doc["step"], doc)
            time.sleep(0.05)

    def cross_group(self, job: str, step: int) -> int:
        return self.by_step[job][step]["moe"]["allToAllBytesSinceStart"]["byTier"]["crossGroup"]


def placement_of(kube, namespace, name):
    cm = kube.core.read_namespaced_config_map(f"{name}-placement", namespace)
    return placement_update.loads(cm.data[placement_update.KEY])


def progress_of(kube, namespace, name) -> dict:
    cm = kube.core.read_namespaced_config_map(f"{name}-progress", namespace)
    return json.loads(cm.data[C.PROGRESS_KEY])


def finished(kube, namespace, name):
    st = get_job(kube, namespace, name).get("status") or {}
    return st.get("phase") in ("Succeeded", "Failed") and st


def close(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    return all(abs(x - y) <= REL * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True))
