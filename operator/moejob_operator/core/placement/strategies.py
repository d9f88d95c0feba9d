"""The placement strategies, one row each: a new strategy is one row here and its solver module.

A row says how the user spells the strategy (``spec.placement.strategy``; None: offered to the
CLI and benchmarks only), the name plans, status and ``moectl`` use, whether it needs routing
statistics (without them ``solve`` falls back to contiguous and says so), whether its layout is
fitted to them (``heldout`` raises a fitted layout's in-sample ratio by the measured optimism),
whether it keeps DeepSpeed's node/GPU rank order (else ranks fill an NVLink group, then a node)
and its per-layer solver. Everything else (the spec's value set, the CRD enum test, the CLI's
choices, the planner's check, the status name) reads this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from moe_contracts.routing import RoutingStats

from .exact import _brute_force_layer
from .packing import _hierarchical
from .refine import _refine_sample, _topology_aware_layer


@dataclass(frozen=True)
class LayerInputs:
    """What a per-layer solver may read: ``load``/``coact`` come from ``stats`` (None for the
    strategies that need none); ``rank_node[P]``/``rank_group[P]`` are the EP ranks' node and
    NVLink group; ``n`` experts per rank; ``tol`` the load tolerance."""

    stats: RoutingStats | None
    layer: int
    num_layers: int
    num_experts: int
    ep_size: int
    rank_node: np.ndarray
    rank_group: np.ndarray
    n: int
    tol: float
    seed: int
    starts: int


LayerSolver = Callable[[LayerInputs], np.ndarray]  # -> expert2rank[num_experts]


def _need(x: LayerInputs) -> RoutingStats:
    assert x.stats is not None  # solve() falls back to contiguous without statistics
    return x.stats


def _contiguous(x: LayerInputs) -> np.ndarray:
    return np.arange(x.num_experts) // x.n


def _round_robin(x: LayerInputs) -> np.ndarray:
    return np.arange(x.num_experts) % x.ep_size


def _balanced(x: LayerInputs) -> np.ndarray:
    return _hierarchical(_need(x).load[x.layer].astype(float), x.rank_node, x.rank_group, x.n)


def _topology_aware(x: LayerInputs) -> np.ndarray:
    stats = _need(x)
    return _topology_aware_layer(
        stats.load[x.layer].astype(float),
        stats.coact[x.layer].astype(float) / max(stats.tokens, 1),
        x.rank_node,
        x.rank_group,
        x.n,
        x.tol,
        np.random.default_rng([x.seed, x.layer]),
        x.starts,
        _refine_sample(stats, x.layer, x.num_layers),
    )


def _brute_force(x: LayerInputs) -> np.ndarray:
    return _brute_force_layer(_need(x), x.layer, x.rank_node, x.rank_group, x.n, x.tol)


@dataclass(frozen=True)
class Strategy:
    name: str  # plans, status, moectl
    spec_name: str | None  # spec.placement.strategy; None: CLI and benchmarks only
    needs_stats: bool
    fitted: bool  # the layout is fitted to the statistics' co-activation
    keeps_gpu_order: bool  # EP ranks in node/GPU order (DeepSpeed's default)
    solve_layer: LayerSolver


REGISTRY: tuple[Strategy, ...] = (
    Strategy("contiguous", "Contiguous", False, False, True, _contiguous),
    Strategy("round_robin", "RoundRobin", False, False, False, _round_robin),
    Strategy("balanced", "Balanced", True, False, False, _balanced),
    Strategy("topology_aware", "TopologyAware", True, True, False, _topology_aware),
    Strategy("brute_force", None, True, True, False, _brute_force),  # exact; tiny sizes only
)
BY_NAME = {s.name: s for s in REGISTRY}
BY_SPEC_NAME = {s.spec_name: s for s in REGISTRY if s.spec_name is not None}
NAMES = tuple(BY_NAME)
FITTED = tuple(s.name for s in REGISTRY if s.fitted)
CONTIGUOUS = BY_NAME["contiguous"]
DEFAULT = BY_NAME["topology_aware"]

# The spec's static type; the import-time check keeps it equal to the table's spec names.
SpecStrategy = Literal["Contiguous", "RoundRobin", "Balanced", "TopologyAware"]
if set(get_args(SpecStrategy)) != set(BY_SPEC_NAME):  # pragma: no cover - a broken table
    raise AssertionError(f"SpecStrategy {get_args(SpecStrategy)} != {tuple(BY_SPEC_NAME)}")
SPEC_DEFAULT: SpecStrategy = "TopologyAware"
if BY_SPEC_NAME[SPEC_DEFAULT] is not DEFAULT:  # pragma: no cover - a broken table
    raise AssertionError("SPEC_DEFAULT is not DEFAULT's spec name")


def lookup(name: str) -> Strategy:
    """The row named ``name`` (the plan's spelling); ValueError naming the choices otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown placement strategy {name!r} (choose from {', '.join(NAMES)})"
        ) from None
