"""``moectl plan``'s summary of a plan: devices, NVLink groups, EP size, placement quality,
dispatch bytes, batch, the memory breakdown and the planner's speed choices."""

from __future__ import annotations

from typing import Any

from .plan_document import Plan
from .plan_steps import HEADROOM
from .topology import ClusterTopology


def _group_label(topo: ClusterTopology, grp: list[int]) -> str:
    """``node[0-7]`` / ``node[0,2]``: one NVLink group by node and local GPU indices."""
    node, local = topo.gpus[grp[0]][0], sorted(topo.gpus[g][1] for g in grp)
    if len(local) > 2 and local == list(range(local[0], local[-1] + 1)):
        return f"{node}[{local[0]}-{local[-1]}]"
    return f"{node}[{','.join(map(str, local))}]"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _strategy_line(plan: Plan) -> str:
    """The layout the plan has: a strategy that needed routing statistics and had none says so."""
    asked = str(plan.document["placement"]["strategy"])
    if plan.placement.fell_back:
        return (
            f"{plan.document['placement']['fellBackTo']} "
            f"({asked} without routing statistics: pass --stats)"
        )
    return asked


def _dispatch_line(pl: dict[str, Any]) -> str:
    """``dispatch   dedup; MiB/step fwd+bwd (..): dedup .. | AutoEP ..`` (core.dispatch)."""
    q = pl["quality"].get("dispatch") or {}
    chosen = pl.get("dispatcher", "autoep")
    if "dedup" not in q:
        return f"dispatch   {chosen} (bytes by tier: {q.get('basis', 'n/a')})"

    def fmt(d: dict[str, Any]) -> str:
        return (
            f"cross-group {d['crossGroupBytesPerStep'] / 2**20:.1f}, intra-group "
            f"{d['intraGroupBytesPerStep'] / 2**20:.1f}, cross-node "
            f"{d['crossNodeBytesPerStep'] / 2**20:.1f}"
        )

    return (
        f"dispatch   {chosen}; MiB/step fwd+bwd ({q['basis']}): dedup {fmt(q['dedup'])} | "
        f"AutoEP {fmt(q['autoep'])}"
    )


def _replicas_line(q: dict[str, Any]) -> str | None:
    """``replicas   ..``: the replicas choice and its reason (absent: the job did not ask)."""
    r = q.get("replicas")
    if r is None:
        return None
    if not r["chosen"]:
        return f"replicas   {r['mode']}: none ({r['reason']})"
    b, load = r["crossGroupBytesPerStep"], r["loadMaxOverMean"]
    return (
        f"replicas   {r['mode']}: {r['reason']}, {r['copiesPerRankPerLayer']} per rank and layer "
        f"at most (+{r['memoryOverheadFraction']:.1%} expert memory): dedup cross-group "
        f"{b['withCopies'] / 2**20:.1f} MiB/step (without copies {b['withoutCopies'] / 2**20:.1f}),"
        f" max/mean load {load['withCopies']:.2f} (without {load['withoutCopies']:.2f}; "
        f"{r['basis']})"
    )


def summarize(plan: Plan) -> str:
    """A readable summary for ``moectl plan``."""
    d, topo = plan.document, plan.topology
    q = d["placement"]["quality"]
    groups = [_group_label(topo, grp) for grp in topo.groups()]
    lines = [
        (
            f"job        {d['job']['namespace']}/{d['job']['name']}  "
            f"model {d['model']['preset'] or d['model']['path']} ({d['model']['family']})"
        ),
        (
            f"device     {d['device']} ({plan.gpu.name}), world size {d['worldSize']}, "
            f"nodes {', '.join(topo.nodes)}"
        ),
        "NVLink     "
        + (
            " ".join(groups)
            if d["device"] == "cuda"
            else "n/a (CPU: one shared-memory group per node)"
        ),
        (
            f"EP size    {d['epSize']} "
            f"({_count(d['placement']['numExperts'] // d['epSize'], 'expert')} per "
            f"rank), AutoEP {'on' if d['deepspeed'].get('expert_parallel') else 'off'}"
        ),
        f"placement  {_strategy_line(plan)}: cross-group {q['crossGroupBytesPerStep'] / 2**20:.1f}"
        f" MiB/step ({q.get('crossGroupVsContiguous', 1.0):.2f}x contiguous"
        + (
            f", ~{q['crossGroupVsContiguousHeldOut']:.2f}x expected on new tokens"
            if q.get("crossGroupVsContiguousHeldOut", q.get("crossGroupVsContiguous"))
            != q.get("crossGroupVsContiguous")
            else ""
        )
        + "), cross-node "
        f"{q['crossNodeBytesPerStep'] / 2**20:.1f} MiB/step, max/mean load "
        f"{q['maxMeanLoad']:.2f} ({q['basis']} routing"
        + (
            ", LOWER BOUND: top-k > 2 scored without token samples)"
            if q.get("estimate") == "lowerBound"
            else ")"
        ),
        _dispatch_line(d["placement"]),
        *filter(None, [_replicas_line(q)]),
        (
            f"batch      global {d['deepspeed']['train_batch_size']} = micro "
            f"{d['training']['microBatch']} x accum {d['training']['gradAccum']} x {d['worldSize']}"
            f", seq {d['training']['seqLen']}"
        ),
        "memory per " + ("process" if d["device"] == "cpu" else "GPU") + ":",
        plan.memory.explain(d["memory"]["gpuMemoryBytes"] or None, HEADROOM),
    ]
    perf = d["training"].get("performance")
    lines.append(
        f"MoE impl   {d['training'].get('moeImpl', 'hf')}; performance options "
        + ("(planner's choice, why):" if perf else "off (stock configuration)")
    )
    lines += [f"  - {r}" for r in (perf or {}).get("reasons", [])]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
