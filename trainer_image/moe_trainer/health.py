"""MoE health checks, evaluated once per step on numbers every rank already holds.

Each check returns `Finding`s (the `health` entries of TrainerProgress v1):
  NonFiniteLoss           loss is NaN/Inf (the trainer then writes progress and exits 65)
  RouterLogitsOutOfRange  max |router logit| of a layer above `router_logit_limit`
  DeadExpert              an expert's load stayed below `dead_fraction` x fair share for
                          `dead_steps` consecutive steps (fair share = tokens*topK/E per step)
  Straggler               a rank's busy time per step (step time minus time blocked in the
                          timed collectives) stayed above `straggler_factor` x the median
                          for `straggler_steps` consecutive steps
  Fragmentation           CUDA allocator 1 - allocated/reserved above `fragmentation_limit`
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Finding:
    type: str
    severity: str
    message: str

    def to_doc(self) -> dict:
        return asdict(self)


class HealthMonitor:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        world_size: int,
        *,
        dead_steps: int,
        dead_fraction: float,
        router_logit_limit: float,
        straggler_factor: float,
        straggler_steps: int,
        fragmentation_limit: float,
    ):
        self.dead_steps, self.dead_fraction = dead_steps, dead_fraction
        self.router_logit_limit = router_logit_limit
        self.straggler_factor, self.straggler_steps = straggler_factor, straggler_steps
        self.fragmentation_limit = fragmentation_limit
        self.low_streak = np.zeros((num_layers, num_experts), dtype=np.int64)  # [L, E]
        self.slow_streak = np.zeros(world_size, dtype=np.int64)  # [world]

    def state_dict(self) -> dict:
        return {"low_streak": self.low_streak.copy(), "slow_streak": self.slow_streak.copy()}

    def load_state_dict(self, sd: dict) -> None:
        self.low_streak[...] = sd["low_streak"]
        self.slow_streak[...] = sd["slow_streak"]

    def check_loss(self, loss: float) -> list[Finding]:
        if math.isfinite(loss):
            return []
        return [Finding("NonFiniteLoss", "Error", f"loss is {loss}")]

    def check_router_logits(self, max_abs_logit) -> list[Finding]:
        """max_abs_logit[L]."""
        return [
            Finding(
                "RouterLogitsOutOfRange",
                "Warning",
                f"layer {layer}: max |router logit| {v:.1f} > {self.router_logit_limit:g}",
            )
            for layer, v in enumerate(np.asarray(max_abs_logit, dtype=float))
            if not (v <= self.router_logit_limit)
        ]

    def update_dead(self, step_load) -> list[Finding]:
        """step_load[L, E] (this step, all ranks, original expert ids)."""
        load = np.asarray(step_load, dtype=np.float64)
        fair = load.sum(axis=1, keepdims=True) / load.shape[1]
        low = load < self.dead_fraction * fair
        self.low_streak = np.where(low, self.low_streak + 1, 0)
        return [
            Finding(
                "DeadExpert",
                "Warning",
                f"layer {layer} expert {e}: load below {self.dead_fraction:g}x fair share for "
                f"{int(self.low_streak[layer, e])} steps",
            )
            for layer, e in self.dead_experts()
        ]

    def dead_experts(self) -> list[list[int]]:
        return [
            [int(layer), int(e)]
            for layer, e in zip(*np.nonzero(self.low_streak >= self.dead_steps), strict=True)
        ]

    def update_stragglers(self, step_seconds) -> list[Finding]:
        """step_seconds[world]: this step's wall time of every rank."""
        t = np.asarray(step_seconds, dtype=np.float64)
        med = float(np.median(t))
        slow = t > self.straggler_factor * med if med > 0 else np.zeros_like(t, dtype=bool)
        self.slow_streak = np.where(slow, self.slow_streak + 1, 0)
        return [
            Finding(
                "Straggler",
                "Warning",
                f"rank {r}: step time {t[r]:.3f}s > {self.straggler_factor:g}x median {med:.3f}s "
                f"for {int(self.slow_streak[r])} steps",
            )
            for r in np.nonzero(self.slow_streak >= self.straggler_steps)[0]
        ]

    def check_fragmentation(self, fragmentation: float | None) -> list[Finding]:
        if fragmentation is None or fragmentation <= self.fragmentation_limit:
            return []
        return [
            Finding(
                "Fragmentation",
                "Warning",
                f"allocator fragmentation {fragmentation:.2f} > {self.fragmentation_limit:g}",
            )
        ]


def memory_peaks(device) -> tuple[int, int]:
    """(peak allocated, peak reserved) bytes of the caching allocator since the process started;
    (0, 0) on CPU."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return 0, 0
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def fragmentation(device) -> float | None:
    """Share of the caching allocator's reserved memory that sits free inside split blocks
    (``inactive_split_bytes / reserved_bytes``): memory that is reserved but, being cut into
    pieces, cannot serve a large request. None on CPU (no caching allocator to ask).

    ``1 - allocated/reserved`` would count the cached (reusable) activation blocks between steps
    as fragmentation: on an H200 run it read 0.68 for a healthy allocator."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    reserved = stats.get("reserved_bytes.all.current", 0)
    if reserved == 0:
        return 0.0
    return stats.get("inactive_split_bytes.all.current", 0) / reserved
