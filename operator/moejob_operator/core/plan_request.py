"""What :func:`.plan.build_plan` reads: the job, the model, where it runs and how it trains."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from moe_contracts.routing import RoutingStats
from moe_contracts.topology import TopologyReport

from .dsconfig import GpuCaps
from .models import ResolvedModel
from .placement.strategies import DEFAULT as DEFAULT_STRATEGY
from .topology import ClusterTopology


@dataclass(frozen=True)
class TrainingOptions:
    """What the trainer needs besides the model and the DeepSpeed config (``training`` block)."""

    steps: int = 20
    lr: float = 1e-3
    warmup_steps: int = 2
    checkpoint_every_steps: int = 50  # the CRD's spec.checkpoint.everySteps default
    seed: int = 1234
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    balance_mode: str = "per_layer_aux"
    balance_coef: float = 0.01
    data: dict[str, Any] = field(default_factory=lambda: {"kind": "synthetic"})
    extra: dict[str, Any] = field(default_factory=dict)  # passed through (camelCase keys)


@dataclass(frozen=True)
class PlanRequest:
    """Everything :func:`build_plan` reads: the job, the model, where it runs and how it trains.

    ``topology``: the nodes' TopologyReports (or a ClusterTopology with ``gpu``); None on CPU.
    ``nodes``: the nodes to use (default all in ``topology``; CPU: ``["localhost"]``), with
    ``gpus_per_node`` GPUs each (default all). ``device``: ``"cuda"`` or ``"cpu"`` (then
    ``procs_per_node`` processes per node sharing ``cpu_memory_bytes`` each, 0: unchecked).
    ``performance``: let the planner pick the fast settings (:mod:`.perf`); False gives the
    stock configuration (HF blocks + AutoEP, HF's ZeRO-3 "auto" knobs, no performance block).
    ``dispatcher``: ``"autoep"`` or ``"dedup"`` (default: dedup when AutoEP runs with EP > 1).
    ``replicas``: :mod:`.plan_replicas`."""

    job_name: str
    namespace: str
    model: ResolvedModel
    topology: ClusterTopology | Sequence[TopologyReport] | None
    _: KW_ONLY
    global_batch: int
    seq_len: int
    nodes: Sequence[str] | None = None
    gpus_per_node: int | None = None
    strategy: str = DEFAULT_STRATEGY.name
    routing_stats: RoutingStats | None = None
    micro_batch: int | None = None
    ep_size: int | None = None
    gpu: GpuCaps | None = None
    device: str = "cuda"
    procs_per_node: int = 1
    cpu_memory_bytes: int = 0
    training: TrainingOptions = field(default_factory=TrainingOptions)
    autoep: bool = True
    ds_overrides: Mapping[str, Any] | None = None
    performance: bool = True
    dispatcher: str | None = None
    # spec.placement.replicas: None / "none" (one copy per expert), "auto", or extra copies per
    # layer; max_expert_memory_overhead: the copies' budget in percent of a rank's experts
    replicas: int | str | None = None
    max_expert_memory_overhead: int = 25

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len
