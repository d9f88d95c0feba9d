"""What the re-placement cluster tests share (tests/test_replan_trainer_cluster.py,
tests/test_replan_drift_cluster.py): the progress documents rank 0 writes, read as the run goes,
and the job's placement, progress and end."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

from moe_contracts import placement_update
from moejob_operator import constants as C
from operator_harness import example, get_job

REL = 1e-5  # tests/test_replace.py: losses after a switch vs a never-switched run (fp32)
SEQ_LEN, GLOBAL_BATCH = 64, 4  # examples/tiny-cpu.yaml


def planted_job(
    name: str,
    ckpt: Path,
    model: Path,
    data: dict,
    *,
    steps: int,
    every: int,
    min_gain: int,
    replan: bool,
    stats_from: str | None = None,
) -> dict:
    """The tiny CPU example on ``model`` (a ``save_pretrained`` folder, tests/planted_routing.py)
    and ``data``: 2 node ranks (2 NVLink groups), EP 2, the de-duplicating dispatcher,
    checkpoints every ``every`` steps into ``ckpt``; with ``replan`` every ``every`` steps at
    ``min_gain`` percent, and ``stats_from`` as ``routingStatsFrom``."""
    placement: dict = {"strategy": "TopologyAware", "dispatcher": "Dedup", "expertParallelSize": 2}
    if replan:
        placement["replan"] = {"everySteps": every, "minPredictedGainPercent": min_gain}
    if stats_from is not None:
        placement["routingStatsFrom"] = {"jobName": stats_from}
    job = example(
        "tiny-cpu.yaml",
        metadata={"name": name},
        nodes={"count": 2, "gpusPerNode": 1},
        placement=placement,
        checkpoint={"everySteps": every, "volume": {"hostPath": {"path": str(ckpt)}}},
        runPolicy={"backoffLimit": 0},
        gate={"skip": True, "skipReason": "the gate's own tests run the smoke Job"},
        data=data,
        model={"path": "/model", "volume": {"hostPath": {"path": str(model)}}},
    )
    job["spec"]["training"].update(steps=steps)
    assert job["spec"]["training"]["seqLen"] == SEQ_LEN
    assert job["spec"]["training"]["globalBatch"] == GLOBAL_BATCH
    return job


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


def applied_switch(kube, namespace, wait_for, name: str) -> dict:
    """Job ``name``'s one ``status.placementHistory`` entry, once it records ``appliedAtStep``."""

    def history_applied():
        st = get_job(kube, namespace, name).get("status") or {}
        h = st.get("placementHistory") or []
        return h and h[0].get("appliedAtStep") is not None and st

    st = wait_for(history_applied, timeout=120, message="placementHistory appliedAtStep")
    (h,) = st["placementHistory"]
    return h


def losses_of(dirs: dict[str, Path]) -> dict[str, list[float]]:
    """Each job's per-step losses, as its rank 0 wrote them into its checkpoint directory."""
    return {n: json.loads((d / "losses.json").read_text())["losses"] for n, d in dirs.items()}


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), abs(y)) for x, y in zip(a, b, strict=True))


def counted_after_switch(
    plog: ProgressLog, end: dict[str, dict], switched: str, stayed: str, applied: int
) -> tuple[int, dict[str, int]]:
    """``(at, counted)``: the last step at or before ``applied`` both jobs' progress was seen at,
    and each job's cross-group bytes counted after it (``end``: each job's last
    ``allToAllBytesSinceStart``). Up to the switch both ran the same placement on the same
    tokens: the same bytes."""
    common = set(plog.by_step[switched]) & set(plog.by_step[stayed])
    at = max((s for s in common if s <= applied), default=None)
    assert at is not None, (sorted(plog.by_step[switched]), sorted(plog.by_step[stayed]), applied)
    assert plog.cross_group(switched, at) == plog.cross_group(stayed, at) > 0
    counted = {
        n: end[n]["byTier"]["crossGroup"] - plog.cross_group(n, at) for n in (switched, stayed)
    }
    return at, counted


def switch_figures(
    counted: dict[str, int], at: int, steps: int, before: float, after: float, a: str, b: str
) -> dict:
    """The bytes figures of a switched job ``a`` against ``b`` that stayed, after step ``at``:
    counted (and their ratio), predicted (before / after), and counted per step over the
    prediction (``a``: the candidate's, ``b``: the running placement's; counted on later steps'
    tokens than the window the prediction was made on)."""
    return {
        "countedCrossGroupBytesAfterSwitch": counted,
        "countedFromStep": at,
        "countedSteps": steps - at,
        "countedAVsB": round(counted[a] / counted[b], 4) if counted[b] else None,
        "predictedCrossGroupBytesPerStep": {"before": before, "after": after},
        "predictedAfterVsBefore": round(after / before, 4),
        "countedPerStepOverPredicted": {
            a: round(counted[a] / (steps - at) / after, 4),
            b: round(counted[b] / (steps - at) / before, 4),
        },
    }


def write_results(env_var: str, test_file: str, setup: dict, figures: dict) -> None:
    """With ``$env_var`` set: the measured figures, the command and the setup, into that file."""
    dst = os.environ.get(env_var)
    if not dst:
        return
    doc = {
        "command": f"{env_var}={dst} python -m pytest -m cluster {test_file}",
        "cpus": os.cpu_count(),
        "measuredAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": setup,
        **figures,
    }
    Path(dst).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
