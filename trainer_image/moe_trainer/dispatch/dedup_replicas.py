"""Replicated experts in the dedup dispatcher (``placement.replicas``, docs/dispatch.md).

A layout with ``holders[e]`` (EP ranks holding router expert ``e``, its AutoEP home first) and
``serve[p][e]`` (the holder that computes ``e`` for tokens of EP rank ``p``) routes every
(token, expert) to ``serve[p][e]`` instead of the home. Stage A/B and their de-duplication are
unchanged: only the ids change. Each id travels as a *virtual* id: ``0..E-1`` are the homes (the
AutoEP slots), ``E..`` one per (expert, extra holder), so the hub of stage B, which does not know
the token's source rank, still knows which rank and which local weights to use
(``v2r`` / ``v2l``). A rank's local experts are its ``E / P`` slots, then its copies, ordered by
(home rank, expert).

A copy is not a parameter. In the experts' forward (a class swap of AutoEP's `GroupedExperts`,
so ZeRO-3 has gathered the module's weights when it runs) each home sends the weights of its
replicated experts to their other holders in one all-to-all over the EP group (`_Sync`); its
backward sends the copies' weight gradients back and adds them into the home's gradient. So the
gradient of every expert is the sum over all its copies, exactly as if one copy had seen all its
tokens; copies are the home's weights by construction at every step; parameters, optimizer state,
checkpoints and exports hold one copy per expert in AutoEP's order, with no conversion, and a
checkpoint loads with or without copies. The price is the weight bytes of the copies, forward and
backward, per layer and micro step (`sync_counters`, by tier of the receiver, as the dispatch
`counters`); `sync_bytes` says how many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_contracts.dispatch import copy_sync_bytes
from moe_trainer.dispatch.dedup_ep import ByteCounters, DispatchError, Layout, Plan

sync_counters = ByteCounters()  # weight bytes of copies (forward) and their gradients (backward)


def check_replicas(layout: Layout, P: int) -> None:
    """``holders``/``serve`` (router ids) fit the layout: holders start at the home slot's rank,
    are distinct EP ranks, and every ``serve[p][e]`` is a holder of ``e``."""
    E = len(layout.expert2rank)
    hs, sv = layout.holders, layout.serve
    if hs is None or sv is None:
        raise DispatchError("replicated experts need both holders and serve")
    if len(hs) != E:
        raise DispatchError(f"holders has {len(hs)} rows, the layer has {E} experts")
    for e, h in enumerate(hs):
        if not h or h[0] != layout.expert2rank[e]:
            raise DispatchError(
                f"holders[{e}]: {list(h)!r} must start with the home rank {layout.expert2rank[e]}"
            )
        if len(set(h)) != len(h) or any(not 0 <= r < P for r in h):
            raise DispatchError(f"holders[{e}]: {list(h)!r} are not distinct EP ranks < {P}")
    if len(sv) != P or any(len(row) != E for row in sv):
        raise DispatchError(f"serve must be {P} rows of {E} ranks")
    for p, row in enumerate(sv):
        for e, r in enumerate(row):
            if r not in hs[e]:
                raise DispatchError(f"serve[{p}][{e}]: rank {r} holds no copy of expert {e}")


def plan_layouts(layout: Layout, replicas, permutation) -> list[Layout]:
    """One layout per MoE layer from the plan's ``placement.replicas`` (original expert ids) and
    ``permutation`` (``[layer][slot]`` = original expert; the router's id is the slot)."""
    import dataclasses

    if len(replicas) != len(permutation):
        raise DispatchError(
            f"placement.replicas: {len(replicas)} layers, the model has {len(permutation)}"
        )
    out = []
    for rep, row in zip(replicas, permutation, strict=True):
        out.append(
            dataclasses.replace(
                layout,
                holders=tuple(tuple(rep.holders[e]) for e in row),
                serve=tuple(tuple(srv[e] for e in row) for srv in rep.serve),
            )
        )
    return out


def relayouts(blocks, replicas, permutation) -> list:
    """The layouts :func:`relayout` would install (None for a layer without the dedup dispatcher),
    checked: every layout fits its layer, and a layer given copies runs AutoEP's `GroupedExperts`
    (or its copies' subclass). Raises DispatchError before anything changes."""
    import dataclasses

    from deepspeed.moe.ep_experts import GroupedExperts

    plans = [getattr(b, "dedup_plan", None) for b in blocks]
    if not any(p is not None for p in plans):
        if replicas is not None and any(len(h) > 1 for r in replicas for h in r.holders):
            raise DispatchError("placement.replicas: no layer runs the dedup dispatcher")
        return [None] * len(blocks)
    base = next(p for p in plans if p is not None).layout
    layouts = [dataclasses.replace(base, holders=None, serve=None)] * len(blocks)
    if replicas is not None:
        layouts = plan_layouts(layouts[0], replicas, permutation)
    out = []
    for block, old, layout in zip(blocks, plans, layouts, strict=True):
        if old is None:
            out.append(None)
            continue
        layout.check(old.P, len(layout.expert2rank), block.num_local_experts)
        kind = type(block.experts)
        if copies_of(layout) and kind is not GroupedExperts and kind is not _CLASS:
            raise DispatchError(
                f"placement.replicas: copies run AutoEP's GroupedExperts, this layer has "
                f"{kind.__name__}"
            )
        out.append(layout)
    return out


def relayout(blocks, replicas, permutation) -> None:
    """Re-placement during a job: every installed dedup layer's copies become ``replicas`` (the
    plan's convention, original ids; None: one copy per expert) under ``permutation``. The dispatch
    groups stay (the ranks do not change), so no process group is created; the layouts are checked
    (:func:`relayouts`) before any layer changes. Every rank calls it alike."""
    from moe_trainer.dispatch.dedup_ep import Plan

    layouts = relayouts(blocks, replicas, permutation)
    for block, layout in zip(blocks, layouts, strict=True):
        if layout is None:
            continue
        old = block.dedup_plan
        block.dedup_plan = Plan(
            layout, old.me, old.ep_group, old.rail_group, old.group_group, old.e2r.device
        )
        install_experts(block)


def serve_table(blocks) -> list[list[list[int]]] | None:
    """``[L][P][E]``: the EP rank serving each router expert to tokens of each EP rank, for
    `moe_contracts.dispatch.tier_bytes`; None when no installed layer has copies."""
    plans = [getattr(b, "dedup_plan", None) for b in blocks]
    if not any(p is not None and p.layout.serve is not None for p in plans):
        return None
    out = []
    for p in plans:
        assert p is not None
        lay = p.layout
        out.append([list(r) for r in lay.serve] if lay.serve else [list(lay.expert2rank)] * p.P)
    return out


def refuse_copies(replicas) -> None:
    """The plan's copies would not be served (AutoEP's own all-to-all): refuse them."""
    if replicas is not None and any(len(h) > 1 for r in replicas for h in r.holders):
        raise DispatchError(
            "placement.replicas: only the dedup dispatcher on AutoEP layers with EP > 1 serves "
            "expert copies; this plan runs AutoEP's own all-to-all"
        )


def progress_tiers(blocks, per_rank: list[list[float]], col: int) -> dict[str, int] | None:
    """Progress ``moe.replicaSyncBytesPerStepByTier``: the copies' weight bytes of the step,
    summed over ranks (columns ``col..col+2`` of the per-rank vectors); None without copies."""
    if serve_table(blocks) is None:
        return None
    return {t: int(sum(r[col + i] for r in per_rank)) for i, t in enumerate(ByteCounters.TIERS)}


def copies_of(layout: Layout) -> list[tuple[int, int, int]]:
    """Every extra copy as (holder, home, router expert), sorted: a holder's local copy order."""
    hs = layout.holders or ()
    return sorted((h, hold[0], e) for e, hold in enumerate(hs) for h in hold[1:])


def sync_bytes(layout: Layout, row_bytes: int) -> dict[str, int]:
    """Weight bytes one forward + backward of the layer moves for its copies, summed over the EP
    group, by tier (``row_bytes``: one expert's w1 + w2 + w3; the rule is the contract's
    ``copy_sync_bytes``, the planner's too)."""
    out = dict.fromkeys(ByteCounters.TIERS, 0)
    for h, home, _e in copies_of(layout):
        for t, n in copy_sync_bytes(
            h, home, layout.tier_group, layout.tier_node, row_bytes
        ).items():
            out[t] += n
    return out


@dataclass
class Replicas:
    """One rank's tables for a layout with copies (built by `dedup_ep.Plan`)."""

    plan: Plan
    vid: torch.Tensor  # [E] router id -> virtual id serving this rank's tokens
    v2r: torch.Tensor  # [V] virtual id -> EP rank
    v2l: torch.Tensor  # [V] virtual id -> local expert index on that rank
    num_experts: int
    num_home: int  # E / P
    num_copies: int  # copies this rank holds
    send_idx: torch.Tensor  # local home indices whose weights this rank sends, peer-major
    send: list[int]  # rows to each EP rank
    recv: list[int]  # rows from each EP rank

    @classmethod
    def of(cls, plan: Plan, device: torch.device) -> Replicas | None:
        lay: Layout = plan.layout
        copies = copies_of(lay)
        if not copies:
            return None
        E, P, me = len(lay.expert2rank), plan.P, plan.me
        assert lay.holders is not None and lay.serve is not None
        v2r, v2l = list(lay.expert2rank), list(lay.expert2local)
        n = E // P
        held = [0] * P
        vid_of: dict[tuple[int, int], int] = {}
        for h, _home, e in copies:
            vid_of[e, h] = len(v2r)
            v2r.append(h)
            v2l.append(n + held[h])
            held[h] += 1
        row = lay.serve[me]
        vid = [e if row[e] == lay.holders[e][0] else vid_of[e, row[e]] for e in range(E)]
        mine = [(h, e) for h, home, e in copies if home == me]  # sorted by holder, then expert
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            plan,
            t(vid),
            t(v2r),
            t(v2l),
            E,
            n,
            held[me],
            t([lay.expert2local[e] for _h, e in mine]),
            [sum(1 for h, _e in mine if h == d) for d in range(P)],
            [sum(1 for h, home, _e in copies if h == me and home == s) for s in range(P)],
        )

    def home_assigned(self, sel: torch.Tensor, dest_rank: torch.Tensor) -> torch.Tensor:
        """Assignments of ``sel[T, K]`` (virtual ids) to each rank's home experts."""
        home = (sel < self.num_experts).reshape(-1).long()
        return torch.zeros(self.plan.P, dtype=torch.long, device=sel.device).scatter_add_(
            0, dest_rank.reshape(-1), home
        )

    def run(self, experts, inp: torch.Tensor, local_counts: torch.Tensor, home_rows: int):
        """Expert outputs of ``inp`` (rows sorted by local expert; the first ``home_rows`` for the
        home slots, the rest for the copies), through `ReplicaExperts`."""
        from deepspeed.module_inject.auto_ep_layer import (
            permute_by_local_expert,
            unpermute_by_local_expert,
        )

        n = self.num_home
        ph, perm_h, ah, nh = permute_by_local_expert(inp[:home_rows], local_counts[:n])
        pc = perm_c = ac = None
        nc = 0
        if self.num_copies:
            pc, perm_c, ac, nc = permute_by_local_expert(inp[home_rows:], local_counts[n:])
        y = experts(ph, ah, pc, ac)  # one tensor: home rows, then copy rows
        out = unpermute_by_local_expert(y[: ph.shape[0]], perm_h, nh)
        if pc is None:
            return out
        return torch.cat([out, unpermute_by_local_expert(y[ph.shape[0] :], perm_c, nc)])


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], rep: Replicas) -> torch.Tensor:
    """All-to-all of weight rows over the EP group, counted in `sync_counters` (plain
    torch.distributed: not in the token all-to-all counters `commtime` keeps)."""
    import torch.distributed as dist

    plan = rep.plan
    x = x.contiguous()
    sync_counters.add(
        plan.tier_bytes(list(range(plan.P)), send, x.element_size() * math.prod(x.shape[1:]))
    )
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(
        out, x, output_split_sizes=recv, input_split_sizes=send, group=plan.ep_group
    )
    return out


class _Sync(torch.autograd.Function):
    """Home weights -> copies (forward); copies' gradients summed into the home's (backward)."""

    @staticmethod
    def forward(ctx, rep: Replicas, w1, w2, w3):
        n = w1.shape[0]
        ws = (w1, w2, w3)
        ctx.rep, ctx.n, ctx.dtype = rep, n, w1.dtype
        ctx.sizes = [math.prod(w.shape[1:]) for w in ws]
        ctx.shapes = [tuple(w.shape[1:]) for w in ws]
        flat = torch.cat([w.detach().reshape(n, -1) for w in ws], 1).index_select(0, rep.send_idx)
        got = _exchange(flat, rep.send, rep.recv, rep)
        return tuple(
            part.reshape(part.shape[0], *shape)
            for part, shape in zip(got.split(ctx.sizes, 1), ctx.shapes, strict=True)
        )

    @staticmethod
    def backward(ctx, g1, g2, g3):
        rep, n = ctx.rep, ctx.n
        c = rep.num_copies
        gs = [
            g.reshape(c, s)
            if g is not None
            else torch.zeros(c, s, dtype=ctx.dtype, device=rep.send_idx.device)
            for g, s in zip((g1, g2, g3), ctx.sizes, strict=True)
        ]
        back = _exchange(torch.cat(gs, 1), rep.recv, rep.send, rep)
        full = back.new_zeros(n, back.shape[1]).index_add_(0, rep.send_idx, back)
        parts = zip(full.split(ctx.sizes, 1), ctx.shapes, strict=True)
        return (None, *(part.reshape(n, *shape) for part, shape in parts))


def _grouped(mod, w1, w2, w3, x, counts):
    """`GroupedExperts.forward`'s computation on other weights (the copies)."""
    from deepspeed.moe import ep_experts as X

    act = (mod.activation, mod.activation_alpha, mod.activation_limit)
    if mod.use_triton_grouped_mm:
        return X._run_experts_triton_grouped_mm(w1, w2, w3, x, counts, *act)
    if mod.use_grouped_mm:
        if mod.gate_up_impl == "fused":
            return X._run_experts_grouped_mm_fused_gate_up(w1, w2, w3, x, counts, *act)
        return X._run_experts_grouped_mm(w1, w2, w3, x, counts, *act)
    return X._run_experts_for_loop(w1, w2, w3, x, counts, *act)


def _experts_class():
    from deepspeed.moe.ep_experts import GroupedExperts

    class ReplicaExperts(GroupedExperts):
        """`GroupedExperts` that also computes the copies this rank holds. Same parameters and
        state dict; the weight sync runs inside this module's forward, where ZeRO-3 has gathered
        them. Every rank of the EP group calls it once per layer forward (a collective)."""

        replicas: Replicas | None = None

        def forward(self, x, counts, x_copy=None, counts_copy=None):  # type: ignore[override]
            out = super().forward(x, counts)
            rep = self.replicas
            assert rep is not None
            c1, c2, c3 = _Sync.apply(rep, self.w1, self.w2, self.w3)
            # an empty slice ties the copies into the graph on every rank, so the backward's
            # all-to-all runs everywhere even where no token used a copy
            tie = sum(c.reshape(-1)[:0].sum() for c in (c1, c2, c3))
            out = out + tie.to(out.dtype)
            # one output tensor on every rank: ZeRO-3 traces a module's backward fetches per
            # output tensor and checks that every rank traced the same
            if x_copy is None:
                return out
            return torch.cat([out, _grouped(self, c1, c2, c3, x_copy, counts_copy)])

    return ReplicaExperts


_CLASS = None


def install_experts(block) -> None:
    """Swap ``block.experts`` (AutoEP's `GroupedExperts`) to `ReplicaExperts` with the block's
    dedup plan's copies; a plan without copies gets `GroupedExperts` back."""
    from deepspeed.moe.ep_experts import GroupedExperts

    global _CLASS
    if block.dedup_plan.replicas is None:
        if _CLASS is not None and type(block.experts) is _CLASS:
            block.experts.__class__ = GroupedExperts
        return
    if _CLASS is None:
        _CLASS = _experts_class()
    if type(block.experts) not in (GroupedExperts, _CLASS):
        raise DispatchError(
            f"placement.replicas: copies run AutoEP's GroupedExperts, this layer has "
            f"{type(block.experts).__name__}"
        )
    block.experts.__class__ = _CLASS
    block.experts.replicas = block.dedup_plan.replicas
