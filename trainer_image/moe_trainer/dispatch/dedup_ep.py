"""`DedupEP`: a de-duplicating, two-stage expert-parallel dispatcher for AutoEP layers.

DeepSpeed 0.19.8's AutoEP (`AutoEPMoELayer._forward`) sends one row per (token, expert)
assignment, so what crosses a slow link does not depend on where experts live. This dispatcher
sends a token once per remote NVLink group (stage A) and once per rank inside a group (stage B),
and sums partial outputs before they travel back, so a placement that keeps co-activated experts
together cuts the bytes on the slow tier.

EP ranks form G groups of R ranks (a group is an NVLink group, or a node). Per MoE layer:

  counts   one all_gather over the EP group of each rank's de-duplicated counts
           (``[P ranks hit | P assignments | G groups hit]``): every rank derives both stages'
           split sizes from it, one device-to-host copy per layer, as AutoEP.
  stage A  over the *rail* of the source (ranks with the same index in every group, as in
           DeepSeek-V3): one row per (token, group it needs), carrying the hidden state, the
           token's K expert ids (-1 where the expert is in another group) and K router weights.
           The row for the source's own group stays on the source.
  stage B  inside the group: each row fans out once to every rank holding one of its experts,
           ids masked to that rank's experts.
  experts  one grouped GEMM input row per (row, local expert); score_apply "pre" scales inputs,
           "post" outputs; partial sums per arriving row (fp32).
  combine  stage B back, summed per stage-A row (per token and group: the pre-reduce), stage A
           back, summed per token at the source.

All of it is autograd (the all-to-alls' backward is the reverse all-to-all; router weights travel
as a differentiable tensor, so router gradients flow), and deterministic, so an activation
checkpoint recompute repeats it exactly. R = 1 (each rank its own group) is the flat per-rank
de-duplication; G = 1 (one NVSwitch node) is a flat de-duplication inside the group with no
stage-A traffic.

Expert ids are the router's output ids (AutoEP slots): ``expert2rank[E]`` and ``expert2local[E]``
say where each one lives, so a layout only has to agree with which experts each rank's
`GroupedExperts` holds (AutoEP: slot ``s`` on rank ``s // E_local``).

`counters` holds the bytes sent to other ranks, by tier of the destination (``intraGroup``,
``crossGroup``; ``crossNode`` is the part of ``crossGroup`` that leaves the node), forward and
backward, including the id/weight columns: the measured side of `core.cost.dedup_bytes`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

ID_BYTES = 4  # int32 expert ids per stage-A/B row
WEIGHT_BYTES = 4  # fp32 router weights per stage-A/B row


class DispatchError(ValueError):
    """The dispatcher's layout does not fit the EP group."""


class ByteCounters:
    """Bytes this rank sent to other ranks through the dispatcher, by tier of the receiver."""

    TIERS = ("intraGroup", "crossGroup", "crossNode")

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = dict.fromkeys(self.TIERS, 0)

    def add(self, tier_bytes: dict[str, int]) -> None:
        with self._lock:
            for k, v in tier_bytes.items():
                self.bytes[k] += int(v)

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self.bytes = self.bytes, dict.fromkeys(self.TIERS, 0)
        return out


counters = ByteCounters()


@dataclass(frozen=True)
class Layout:
    """Where experts live and how the P ranks of one EP group form G groups of R.

    ``expert2rank[E]`` / ``expert2local[E]``: EP rank and local index of each router expert id;
    ``group_ranks[G][R]``: EP ranks of each group (rail ``i`` = ``group_ranks[g][i]`` over g);
    ``tier_group[P]`` / ``tier_node[P]``: the real NVLink group and node of each EP rank, for the
    counters (equal to the dispatch groups unless the dispatcher was told to run flat).
    """

    expert2rank: tuple[int, ...]
    expert2local: tuple[int, ...]
    group_ranks: tuple[tuple[int, ...], ...]
    tier_group: tuple[int, ...]
    tier_node: tuple[int, ...]
    # replicated experts (`moe_trainer.dispatch.dedup_replicas`), by router id: holders[E] (home
    # first), serve[P][E]; None: one copy per expert
    holders: tuple[tuple[int, ...], ...] | None = None
    serve: tuple[tuple[int, ...], ...] | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.tier_group)

    def check(self, ep_size: int, num_experts: int, num_local_experts: int) -> Layout:
        P = ep_size
        if len(self.expert2rank) != num_experts or len(self.expert2local) != num_experts:
            raise DispatchError(
                f"expert2rank/expert2local have {len(self.expert2rank)}/{len(self.expert2local)} "
                f"entries, the layer has {num_experts} experts"
            )
        seen = set(zip(self.expert2rank, self.expert2local, strict=True))
        want = {(r, j) for r in range(P) for j in range(num_local_experts)}
        if seen != want:
            raise DispatchError(
                f"expert2rank/expert2local do not give every EP rank of {P} exactly "
                f"{num_local_experts} local experts"
            )
        flat = sorted(r for g in self.group_ranks for r in g)
        if flat != list(range(P)) or len({len(g) for g in self.group_ranks}) != 1:
            raise DispatchError(
                f"group_ranks {self.group_ranks!r} must split EP ranks 0..{P - 1} into "
                "groups of equal size"
            )
        if len(self.tier_group) != P or len(self.tier_node) != P:
            raise DispatchError(f"tier_group/tier_node need {P} entries")
        if self.holders is not None or self.serve is not None:
            from moe_trainer.dispatch.dedup_replicas import check_replicas

            check_replicas(self, P)
        return self


def contiguous_layout(
    num_experts: int,
    ep_size: int,
    rank_group: list[int] | None = None,
    rank_node: list[int] | None = None,
    flat: bool = False,
) -> Layout:
    """AutoEP's slot layout (slot ``s`` on EP rank ``s // E_local``) with dispatch groups from
    ``rank_group[P]`` (EP rank -> NVLink group id). Unequal groups, or ``flat``, run R = 1."""
    n = num_experts // ep_size
    rank_group = list(range(ep_size)) if rank_group is None else list(rank_group)
    rank_node = list(rank_group) if rank_node is None else list(rank_node)
    ids = sorted(set(rank_group), key=rank_group.index)
    groups = [tuple(r for r in range(ep_size) if rank_group[r] == g) for g in ids]
    if flat or len({len(g) for g in groups}) != 1:
        groups = [(r,) for r in range(ep_size)]
    dense = [ids.index(g) for g in rank_group]
    node_ids = sorted(set(rank_node), key=rank_node.index)
    return Layout(
        tuple(e // n for e in range(num_experts)),
        tuple(e % n for e in range(num_experts)),
        tuple(groups),
        tuple(dense),
        tuple(node_ids.index(x) for x in rank_node),
    )


class Plan:
    """One EP group's process groups and tables for a `Layout`, on one rank."""

    def __init__(
        self, layout: Layout, ep_rank: int, ep_group, rail_group, group_group, device: torch.device
    ):
        self.layout, self.ep_group = layout, ep_group
        self.me = ep_rank
        G, R = len(layout.group_ranks), len(layout.group_ranks[0])
        self.G, self.R, self.P = G, R, layout.num_ranks
        self.group_of = [0] * self.P
        self.local_of = [0] * self.P
        for g, ranks in enumerate(layout.group_ranks):
            for i, r in enumerate(ranks):
                self.group_of[r], self.local_of[r] = g, i
        self.my_group, self.my_local = self.group_of[ep_rank], self.local_of[ep_rank]
        self.rail_ranks = [
            layout.group_ranks[g][self.my_local] for g in range(G)
        ]  # rail peers, group order
        self.group_members = list(layout.group_ranks[self.my_group])  # my group, local order
        self.rail_group, self.group_group = rail_group, group_group
        self.e2r = torch.tensor(layout.expert2rank, dtype=torch.long, device=device)
        self.e2l = torch.tensor(layout.expert2local, dtype=torch.long, device=device)
        self.r2g = torch.tensor(self.group_of, dtype=torch.long, device=device)
        self.r2local = torch.tensor(self.local_of, dtype=torch.long, device=device)
        self.replicas = None  # `dedup_replicas.Replicas` when the layout has copies
        if layout.serve is not None:
            from moe_trainer.dispatch.dedup_replicas import Replicas

            self.replicas = Replicas.of(self, device)
            if self.replicas is not None:  # ids travel as virtual ids: homes, then copies
                self.e2r, self.e2l = self.replicas.v2r, self.replicas.v2l

    def tier_bytes(self, peers: list[int], splits: list[int], row_bytes: int) -> dict[str, int]:
        out = dict.fromkeys(ByteCounters.TIERS, 0)
        lay = self.layout
        for peer, n in zip(peers, splits, strict=True):
            if peer == self.me or not n:
                continue
            if lay.tier_group[peer] == lay.tier_group[self.me]:
                out["intraGroup"] += n * row_bytes
            else:
                out["crossGroup"] += n * row_bytes
                if lay.tier_node[peer] != lay.tier_node[self.me]:
                    out["crossNode"] += n * row_bytes
        return out


def _all_to_all(
    x: torch.Tensor, send: list[int], recv: list[int], group, plan: Plan, peers: list[int]
) -> torch.Tensor:
    """Variable-split all-to-all of rows of ``x`` over ``group`` (ranks ``peers``), counted."""
    import deepspeed.comm as dscomm

    x = x.contiguous()
    row = x.element_size() * math.prod(x.shape[1:])
    counters.add(plan.tier_bytes(peers, send, row))
    if len(peers) == 1:
        return x.clone()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dscomm.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """Differentiable `_all_to_all`; the backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send, recv, group, plan, peers):
        ctx.args = (send, recv, group, plan, peers)
        return _all_to_all(x, send, recv, group, plan, peers)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, plan, peers = ctx.args
        return _all_to_all(grad, recv, send, group, plan, peers), None, None, None, None, None


def _nonzero(mask: torch.Tensor, size: int) -> torch.Tensor:
    """``nonzero`` whose size is already known from the counts: no device-to-host sync (plain
    ``nonzero``, which syncs, where a backend lacks ``nonzero_static``)."""
    try:
        return torch.nonzero_static(mask, size=size)
    except (NotImplementedError, RuntimeError):
        return torch.nonzero(mask)


def _local_counts(plan: Plan, sel: torch.Tensor):
    """``sel[T, K]`` -> (dest_group[T, K], hit_group[T, G], counts[2P + G]: tokens hitting each rank
    | assignments to each rank | tokens hitting each group; with copies, + P: assignments to each
    rank's home experts)."""
    T, K = sel.shape
    dev = sel.device
    dest_rank = plan.e2r[sel]
    dest_group = plan.r2g[dest_rank]
    hit_rank = torch.zeros(T, plan.P, dtype=torch.bool, device=dev).scatter_(1, dest_rank, True)
    hit_group = torch.zeros(T, plan.G, dtype=torch.bool, device=dev).scatter_(1, dest_group, True)
    assigned = torch.zeros(plan.P, dtype=torch.long, device=dev).scatter_add_(
        0, dest_rank.reshape(-1), torch.ones(T * K, dtype=torch.long, device=dev)
    )
    parts = [hit_rank.sum(0), assigned, hit_group.sum(0)]
    if plan.replicas is not None:
        parts.append(plan.replicas.home_assigned(sel, dest_rank))
    return dest_group, hit_group, torch.cat(parts)


def _stage_a_rows(sel, dest_group, hit_group, n: int):
    """One row per (token, group hit), group-major: (token[n], ids[n, K] with -1 outside the
    group)."""
    ga_t = _nonzero(hit_group.t(), n)  # [n, 2]: (group, token)
    tok = ga_t[:, 1]
    return tok, torch.where(dest_group[tok] == ga_t[:, :1], sel[tok], -1).to(torch.int32)


def _stage_b_rows(plan: Plan, ids_a: torch.Tensor, n: int):
    """One row per (stage-A row, local rank it needs), rank-major: (row[n], ids[n, K] masked to
    it)."""
    R = plan.R
    local_b = torch.where(
        ids_a >= 0, plan.r2local[plan.e2r[ids_a.long().clamp(min=0)]], R
    )  # [NA, K]
    hit_b = torch.zeros(ids_a.shape[0], R + 1, dtype=torch.bool, device=ids_a.device).scatter_(
        1, local_b, True
    )
    lr = _nonzero(hit_b[:, :R].t(), n)  # [n, 2]: (local rank, row)
    row = lr[:, 1]
    return row, torch.where(local_b[row] == lr[:, :1], ids_a[row], -1)


def _expert_rows(plan: Plan, ids_b: torch.Tensor, n: int, num_local_experts: int, counts_dtype):
    """One GEMM row per (arrived row, local expert), sorted by local expert: (row, k,
    counts[E_local])."""
    rk = _nonzero(ids_b >= 0, n)  # [n, 2]: (row, k)
    row, k = rk[:, 0], rk[:, 1]
    local = plan.e2l[ids_b[row, k].long()]
    order = torch.argsort(local, stable=True)
    row, k, local = row[order], k[order], local[order]
    local_counts = torch.zeros(
        num_local_experts, dtype=counts_dtype, device=ids_b.device
    ).scatter_add_(0, local, torch.ones_like(local, dtype=counts_dtype))
    return row, k, local_counts


def index_work(plan: Plan, selected: torch.Tensor):
    """The dedup path's extra per-layer work without collectives (benchmarks): the count vector, its
    one host copy, and the stage A / stage B / expert index building, with this rank's own rows
    standing in for what its peers would send."""
    sel = selected.long()
    P = plan.P
    if plan.replicas is not None:
        sel = plan.replicas.vid[sel]
    dest_group, hit_group, mine = _local_counts(plan, sel)
    counts = mine.cpu()
    _tok_a, ids_a = _stage_a_rows(
        sel, dest_group, hit_group, int(counts[2 * P : 2 * P + plan.G].sum())
    )
    _row_b, ids_b = _stage_b_rows(plan, ids_a, int(counts[:P].sum()))
    return _expert_rows(
        plan, ids_b, int(counts[P : 2 * P].sum()), plan_local_experts(plan), torch.int32
    )


def plan_local_experts(plan: Plan) -> int:
    """Experts this rank computes: its AutoEP slots, + the copies it holds."""
    n = len(plan.layout.expert2rank) // plan.P
    return n + (plan.replicas.num_copies if plan.replicas is not None else 0)


def route(
    plan: Plan,
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected: torch.Tensor,
    experts,
    num_local_experts: int,
    score_apply: str,
    counts_dtype: torch.dtype,
) -> torch.Tensor:
    """Dispatch ``x[T, H]`` to the experts picked in ``selected[T, K]`` with weights
    ``top_scores[T, K]``, run ``experts`` and combine; returns ``y[T, H]`` (= sum_k w_k f_k(x))."""
    import torch.distributed as dist
    from deepspeed.module_inject.auto_ep_layer import (
        permute_by_local_expert,
        unpermute_by_local_expert,
    )

    T, H = x.shape
    P, G, me = plan.P, plan.G, plan.me
    dev = x.device
    sel = selected.long()
    if plan.replicas is not None:  # router ids -> the copy that serves this rank's tokens
        sel = plan.replicas.vid[sel]
    dest_group, hit_group, mine = _local_counts(plan, sel)

    # ---- the one count exchange: counts[P, 2P + G] on the host
    if P > 1:
        parts = [torch.empty_like(mine) for _ in range(P)]
        dist.all_gather(parts, mine, group=plan.ep_group)
        counts = torch.stack(parts).cpu()
    else:
        counts = mine.reshape(1, -1).cpu()
    ranks_hit, assigned_to = counts[:, :P], counts[:, P : 2 * P]
    groups_hit = counts[:, 2 * P : 2 * P + G]

    # ---- stage A: one row per (token, group), over the rail
    rail = plan.rail_ranks
    send_a = [int(groups_hit[me, g]) for g in range(G)]
    recv_a = [int(groups_hit[rail[g], plan.my_group]) for g in range(G)]
    tok_a, ids_a = _stage_a_rows(sel, dest_group, hit_group, sum(send_a))
    x_a = _Exchange.apply(x.index_select(0, tok_a), send_a, recv_a, plan.rail_group, plan, rail)
    w_a = _Exchange.apply(
        top_scores.float().index_select(0, tok_a), send_a, recv_a, plan.rail_group, plan, rail
    )
    ids_a = _all_to_all(ids_a, send_a, recv_a, plan.rail_group, plan, rail)

    # ---- stage B: one row per (stage-A row, rank of this group it needs)
    members = plan.group_members
    send_b = [int(sum(ranks_hit[s, d] for s in rail)) for d in members]
    recv_b = [
        int(
            sum(
                ranks_hit[s, me]
                for s in [plan.layout.group_ranks[g][plan.local_of[m]] for g in range(G)]
            )
        )
        for m in members
    ]
    row_b, ids_b = _stage_b_rows(plan, ids_a, sum(send_b))
    x_b = _Exchange.apply(
        x_a.index_select(0, row_b), send_b, recv_b, plan.group_group, plan, members
    )
    w_b = _Exchange.apply(
        w_a.index_select(0, row_b), send_b, recv_b, plan.group_group, plan, members
    )
    ids_b = _all_to_all(ids_b, send_b, recv_b, plan.group_group, plan, members)

    # ---- experts: one GEMM row per (arrived row, local expert); partial sums per arrived row
    row, k, local_counts = _expert_rows(
        plan,
        ids_b,
        int(assigned_to[:, me].sum()),
        num_local_experts + (plan.replicas.num_copies if plan.replicas is not None else 0),
        counts_dtype,
    )
    inp = x_b.index_select(0, row)
    w = w_b[row, k].unsqueeze(1)  # [N, 1] fp32
    if score_apply == "pre":
        inp = (inp.float() * w).to(inp.dtype)
    if plan.replicas is None:
        permuted, perm, aligned, n = permute_by_local_expert(inp, local_counts)
        out = unpermute_by_local_expert(experts(permuted, aligned), perm, n).float()
    else:  # home rows first (sorted by local expert), then rows for the copies held here
        home_rows = int(counts[:, 2 * P + G + me].sum())
        out = plan.replicas.run(experts, inp, local_counts, home_rows).float()
    if score_apply == "post":
        out = out * w
    y_b = (
        torch.zeros(x_b.shape[0], H, dtype=torch.float32, device=dev)
        .index_add(0, row, out)
        .to(x.dtype)
    )

    # ---- combine: back through stage B, pre-reduce per (token, group), back through stage A
    y_b = _Exchange.apply(y_b, recv_b, send_b, plan.group_group, plan, members)
    y_a = torch.zeros(x_a.shape[0], H, dtype=torch.float32, device=dev).index_add(
        0, row_b, y_b.float()
    )
    y_a = _Exchange.apply(y_a.to(x.dtype), recv_a, send_a, plan.rail_group, plan, rail)
    return (
        torch.zeros(T, H, dtype=torch.float32, device=dev)
        .index_add(0, tok_a, y_a.float())
        .to(x.dtype)
    )


# ---------------------------------------------------------------- process groups and the layer


def ep_global_ranks(ep_group) -> list[int]:
    import torch.distributed as dist

    return (
        list(dist.get_process_group_ranks(ep_group))
        if ep_group is not None
        else list(range(dist.get_world_size()))
    )


_GROUPS: dict = {}


def make_groups(layout: Layout, ep_group) -> tuple:
    """(rail_group, group_group) for this rank: collective over the whole world, once per group
    shape (cached). EP groups must be consecutive global ranks (DeepSpeed's layout); every replica
    of the EP group gets its own rails and groups."""
    key = (layout.group_ranks, id(ep_group))
    if key not in _GROUPS:
        _GROUPS[key] = _new_groups(layout, ep_group)
    return _GROUPS[key]


def _new_groups(layout: Layout, ep_group) -> tuple:
    import torch.distributed as dist

    P, G = layout.num_ranks, len(layout.group_ranks)
    R = len(layout.group_ranks[0])
    ranks = ep_global_ranks(ep_group)
    world, me = dist.get_world_size(), dist.get_rank()
    if len(ranks) != P or ranks != list(range(ranks[0], ranks[0] + P)) or ranks[0] % P:
        raise DispatchError(f"EP group ranks {ranks} are not {P} consecutive global ranks")
    if G == 1:
        return None, ep_group
    if R == 1:
        return ep_group, None
    rail = group = None
    for base in range(0, world, P):
        for i in range(R):
            members = [base + layout.group_ranks[g][i] for g in range(G)]
            pg = dist.new_group(members)
            if me in members:
                rail = pg
        for g in range(G):
            members = [base + r for r in layout.group_ranks[g]]
            pg = dist.new_group(members)
            if me in members:
                group = pg
    return rail, group


def _layer_class():
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer, RouterOutput

    class DedupEPMoELayer(AutoEPMoELayer):
        """AutoEP layer whose EP > 1 forward goes through the `route` dispatcher. Parameters,
        their ZeRO-3 handling and the state dict are AutoEP's: only ``router`` and ``experts``
        are called, so checkpoints load either way."""

        dedup_plan: Plan | None = None

        def _forward(self, hidden_states):
            if self.ep_size == 1 or self.dedup_plan is None:
                return super()._forward(hidden_states)
            bsz, seqlen, hdim = hidden_states.shape
            x = hidden_states.reshape(-1, hdim)
            ro = RouterOutput(*self.router(x, self.expert_bias))
            with torch.no_grad():
                self.tokens_per_expert.add_(ro.num_tokens_per_expert)
            out = route(
                self.dedup_plan,
                x,
                ro.top_scores,
                ro.selected_experts,
                self.experts,
                self.num_local_experts,
                self.score_apply,
                ro.num_tokens_per_expert.dtype,
            )
            return self._finalize_output(out.reshape(bsz, seqlen, hdim), x, hidden_states, hdim)

    return DedupEPMoELayer


_CLASS = None


def layer_class():
    global _CLASS
    if _CLASS is None:
        _CLASS = _layer_class()
    return _CLASS


def install(blocks, layouts: list[Layout]) -> list:
    """Swap AutoEP layers ``blocks[l]`` to the dedup dispatcher with ``layouts[l]`` (one per
    layer). Collective (creates process groups): every rank calls it with the same layouts."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    if len(layouts) != len(blocks):
        raise DispatchError(f"{len(layouts)} layouts for {len(blocks)} MoE layers")
    cls = layer_class()
    for block, layout in zip(blocks, layouts, strict=True):
        if not isinstance(block, AutoEPMoELayer):
            import deepspeed

            raise DispatchError(
                f"dispatcher 'dedup' needs AutoEP layers, got {type(block).__name__}: AutoEP "
                f"was not applied to every MoE block (deepspeed {deepspeed.__version__})"
            )
        if block.ep_size == 1:
            continue
        if block.comm_backend != "comm" or block.folding_group_handles is not None:
            raise DispatchError(
                "dispatcher 'dedup' replaces AutoEP's default all-to-all path; it does not "
                "combine with comm_backend 'deepep' or folded tensor parallelism"
            )
        layout.check(block.ep_size, block.num_experts, block.num_local_experts)
        rail, group = make_groups(layout, block.ep_group)
        block.__class__ = cls
        block.dedup_plan = Plan(
            layout, block.ep_rank, block.ep_group, rail, group, block.router.gate.weight.device
        )
        from moe_trainer.dispatch.dedup_replicas import install_experts

        install_experts(block)  # copies' experts, or back to AutoEP's when the layer has none
    return blocks
