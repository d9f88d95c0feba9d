"""What a re-placement decision (:mod:`.replan`) needs of the plan, read once: the solver's
settings, the model's sizes, the job's tokens per step, the plan's topology (:func:`plan_topology`),
its copy budget (:mod:`.replan_copies`) and the baseline its own prediction sets
(:func:`inputs_from_plan`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moe_contracts.dispatch import dedup_row_bytes
from moe_contracts.plan import MoEPlan, RankSpec

from . import replan_copies as rc
from .models import spec_from_hf_config
from .topology import ClusterTopology


@dataclass(frozen=True)
class ReplanInputs:
    """What a re-plan needs of the plan (``MoEPlan`` v1), read once by :func:`inputs_from_plan`."""

    strategy: str
    ep_size: int
    seed: int
    n_group: int
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    bytes_per_elem: int
    tokens_per_step: int
    topology: ClusterTopology
    copies: rc.Budget | None  # the plan's extra copies of hot experts (None: one per expert)
    dispatcher: str  # "dedup" | "autoep" (AutoEP's all-to-all: the same bytes for any placement)
    baseline: int | None  # the plan's predicted cross-group bytes per step (routing statistics)

    @property
    def per_send(self) -> float:
        return per_send(self.hidden_size * self.bytes_per_elem, self.top_k)


def per_send(hidden_bytes: int, top_k: int) -> float:
    """Counted bytes per cost-model byte: what one dispatcher send moves in a step (forward +
    backward, id/weight columns) over the cost model's dispatch + combine activations."""
    return dedup_row_bytes(hidden_bytes, top_k) / (2 * hidden_bytes)


def plan_topology(ranks: Sequence[RankSpec]) -> ClusterTopology:
    """``MoEPlan.ranks`` -> a topology with GPU ``g`` = rank ``g`` (its node and NVLink group).
    NVLink bandwidth is a placeholder (1 where the group has another GPU): the decision reads
    bytes, not seconds. Raises ValueError for ranks without an NVLink group."""
    nodes: dict[str, int] = {}
    groups: dict[int, int] = {}
    node_of, group_of = [], []
    for r in ranks:
        if r.group is None:
            raise ValueError(f"ranks[{r.rank}].group: the plan records no NVLink group")
        node_of.append(nodes.setdefault(r.node, len(nodes)))
        group_of.append(groups.setdefault(r.group, len(groups)))
    g = np.array(group_of, dtype=np.int64)
    sizes = np.bincount(g) if len(g) else np.zeros(0, dtype=np.int64)
    return ClusterTopology(
        tuple(nodes),
        tuple((r.node, i) for i, r in enumerate(ranks)),
        np.array(node_of, dtype=np.int64),
        g,
        np.where(sizes[g] > 1, 1.0, 0.0) if len(g) else np.zeros(0),
    )


def inputs_from_plan(plan: MoEPlan) -> ReplanInputs:
    """The re-plan inputs of a parsed plan. Raises ValueError (or DocumentError for its model
    config) for a plan without what a re-plan needs."""
    pl = plan.placement
    if pl is None:
        raise ValueError("placement: the plan has none")
    if plan.model.hf_config is None:
        raise ValueError("model.hfConfig: the plan has none")
    spec = spec_from_hf_config(plan.model.hf_config, "MoEPlan model.hfConfig")
    ds = plan.deepspeed
    half = any((ds.get(k) or {}).get("enabled") for k in ("bf16", "fp16"))
    bytes_per_elem = 2 if half else 4
    batch = ds.get("train_batch_size")
    inputs = ReplanInputs(
        strategy=pl.strategy,
        ep_size=plan.ep_size,
        seed=plan.training.seed,
        n_group=int(spec.router_groups),
        num_layers=pl.num_layers,
        num_experts=pl.num_experts,
        top_k=int(spec.top_k),
        hidden_size=int(spec.hidden_size),
        bytes_per_elem=bytes_per_elem,
        tokens_per_step=(batch if isinstance(batch, int) else 1) * plan.training.seq_len,
        topology=plan_topology(plan.ranks),
        copies=rc.budget(pl, spec.expert_params() * bytes_per_elem, _micro_steps(ds))
        if pl.replicas
        else None,
        dispatcher=pl.dispatcher,
        baseline=None,
    )
    # the baseline in the counters' measure: the inputs' own per_send factor, not a second one
    return replace(
        inputs, baseline=_plan_baseline(pl.quality or {}, pl.dispatcher, inputs.per_send)
    )


def _micro_steps(ds: dict[str, Any]) -> int:
    steps = ds.get("gradient_accumulation_steps")
    return steps if isinstance(steps, int) and steps > 0 else 1


def _plan_baseline(quality: dict[str, Any], dispatcher: str, factor: float) -> int | None:
    """The plan's predicted cross-group bytes per step in the counters' measure: its exact
    ``quality.dispatch`` figure when it has one, else the cost model's times ``factor``; None
    for a plan made without routing statistics (nothing predicted from the run's routing)."""
    if quality.get("basis") != "routingStats":
        return None
    net = ((quality.get("replicas") or {}).get("netCrossGroupBytesPerStep") or {}).get("withCopies")
    chosen = (quality.get("replicas") or {}).get("chosen")
    if chosen and isinstance(net, (int, float)) and not isinstance(net, bool):
        return round(net)  # the copies' token bytes and their weight sync (replan_copies)
    exact = ((quality.get("dispatch") or {}).get(dispatcher) or {}).get("crossGroupBytesPerStep")
    if isinstance(exact, (int, float)) and not isinstance(exact, bool):
        return round(exact)
    value = quality.get("crossGroupBytesPerStep")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return round(value * factor)
