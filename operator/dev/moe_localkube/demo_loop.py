"""The demo's second act: a job planned from the first job's routing statistics, and the bytes
it saves.

Job 1 runs with DeepSpeed's own expert layout and all-to-all (``placement.strategy: Contiguous``,
``dispatcher: AutoEP``: what a user gets without this product) and records which experts its
tokens picked (ConfigMap ``<job>-routing-stats``). Job 2 is the same manifest with the product's
choices: ``spec.placement.routingStatsFrom.jobName: <job 1>`` (the planner places experts that
fire together on the same NVLink group: the topology-aware placement) and the de-duplicating
dispatcher. Both jobs read the same text in the same order from the same seed, so they route the
same tokens the same way, and the trainers' byte counters summed over the run
(``moe.allToAllBytesSinceStart``) compare like with like. Beside them: what each plan predicted
(``placement.quality`` of the plan ConfigMap: the layout against contiguous placement on job 1's
tokens, each dispatcher's bytes). This module reads those numbers back, prints them side by side
and writes them to ``closed_loop.json``; nothing here computes or invents a byte count of its own.
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
    from moe_trainer.inputs.corpus import iter_texts

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "corpus.txt").write_text("\n\n".join(iter_texts(TEXT_BYTES)))
    return {"kind": "Text", "path": "/data", "volume": {"hostPath": {"path": str(directory)}}}


def planned_name(first: str) -> str:
    return f"{first}-planned"


def baseline_manifest(doc: dict[str, Any]) -> dict[str, Any]:
    """Job 1: ``doc`` with DeepSpeed's own expert layout and all-to-all (contiguous placement,
    AutoEP's dispatcher); everything else as written."""
    out = copy.deepcopy(doc)
    placement = out["spec"].setdefault("placement", {})
    placement["strategy"] = "Contiguous"
    placement["dispatcher"] = "AutoEP"
    return out


def planned_manifest(doc: dict[str, Any], first: str) -> dict[str, Any]:
    """Job 2: ``doc`` (job 1's manifest) renamed, planned TopologyAware from ``first``'s
    routing statistics, with the de-duplicating dispatcher; everything else (model, data, nodes,
    steps) as job 1."""
    out = copy.deepcopy(doc)
    out["metadata"] = {
        k: v for k, v in out["metadata"].items() if k in ("namespace", "labels", "annotations")
    }
    out["metadata"]["name"] = planned_name(first)
    placement = out["spec"].setdefault("placement", {})
    placement["strategy"] = "TopologyAware"
    placement["dispatcher"] = "Dedup"
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
    max_mean_load: float  # mean over layers of max/mean tokens per GPU
    contiguous_max_mean_load: float  # contiguous placement, same tokens
    held_out_vs_contiguous: float  # the ratio the planner expects on tokens after the recording
    # forward + backward, with the id/weight columns (core.dispatch; None without token samples)
    dedup_cross_group_bytes: int | None  # the de-duplicating dispatcher, this layout
    autoep_cross_group_bytes: int | None  # DeepSpeed AutoEP's all-to-all, same tokens
    # the trainers' byte counters summed over the run (moe.allToAllBytesSinceStart), and its steps
    counted_cross_group_bytes: int | None = None
    counted_steps: int | None = None

    @property
    def predicted_cross_group_bytes(self) -> int | None:
        """Forward + backward bytes per step the plan predicts for the job's own dispatcher."""
        if self.dispatcher == "dedup":
            return self.dedup_cross_group_bytes
        return self.autoep_cross_group_bytes

    @property
    def counted_per_step(self) -> float | None:
        if self.counted_cross_group_bytes is None or not self.counted_steps:
            return None
        return self.counted_cross_group_bytes / self.counted_steps

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
        """From the plan document and (optionally) the trainer's last progress document (its
        ``moe.allToAllBytesSinceStart``: the bytes of a finished job's whole run)."""
        pl = plan["placement"]
        q = pl["quality"]
        dispatch = q.get("dispatch") or {}
        dedup = (dispatch.get("dedup") or {}).get("crossGroupBytesPerStep")
        autoep = (dispatch.get("autoep") or {}).get("crossGroupBytesPerStep")
        since = ((progress or {}).get("moe") or {}).get("allToAllBytesSinceStart") or {}
        counted = (since.get("byTier") or {}).get("crossGroup")
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
            contiguous_max_mean_load=float(q.get("contiguousMaxMeanLoad", q["maxMeanLoad"])),
            held_out_vs_contiguous=float(
                q.get("crossGroupVsContiguousHeldOut", q.get("crossGroupVsContiguous", 1.0))
            ),
            dedup_cross_group_bytes=None if dedup is None else int(dedup),
            autoep_cross_group_bytes=None if autoep is None else int(autoep),
            counted_cross_group_bytes=None if counted is None else int(counted),
            counted_steps=since.get("steps"),
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


def _kib(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024:,.1f} KiB"


def _placement(job: PlanBytes) -> str:
    if job.routing_stats_from:
        return f"{job.strategy} (from {job.routing_stats_from}'s routing)"
    return job.strategy


def comparison(first: PlanBytes, second: PlanBytes) -> list[str]:
    """The side-by-side the demo prints: one row per figure, one column per job; then what job
    2's placement saves against contiguous placement (its plan), what its dispatcher saves against
    AutoEP (its plan) and what the trainers counted over both runs."""
    rows = [
        ("job", first.job, second.job),
        ("placement", _placement(first), _placement(second)),
        ("dispatcher", first.dispatcher, second.dispatcher),
        ("predicted on", first.basis, second.basis),
        ("cross-group bytes per step, forward + backward:", "", ""),
        (
            "  predicted, the job's dispatcher",
            _kib(first.predicted_cross_group_bytes),
            _kib(second.predicted_cross_group_bytes),
        ),
        (
            "  predicted, AutoEP, same tokens",
            _kib(first.autoep_cross_group_bytes),
            _kib(second.autoep_cross_group_bytes),
        ),
        (
            f"  counted by the trainers (mean of {second.counted_steps or '-'} steps)",
            _kib(first.counted_per_step),
            _kib(second.counted_per_step),
        ),
        (
            "load max/mean per GPU, job 1's tokens",
            f"{second.contiguous_max_mean_load:.3f}",
            f"{second.max_mean_load:.3f}",
        ),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    pct = 100 * abs(1 - second.vs_contiguous)
    load = (
        f"; load max/mean {second.max_mean_load:.3f}, contiguous "
        f"{second.contiguous_max_mean_load:.3f}: the planner keeps every GPU's load within "
        "its limit first, docs/placement.md"
    )
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
        lines.append(head + f"{pct:.1f}% less{load}), predicted by {source}")
    else:  # said as plainly as a saving: the placement found nothing to gain on these tokens
        head = f"no saving: {-second.saved_bytes:,} bytes per step more across NVLink groups "
        lines.append(head + f"({plan}, {pct:.1f}% more{load}), predicted by {source}")
    d, e = second.dedup_cross_group_bytes, second.autoep_cross_group_bytes
    if d and e:
        lines.append(
            f"dispatcher: de-duplicating {d:,} bytes per step across NVLink groups, AutoEP "
            f"{e:,} for the same tokens and layout ({d / e:.3f}x), predicted by {second.job}'s plan"
        )
    a, b = first.counted_cross_group_bytes, second.counted_cross_group_bytes
    if a and b:
        lines.append(
            f"counted: {b:,} bytes across NVLink groups in {second.counted_steps} steps of "
            f"{second.job}, {a:,} in {first.counted_steps} steps of {first.job} ({b / a:.3f}x; "
            "the trainers' byte counters, moe.allToAllBytesSinceStart of each job's progress; "
            "both jobs read the same tokens, the ones job 2 was planned from)"
        )
    return lines


def result(first: PlanBytes, second: PlanBytes) -> dict[str, Any]:
    """``closed_loop.json``: both jobs' figures, the saving of job 2's placement (bytes per
    optimizer step, its plan) and the counted ratio job 2 / job 1 over the run."""
    a, b = first.counted_cross_group_bytes, second.counted_cross_group_bytes
    return {
        "jobs": [asdict(first), asdict(second)],
        "savedCrossGroupBytesPerStep": second.saved_bytes,
        "crossGroupVsContiguous": round(second.vs_contiguous, 4),
        "crossGroupVsContiguousHeldOut": second.held_out_vs_contiguous,
        "countedCrossGroupJob2VsJob1": round(b / a, 4) if a and b else None,
        "source": "placement.quality of each job's plan ConfigMap (<job>-plan); counted: "
        "moe.allToAllBytesSinceStart of each job's progress ConfigMap (<job>-progress)",
    }


def write_result(work: Path, first: PlanBytes, second: PlanBytes) -> Path:
    path = work / RESULT_FILE
    path.write_text(json.dumps(result(first, second), indent=1) + "\n")
    return path


PLOT_FILE = "closed_loop.png"
_BARS = (
    ("predicted,\nthe job's dispatcher", "predicted_cross_group_bytes"),
    ("predicted,\nAutoEP, same tokens", "autoep_cross_group_bytes"),
    ("counted by the trainers,\nmean per step", "counted_per_step"),
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
        ax.bar(xs, kib, width, label=f"{job.job} ({job.strategy}, {job.dispatcher})")
    ax.set_xticks(range(len(_BARS)), [label for label, _ in _BARS], fontsize=8)
    ax.set_ylabel("KiB per step across NVLink groups (fwd + bwd)")
    ax.set_title("Bytes across NVLink groups: job 1 vs job 2 planned from its routing", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = work / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path
