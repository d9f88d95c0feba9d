"""The demo's second act: a job planned from the first job's routing statistics, and the bytes
it saves.

Job 1 records which experts its tokens picked (ConfigMap ``<job>-routing-stats``). Job 2 is the
same manifest with ``spec.placement.routingStatsFrom.jobName: <job 1>``: the operator's planner
reads those statistics, places experts that fire together on the same NVLink group (the
topology-aware placement) and the trainer dispatches with the de-duplicating dispatcher (the
planner's default when expert parallelism spans more than one rank). Both plans are scored by the
planner's cost model on the statistics they had (``placement.quality`` of the plan ConfigMap):
cross-group bytes per optimizer step of the plan's layout and of contiguous placement. This module
reads those numbers back, prints them side by side and writes them to ``closed_loop.json``;
nothing here computes or invents a byte count of its own.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULT_FILE = "closed_loop.json"
TEXT_BYTES = 64_000  # of real text for both jobs: more than the demo jobs read


def text_data(directory: Path) -> dict[str, Any]:
    """``spec.data`` for both demo jobs: real English text (the trainer's built-in corpus,
    standard-library docstrings) written to ``directory/corpus.txt`` as a hostPath. Random tokens
    route without structure, so no placement could save anything on them; real text gives the
    router the skew a placement can use."""
    from moe_trainer.corpus import iter_texts

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "corpus.txt").write_text("\n\n".join(iter_texts(TEXT_BYTES)))
    return {"kind": "Text", "path": "/data", "volume": {"hostPath": {"path": str(directory)}}}


def planned_name(first: str) -> str:
    return f"{first}-planned"


def planned_manifest(doc: dict[str, Any], first: str) -> dict[str, Any]:
    """Job 2: ``doc`` (job 1's manifest) renamed, planned TopologyAware from ``first``'s
    routing statistics; everything else (model, data, nodes, steps) as job 1."""
    out = copy.deepcopy(doc)
    out["metadata"] = {
        k: v for k, v in out["metadata"].items() if k in ("namespace", "labels", "annotations")
    }
    out["metadata"]["name"] = planned_name(first)
    placement = out["spec"].setdefault("placement", {})
    placement["strategy"] = "TopologyAware"
    placement["routingStatsFrom"] = {"jobName": first}
    return out


@dataclass(frozen=True)
class PlanBytes:
    """What one job's plan predicts per optimizer step (``placement.quality`` of its plan)."""

    job: str
    strategy: str  # the layout the plan has (contiguous when it fell back)
    basis: str  # "routingStats" | "uniform"
    routing_stats_from: str | None
    dispatcher: str  # "dedup" | "autoep"
    cross_group_bytes: int  # the plan's layout
    contiguous_cross_group_bytes: int  # contiguous placement, same tokens, same dispatcher
    max_mean_load: float
    held_out_vs_contiguous: float  # the ratio the planner expects on tokens after the recording
    # forward + backward, with the id/weight columns (core.dispatch; None without token samples)
    dedup_cross_group_bytes: int | None  # the de-duplicating dispatcher, this layout
    autoep_cross_group_bytes: int | None  # DeepSpeed AutoEP's all-to-all, same tokens
    counted_cross_group_bytes: int | None = None  # the trainer's byte counters, last step

    @property
    def saved_bytes(self) -> int:
        return self.contiguous_cross_group_bytes - self.cross_group_bytes

    @property
    def vs_contiguous(self) -> float:
        base = self.contiguous_cross_group_bytes
        return self.cross_group_bytes / base if base else 1.0

    @classmethod
    def from_plan(
        cls, job: str, plan: dict[str, Any], progress: dict[str, Any] | None = None
    ) -> PlanBytes:
        """From the plan document and (optionally) the trainer's last progress document."""
        pl = plan["placement"]
        q = pl["quality"]
        dispatch = q.get("dispatch") or {}
        dedup = (dispatch.get("dedup") or {}).get("crossGroupBytesPerStep")
        autoep = (dispatch.get("autoep") or {}).get("crossGroupBytesPerStep")
        tiers = ((progress or {}).get("moe") or {}).get("allToAllBytesPerStepByTier") or {}
        counted = tiers.get("crossGroup")
        src = pl.get("routingStatsFrom") or {}
        return cls(
            job=job,
            strategy=pl.get("fellBackTo") or pl["strategy"],
            basis=q.get("basis", "uniform"),
            routing_stats_from=src.get("job") or src.get("configMap"),
            dispatcher=pl.get("dispatcher", "autoep"),
            cross_group_bytes=int(q["crossGroupBytesPerStep"]),
            contiguous_cross_group_bytes=int(
                q.get("contiguousCrossGroupBytesPerStep", q["crossGroupBytesPerStep"])
            ),
            max_mean_load=float(q["maxMeanLoad"]),
            held_out_vs_contiguous=float(
                q.get("crossGroupVsContiguousHeldOut", q.get("crossGroupVsContiguous", 1.0))
            ),
            dedup_cross_group_bytes=None if dedup is None else int(dedup),
            autoep_cross_group_bytes=None if autoep is None else int(autoep),
            counted_cross_group_bytes=None if counted is None else int(counted),
        )


def read_plan(kube: Any, namespace: str, job: str) -> dict[str, Any]:
    """The plan document the operator wrote for ``job`` (ConfigMap ``<job>-plan``)."""
    from moejob_operator import constants as C

    cm = kube.core.read_namespaced_config_map(f"{job}-plan", namespace)
    plan: dict[str, Any] = json.loads(cm.data[C.PLAN_KEY])
    return plan


def read_progress(kube: Any, namespace: str, job: str) -> dict[str, Any] | None:
    """The trainer's last progress document for ``job`` (ConfigMap ``<job>-progress``)."""
    from moejob_operator import constants as C

    cm = kube.core.read_namespaced_config_map(f"{job}-progress", namespace)
    raw = (cm.data or {}).get(C.PROGRESS_KEY)
    return json.loads(raw) if raw else None


def report(kube: Any, namespace: str, first: str, second: str) -> tuple[PlanBytes, PlanBytes]:
    """Both jobs' figures, read back from their plan and progress ConfigMaps."""
    return tuple(  # type: ignore[return-value]
        PlanBytes.from_plan(
            job, read_plan(kube, namespace, job), read_progress(kube, namespace, job)
        )
        for job in (first, second)
    )


def _kib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:,.1f} KiB"


def comparison(first: PlanBytes, second: PlanBytes) -> list[str]:
    """The side-by-side the demo prints: one row per figure, one column per job, then the
    saving of job 2's plan against contiguous placement."""
    rows = [
        ("job", first.job, second.job),
        (
            "placement",
            first.strategy,
            f"{second.strategy} (from {second.routing_stats_from}'s routing)"
            if second.routing_stats_from
            else second.strategy,
        ),
        ("scored on", first.basis, second.basis),
        ("dispatcher", first.dispatcher, second.dispatcher),
        (
            "cross-group bytes/step (cost model)",
            _kib(first.cross_group_bytes),
            _kib(second.cross_group_bytes),
        ),
        (
            "  contiguous, same tokens",
            _kib(first.contiguous_cross_group_bytes),
            _kib(second.contiguous_cross_group_bytes),
        ),
        ("forward + backward, by dispatcher:", "", ""),
        (
            "  de-duplicating, predicted",
            _kib(first.dedup_cross_group_bytes),
            _kib(second.dedup_cross_group_bytes),
        ),
        (
            "  AutoEP all-to-all, predicted",
            _kib(first.autoep_cross_group_bytes),
            _kib(second.autoep_cross_group_bytes),
        ),
        (
            "  counted by the trainer (last step)",
            _kib(first.counted_cross_group_bytes),
            _kib(second.counted_cross_group_bytes),
        ),
        ("load max/mean", f"{first.max_mean_load:.3f}", f"{second.max_mean_load:.3f}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    pct = 100 * abs(1 - second.vs_contiguous)
    plan = (
        f"{second.cross_group_bytes:,} instead of {second.contiguous_cross_group_bytes:,}, "
        f"{second.vs_contiguous:.3f}x contiguous"
    )
    source = (
        f"{second.job}'s plan from {second.routing_stats_from}'s routing statistics "
        f"(on tokens after the recorded ones the planner expects "
        f"{second.held_out_vs_contiguous:.3f}x contiguous)"
    )
    if second.saved_bytes > 0:
        head = f"saved: {second.saved_bytes:,} bytes per step across NVLink groups ({plan}, "
        lines.append(head + f"{pct:.1f}% less), predicted by {source}")
    else:  # said as plainly as a saving: the placement found nothing to gain on these tokens
        head = f"no saving: {-second.saved_bytes:,} bytes per step more across NVLink groups "
        lines.append(head + f"({plan}, {pct:.1f}% more), predicted by {source}")
    a, b = first.counted_cross_group_bytes, second.counted_cross_group_bytes
    if a and b:
        lines.append(
            f"counted: {b:,} bytes across NVLink groups on {second.job}'s last step, "
            f"{a:,} on {first.job}'s ({b / a:.3f}x; the trainers' byte counters, "
            "status.progress of each job's progress ConfigMap)"
        )
    return lines


def result(first: PlanBytes, second: PlanBytes) -> dict[str, Any]:
    """``closed_loop.json``: both plans' figures and the saving (bytes per optimizer step)."""
    return {
        "jobs": [asdict(first), asdict(second)],
        "savedCrossGroupBytesPerStep": second.saved_bytes,
        "crossGroupVsContiguous": round(second.vs_contiguous, 4),
        "crossGroupVsContiguousHeldOut": second.held_out_vs_contiguous,
        "source": "placement.quality of each job's plan ConfigMap (<job>-plan)",
    }


def write_result(work: Path, first: PlanBytes, second: PlanBytes) -> Path:
    path = work / RESULT_FILE
    path.write_text(json.dumps(result(first, second), indent=1) + "\n")
    return path


PLOT_FILE = "closed_loop.png"
_BARS = (
    ("plan's layout\n(cost model, fwd)", "cross_group_bytes"),
    ("contiguous\n(cost model, fwd)", "contiguous_cross_group_bytes"),
    ("de-duplicating\n(predicted, fwd+bwd)", "dedup_cross_group_bytes"),
    ("AutoEP\n(predicted, fwd+bwd)", "autoep_cross_group_bytes"),
    ("counted, last step\n(fwd+bwd)", "counted_cross_group_bytes"),
)


def write_plot(work: Path, first: PlanBytes, second: PlanBytes) -> Path:
    """``closed_loop.png``: cross-group bytes per step of both jobs, bar by bar as the table
    prints them (a missing figure is a missing bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=110)
    width = 0.38
    for offset, job in ((-width / 2, first), (width / 2, second)):
        xs = [i + offset for i, (_, f) in enumerate(_BARS) if getattr(job, f) is not None]
        kib = [getattr(job, f) / 1024 for _, f in _BARS if getattr(job, f) is not None]
        ax.bar(xs, kib, width, label=f"{job.job} ({job.strategy})")
    ax.set_xticks(range(len(_BARS)), [label for label, _ in _BARS], fontsize=8)
    ax.set_ylabel("KiB per step across NVLink groups")
    ax.set_title("Bytes across NVLink groups: job 1 vs job 2 planned from its routing", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = work / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path
