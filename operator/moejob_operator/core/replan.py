"""Re-placement during a job (``spec.placement.replan``; docs/placement.md "Re-placement during a
job"): the pure decisions. The reconcile step (``reconcile/replan.py``) reads the documents and
writes what these functions return.

:func:`decide` re-runs the planner's solver (``router_groups.solve``, the plan's strategy, seed,
EP size and rank order) on fresh routing statistics, predicts the cross-group bytes per step of
the running placement on them, scaled to the job's tokens per step, and what a re-fit saves on
tokens it was not fitted on (below). It switches only when the candidate's prediction is at
least ``min_gain_percent`` below the running placement's: a job whose routing does not drift
finds no saving held out and stays.

The predictions are in the measure of the trainer's byte counters (``moe.allToAllBytes*`` in
progress): the de-duplicating dispatcher's bytes forward AND backward with its id and weight
columns (:mod:`moe_contracts.dispatch`), exact on the statistics' token samples
(``core.dispatch``, the plan's ``quality.dispatch``); without samples, the cost model's sends
(``cost.score``, forward dispatch + combine activations: the solver's objective) times the bytes
a dispatcher row moves per send over the cost model's (``dedup_row_bytes / (2 x hidden bytes)``).
So a status figure can be read against what the trainers count.

The candidate may not balance a layer worse than staying: the solver's load tolerance is, per
layer, the plan's or the running layout's own excess on the fresh statistics, whichever is larger
(routing that drifted hot experts together leaves the running layout imbalanced; a candidate held
to the plan's tolerance would then have to spread them and send more than staying). And it takes
the solver's layout only in the layers where that sends less than the running one: a switch never
predicts more bytes in any layer.

The saving predicted is held out (:func:`_held_out_saving`): the solver also fits each of two
parts of the statistics' token sample (``routing.folds``: alternate steps, else the sample's
halves), and the saving is what each part's layout saves over the running one on the OTHER part,
per layer, the mean of the two; a layer is credited with the smaller of that and what the
window's layout saves on the window, and takes that layout where the credit is positive. On the
tokens it was fitted on, a heuristic's layout looks better than it is, and on a short window that
gap alone can clear the threshold; the ``after`` recorded is also the next decision's baseline
(below), which an in-sample figure would set too low. A token sample too small for two parts of
``routing.MIN_FOLD_TOKENS`` is no ground for a switch (Stay); statistics without a sample (counts
only) are scored in sample.

The solver is a heuristic: on other tokens of the same routing it can land on a layout that is
some percent better (or worse) than the one it found before, which is not drift. So the gain that
counts is capped by the drift: ``baseline`` is what the running placement was predicted to cost
when it was chosen (the plan's ``crossGroupBytesPerStep`` when the plan was made from routing
statistics, else the last switch's ``after``), and the candidate is credited with at most
``before - baseline``: only the rise since then can be won back. Without a baseline (a plan made
on uniform routing) the whole gain counts.

The topology is the plan's own (:func:`plan_topology`): one GPU per rank, in rank order, with the
rank's node and NVLink group from ``MoEPlan.ranks``. Cross-group and cross-node bytes need only
those; the gang keeps its GPUs (``rank2gpu``), only the permutation changes.

A plan with expert copies (``placement.replicas``) re-places them with the experts
(:mod:`.replan_copies`): a layout is then a permutation and its copies, fitted as the planner fits
them and scored on the net figure (token bytes + the copies' weight sync), within the plan's copy
budget; ``Decision.replicas`` are the copies to write.

:func:`fresh_stats` is the one seam for the trainer's windowed statistics: a RoutingStats
document may carry ``window``, a RoutingStats document of the steps since the previous
checkpoint; the decision prefers it and falls back to the whole run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moe_contracts.routing import RoutingStats, configmap_text, parse_routing_stats, window_stats

from . import cost, dispatch, router_groups, routing
from . import replan_copies as rc
from .placement import LOAD_TOLERANCE, Placement, strategies, tolerance_to_keep
from .replan_inputs import ReplanInputs as ReplanInputs
from .replan_inputs import inputs_from_plan as inputs_from_plan
from .replan_inputs import per_send as per_send
from .replan_inputs import plan_topology as plan_topology

WINDOW_KEY = "window"  # RoutingStats: the statistics since the previous checkpoint (optional)
HISTORY_LIMIT = 20  # status.placementHistory keeps the last this many switches
SWITCH, STAY = "Switch", "Stay"


@dataclass(frozen=True)
class Decision:
    """``switch``: write ``permutation`` as the next generation. ``before``: the running
    placement's predicted cross-group bytes per step; ``after``: ``before`` less the saving
    predicted for ``permutation`` (held out; the same as ``before``, with the running
    permutation, when nothing was solved)."""

    switch: bool
    permutation: list[list[int]]
    before: int
    after: int
    message: str
    replicas: list[dict[str, list[list[int]]]] | None = None  # the copies (a plan with copies)

    @property
    def decision(self) -> str:
        return SWITCH if self.switch else STAY


def fresh_stats(cm: dict[str, Any] | None) -> tuple[RoutingStats | None, str]:
    """The statistics to re-plan from, out of the ``<job>-routing-stats`` ConfigMap, and which
    they are (``"window"`` or ``"whole run"``); ``(None, "")`` while it holds none. Raises
    ``DocumentError`` for a document that does not parse."""
    text = configmap_text(cm)
    if not text:
        return None, ""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get(WINDOW_KEY), dict):
        window = window_stats(obj)  # the counts since the trainer's previous publish
        if window is not None and window.tokens:
            return window, "window"
    return parse_routing_stats(obj), "whole run"


def _cross_group(perm: np.ndarray, inp: ReplanInputs, stats: RoutingStats, scale: float) -> float:
    """Predicted cross-group bytes per step of ``perm`` in the trainer counters' measure (see
    the module docstring); ``scale``: the job's tokens per step over the statistics'."""
    W = inp.topology.num_gpus
    pl = Placement(inp.strategy, perm, np.arange(W), inp.ep_size)
    te = stats.token_experts
    if te is not None and te.shape[1] > 0:
        got = dispatch.dispatch_bytes(
            pl, inp.topology, te, hidden_size=inp.hidden_size, bytes_per_elem=inp.bytes_per_elem
        )
        samples = int(te.shape[1])
        return float(got[inp.dispatcher]["crossGroup"]) * inp.tokens_per_step / samples
    score = cost.score(
        pl,
        inp.topology,
        stats,
        hidden_size=inp.hidden_size,
        bytes_per_elem=inp.bytes_per_elem,
    )
    return score.cross_group_bytes_per_step * scale * inp.per_send


def _layer_cross_group(
    perm: np.ndarray, inp: ReplanInputs, stats: RoutingStats, scale: float
) -> np.ndarray:
    """:func:`_cross_group` of each layer alone: ``[L]`` (the bytes add up over layers)."""
    te = stats.token_experts
    return np.array(
        [
            _cross_group(
                perm[layer : layer + 1],
                inp,
                replace(
                    stats,
                    num_layers=1,
                    load=stats.load[layer : layer + 1],
                    coact=stats.coact[layer : layer + 1],
                    token_experts=None if te is None else te[layer : layer + 1],
                    planted_clusters=None,
                ),
                scale,
            )
            for layer in range(stats.num_layers)
        ]
    )


Layout = tuple[np.ndarray, list[Any] | None]  # permutation [L, E], copies per layer (or None)


def _bytes(lay: Layout, inp: ReplanInputs, stats: RoutingStats, scale: float) -> np.ndarray:
    """Predicted cross-group bytes per step of each layer of ``lay``: ``[L]``; with copies, the
    net figure of ``replan_copies.layer_bytes`` (token bytes + the copies' weight sync)."""
    perm, copies = lay
    if copies is None or inp.copies is None:
        return _layer_cross_group(perm, inp, stats, scale)
    return rc.layer_bytes(
        copies,
        stats,
        inp.topology,
        inp.ep_size,
        inp.copies,
        hidden_bytes=inp.hidden_size * inp.bytes_per_elem,
        tokens_per_step=inp.tokens_per_step,
    )


def _fit(inp: ReplanInputs, stats: RoutingStats, tol: list[float]) -> Layout:
    """The solver's layout on ``stats``, with the planner's copies on it when the plan has
    copies. Raises ValueError as :func:`_solve`."""
    perm = _solve(inp, stats, tol).permutation
    if inp.copies is None:
        return perm, None
    return perm, rc.fit(perm, stats, inp.topology, inp.ep_size, inp.copies)


def _solve(inp: ReplanInputs, stats: RoutingStats, tol: list[float]) -> Placement:
    """The plan's solver on ``stats``. Raises ValueError (why, for the status) when it refuses
    or lands on a rank order other than the running gang's."""
    try:
        cand = router_groups.solve(
            inp.strategy,
            inp.topology,
            stats,
            ep_size=inp.ep_size,
            num_experts=inp.num_experts,
            num_layers=inp.num_layers,
            n_group=inp.n_group,
            seed=inp.seed,
            tol=tol,
        )
    except ValueError as exc:
        raise ValueError(f"the solver refused: {exc}") from exc
    if not np.array_equal(cand.rank2gpu, np.arange(inp.topology.num_gpus)):
        raise ValueError("the solver's rank order differs from the running gang's")
    return cand


def _held_out_saving(
    inp: ReplanInputs,
    cur: Layout,
    split: tuple[RoutingStats, RoutingStats, str],
    tol: list[float],
    scale: float,
) -> tuple[np.ndarray, str]:
    """Per layer, the bytes per step a re-fit saves over ``cur`` on tokens it was not fitted on:
    fit on one part of the sample (``routing.folds``), score on the other, both ways, the mean
    weighted by the tokens scored; and the basis for the status. On the tokens it was fitted on
    a heuristic's layout looks better than it is, and on a short window that looks like drift."""
    a, b, how = split
    saved, weights = [], []
    for fit, score in ((a, b), (b, a)):
        saved.append(
            _bytes(cur, inp, score, scale) - _bytes(_fit(inp, fit, tol), inp, score, scale)
        )
        weights.append(score.tokens)
    basis = f"saving held out: fitted and scored on {how}, {a.tokens} + {b.tokens} tokens"
    return np.average(saved, axis=0, weights=weights), basis


def decide(
    inp: ReplanInputs,
    current: list[list[int]],
    stats: RoutingStats,
    min_gain_percent: int,
    baseline: float | None = None,
    current_replicas: Sequence[Any] | None = None,
) -> Decision:
    """Re-plan on ``stats`` and compare with the running ``current`` permutation (and, for a plan
    with copies, the running ``current_replicas``, ``LayerReplicas`` per layer; None: one copy per
    expert), the gain capped by the rise over ``baseline`` (see the module docstring). Never
    raises for a job it cannot re-plan: the decision is Stay, and why."""
    cur = np.asarray(current, dtype=np.int64)
    stay = Decision(False, [list(map(int, row)) for row in current], 0, 0, "")
    shape = (inp.num_layers, inp.num_experts)
    if (stats.num_layers, stats.num_experts) != shape or cur.shape != shape:
        return _stay(
            stay,
            f"statistics of {stats.num_layers} x {stats.num_experts}, "
            f"the placement is {shape[0]} layers x {shape[1]} experts",
        )
    row = strategies.BY_NAME.get(inp.strategy)
    if row is None or not row.needs_stats:  # its layout does not depend on routing statistics
        return _stay(stay, f"strategy {inp.strategy} does not use routing statistics")
    if inp.dispatcher == "autoep":
        return _stay(stay, "dispatcher AutoEP sends the same bytes for every placement")
    if inp.copies is not None and stats.token_experts is None:
        why = "the plan's expert copies are placed on token samples; the statistics have none"
        return _stay(stay, why)
    if stats.tokens == 0:
        return _stay(stay, "the statistics record no tokens")
    W = inp.topology.num_gpus
    if not np.array_equal(inp.topology.gpu_order(), np.arange(W)):
        return _stay(stay, "the plan's rank order does not follow its NVLink groups")
    scale = inp.tokens_per_step / max(stats.tokens / max(stats.steps, 1), 1)
    running = Placement(inp.strategy, cur, np.arange(W), inp.ep_size)
    tol = [
        max(LOAD_TOLERANCE, tolerance_to_keep(stats.load[layer].astype(float), e2r, inp.ep_size))
        for layer, e2r in enumerate(map(running.expert2rank, range(inp.num_layers)))
    ]
    now: Layout = (
        cur,
        None if inp.copies is None else rc.from_contract(current_replicas, current, inp.ep_size),
    )
    before_l = _bytes(now, inp, stats, scale)
    split = routing.folds(stats)
    if split is None and stats.token_experts is not None:
        why = (
            f"a token sample of {stats.token_experts.shape[1]} tokens is too small to predict "
            f"a saving on tokens a re-fit was not fitted on (two parts of "
            f"{routing.MIN_FOLD_TOKENS} or more)"
        )
        return _stay(stay, why, float(before_l.sum()))
    try:
        cand = _fit(inp, stats, tol)
        held = None if split is None else _held_out_saving(inp, now, split, tol, scale)
    except ValueError as exc:
        return _stay(stay, str(exc), float(before_l.sum()))
    cand_l = _bytes(cand, inp, stats, scale)
    # per layer: the solver's layout only where it sends less on the window AND a re-fit saved
    # bytes on tokens it was not fitted on; the saving credited is the smaller of the two
    saving = before_l - cand_l if held is None else np.minimum(held[0], before_l - cand_l)
    take = saving > 0
    copies = None
    if inp.copies is not None and cand[1] is not None and now[1] is not None:
        take = rc.fit_memory(take, saving, now[1], cand[1], inp.ep_size, inp.copies.per_rank)
        copies = rc.to_contract(
            [c if t else r for t, c, r in zip(take, cand[1], now[1], strict=True)]
        )
    perm = np.where(take[:, None], cand[0], cur)
    before = float(before_l.sum())
    after = before - float(saving[take].sum())
    credited = after if baseline is None else max(after, min(before, baseline))
    gain = 100 * (before - credited) / before if before > 0 else 0.0
    basis = "in sample: the statistics hold no token sample" if held is None else held[1]
    what = (
        f"predicted cross-group bytes per step {round(before)} -> {round(after)} ({basis}), "
        + (
            f"{gain:.1f}% less counted (the rise over {round(baseline)} predicted when the "
            "running placement was chosen)"
            if baseline is not None
            else f"{gain:.1f}% less"
        )
        + f"; switch at >= {min_gain_percent}%"
    )
    if copies is not None:
        what += f"; {sum(len(h) - 1 for c in copies for h in c['holders'])} extra expert copies"
    if before <= 0 or gain < min_gain_percent or not take.any():
        return Decision(False, stay.permutation, round(before), round(after), "stay: " + what)
    return Decision(True, perm.tolist(), round(before), round(after), "switch: " + what, copies)


def _stay(stay: Decision, why: str, before: float = 0.0) -> Decision:
    b = round(before)
    return Decision(False, stay.permutation, b, b, f"stay: {why}")


def due(stats_step: int, last_step: int, every_steps: int) -> bool:
    """Whether statistics of trainer step ``stats_step`` are due for a decision, the last one
    having been made at ``last_step``."""
    return stats_step >= last_step + every_steps


def boundary_left(stats_step: int, checkpoint_every: int, total_steps: int) -> bool:
    """Whether a checkpoint boundary (where the trainer applies a new placement) comes after
    ``stats_step`` and before the run's last step: a switch applied at the last step or later
    moves experts for no step that would use them."""
    next_boundary = (stats_step // checkpoint_every + 1) * checkpoint_every
    return next_boundary < total_steps


def record_switch(
    history: list[dict[str, Any]], entry: dict[str, Any], limit: int = HISTORY_LIMIT
) -> list[dict[str, Any]]:
    """``status.placementHistory`` with ``entry`` (one generation once), the last ``limit``."""
    kept = [h for h in history if h.get("generation") != entry.get("generation")]
    kept.append(entry)
    kept.sort(key=lambda h: int(h.get("generation") or 0))
    return kept[-limit:]


def mark_applied(history: list[dict[str, Any]], generation: int, step: int) -> list[dict[str, Any]]:
    """The trainer reports it runs ``generation`` since ``step``: that entry's ``appliedAtStep``."""
    return [
        {**h, "appliedAtStep": step}
        if h.get("generation") == generation and h.get("appliedAtStep") is None
        else h
        for h in history
    ]


def applied(progress: Any) -> tuple[int, int] | None:
    """``(generation, appliedAtStep)`` of a TrainerProgress document's ``placement`` (the
    decoded JSON object), None when absent or not two non-negative integers."""
    pl = progress.get("placement") if isinstance(progress, dict) else None
    if not isinstance(pl, dict):
        return None
    gen, step = pl.get("generation"), pl.get("appliedAtStep")
    if type(gen) is not int or type(step) is not int:  # a JSON bool is no count
        return None
    return (gen, step) if min(gen, step) >= 0 else None
