"""``Placement``: the layout every solver returns (slot -> expert per layer, rank -> GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..topology import ClusterTopology

LOAD_TOLERANCE = 0.02  # bins may exceed the balanced packing's heaviest bin by 2 %


@dataclass(frozen=True, eq=False)
class Placement:
    strategy: str
    permutation: np.ndarray  # permutation[num_layers, num_experts]: slot -> expert
    rank2gpu: np.ndarray  # rank2gpu[world_size]: global rank -> global GPU index
    ep_size: int
    notes: tuple[str, ...] = field(default=())
    fell_back: bool = False  # ``strategy`` needed routing statistics: the layout is contiguous

    @property
    def num_layers(self) -> int:
        return int(self.permutation.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.permutation.shape[1])

    @property
    def world_size(self) -> int:
        return len(self.rank2gpu)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def expert2slot(self, layer: int) -> np.ndarray:
        """``expert2slot[num_experts]`` for one layer (inverse permutation)."""
        inv = np.empty(self.num_experts, dtype=np.int64)
        inv[self.permutation[layer]] = np.arange(self.num_experts)
        return inv

    def expert2rank(self, layer: int) -> np.ndarray:
        """``expert2rank[num_experts]``: EP rank holding each expert of ``layer``."""
        return self.expert2slot(layer) // self.experts_per_rank

    def validate(self, topo: ClusterTopology | None = None) -> Placement:
        L, E = self.permutation.shape
        P, W = self.ep_size, self.world_size
        if P < 1 or E % P or W % P:
            raise ValueError(
                f"{self.strategy}: ep_size {P} must divide num_experts {E} and world size {W}"
            )
        want = np.arange(E)
        for layer in range(L):
            if not np.array_equal(np.sort(self.permutation[layer]), want):
                raise ValueError(
                    f"{self.strategy}: permutation[{layer}] is not a permutation of 0..{E - 1}"
                )
        if not np.array_equal(np.sort(self.rank2gpu), np.arange(W)):
            raise ValueError(f"{self.strategy}: rank2gpu is not a bijection onto 0..{W - 1}")
        if topo is not None and topo.num_gpus != W:
            raise ValueError(
                f"{self.strategy}: world size {W} != {topo.num_gpus} GPUs in the topology"
            )
        return self

    def to_json(self) -> dict[str, Any]:
        """``MoEPlan.placement`` without ``quality`` (docs/contracts.md); ``fellBackTo`` names the
        layout actually used when ``strategy`` needed routing statistics and had none."""
        out: dict[str, Any] = {
            "strategy": self.strategy,
            "numLayers": self.num_layers,
            "numExperts": self.num_experts,
            "epSize": self.ep_size,
            "permutation": self.permutation.tolist(),
        }
        if self.fell_back:
            out["fellBackTo"] = "contiguous"
        return out
