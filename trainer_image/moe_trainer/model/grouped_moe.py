"""Grouped-GEMM MoE block: a weight-compatible, function-preserving drop-in for Hugging Face's
`MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock` and `OlmoeSparseMoeBlock` (transformers 5.x
layout; the families with `grouped_block` in moe_trainer/families/).

Why: routing and token permutation take a large share of MoE-layer time in the stock paths
(benchmarks/trainer_bench.py measures it per path). This block sorts the T*k routed slots by expert
once, runs each expert projection as one
`torch._grouped_mm` over the stacked weights, and moves tokens with gathers only (see
`fast/ops.py`). No Python loop over experts and no host sync on the fast path.

Compatibility (what the trainer relies on):
- The HF router module is kept as is (`block.gate`, same class, same `weight[E, H]`): routing
  semantics (softmax in fp32, top-k, renormalisation or not) are exactly HF's, and transformers'
  `output_router_logits` recorder, which hooks the router class, keeps working.
- `block.experts` is a `GroupedExperts` holding the HF parameters themselves under the HF names
  (`gate_up_proj[E, 2F, H]` = [gate; up], `down_proj[E, H, F]`), so state-dict keys, HF
  checkpoints and the placement permutation (index dim 0 of both, and the router's rows) apply
  unchanged. Under ZeRO-3 they are ordinary parameters of a submodule whose forward uses them,
  so ZeRO gathers them for forward and backward.

SwiGLU: `fused_act=None` (default) compiles the activation's forward and backward with
torch.compile on CUDA (one kernel each; measured 2x faster MoE layer on an H200, see
docs/performance.md) and runs eager elsewhere; `True`/`False` force it.

Statistics interface (agreed with the trainer; all tensors detached, on device, no host sync):
- after each forward, `block.last_router_logits[T, E]`, `block.last_topk_ids[T, k]` (int64),
  `block.last_topk_weights[T, k]`, and `block.last_tokens_per_expert[E]` (int32);
- `block.route_callbacks`: list of `fn(block, router_logits, topk_ids)` called in forward after
  routing (e.g. to accumulate load / co-activation on device). Reading a tensor on the host
  (`.cpu()`) syncs: do it once per logging interval, not per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe_trainer.families import GROUPED_BLOCK_CLASSES
from moe_trainer.fast.ops import (
    combine,
    dispatch,
    grouped_linear,
    grouped_linear_loop,
    grouped_mm_supported,
    plan_dispatch,
    swiglu,
)

__all__ = [
    "SUPPORTED_BLOCKS",
    "GroupedExperts",
    "GroupedMoeBlock",
    "from_hf_block",
    "swap_moe_blocks",
]

# HF block classes this block reproduces exactly: router `gate` -> (logits, weights, ids),
# experts `gate_up_proj`/`down_proj` with SwiGLU, no shared experts, no bias (the families with
# `grouped_block`, moe_trainer/families/).
SUPPORTED_BLOCKS = GROUPED_BLOCK_CLASSES

IMPLS = ("auto", "grouped_mm", "loop")


class GroupedExperts(nn.Module):
    """Stacked SwiGLU experts: x_sorted[S, H] (rows grouped by expert) -> y_sorted[S, H]."""

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn: nn.Module,
        impl: str = "auto",
        fused_act: bool | None = None,
    ):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl: {impl!r} is not one of {IMPLS}")
        # ZeRO-3 partitioned parameters (built under zero.Init) keep their shape in ds_shape
        gu, dn = (tuple(getattr(p, "ds_shape", p.shape)) for p in (gate_up_proj, down_proj))
        if len(gu) != 3 or len(dn) != 3 or gu[1] != 2 * dn[2]:
            raise ValueError(
                f"expert weights: expected gate_up_proj[E, 2F, H] and down_proj[E, H, F], got "
                f"{gu} and {dn}"
            )
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.num_experts = gu[0]
        self.impl = impl
        self.fused_act = fused_act
        self._silu = type(act_fn).__name__ in ("SiLUActivation", "SiLU")

    def resolved_impl(self, x: torch.Tensor) -> str:
        if self.impl != "auto":
            return self.impl
        return "grouped_mm" if grouped_mm_supported(x.device, x.dtype) else "loop"

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        linear = (
            grouped_linear if self.resolved_impl(x_sorted) == "grouped_mm" else grouped_linear_loop
        )
        gate_up = linear(x_sorted, self.gate_up_proj, offsets)  # [S, 2F]
        if self._silu:
            fused = x_sorted.is_cuda if self.fused_act is None else self.fused_act
            h = swiglu(gate_up, fused=fused)  # [S, F]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act_fn(gate) * up
        return linear(h, self.down_proj, offsets)  # [S, H]


class GroupedMoeBlock(nn.Module):
    """Router (HF module, unchanged) + grouped experts. hidden[B, L, H] -> [B, L, H]."""

    def __init__(
        self, gate: nn.Module, experts: GroupedExperts, top_k: int, jitter_noise: float = 0.0
    ):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.top_k = top_k
        self.num_experts = experts.num_experts
        self.jitter_noise = jitter_noise
        self.route_callbacks: list[Callable] = []
        self.last_router_logits = self.last_topk_ids = self.last_topk_weights = None
        self.last_tokens_per_expert = None

    @classmethod
    def from_hf(
        cls, block: nn.Module, impl: str = "auto", fused_act: bool | None = None
    ) -> GroupedMoeBlock:
        """Wrap a supported HF block, sharing (not copying) its router and expert params."""
        name = type(block).__name__
        if name not in SUPPORTED_BLOCKS:
            raise TypeError(f"from_hf: {name} is not one of {SUPPORTED_BLOCKS}")
        hf_experts = block.experts
        if (
            getattr(hf_experts, "has_bias", False)
            or getattr(hf_experts, "is_transposed", False)
            or not getattr(hf_experts, "is_concatenated", True)
        ):
            raise TypeError(f"from_hf: {name} experts use a layout this block does not reproduce")
        experts = GroupedExperts(
            hf_experts.gate_up_proj,
            hf_experts.down_proj,
            hf_experts.act_fn,
            impl=impl,
            fused_act=fused_act,
        )
        top_k = getattr(block, "top_k", None) or block.gate.top_k
        return cls(block.gate, experts, top_k, getattr(block, "jitter_noise", 0.0) or 0.0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's input jitter (HF does it in place)
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise
            )
        x = hidden_states.reshape(-1, hidden)  # [T, H]
        router_logits, topk_weights, topk_ids = self.gate(x)  # [T, E], [T, k], [T, k]
        plan = plan_dispatch(topk_ids, self.num_experts)
        self.last_router_logits = router_logits.detach()
        self.last_topk_ids = topk_ids.detach()
        self.last_topk_weights = topk_weights.detach()
        self.last_tokens_per_expert = plan.tokens_per_expert()
        for fn in self.route_callbacks:
            fn(self, self.last_router_logits, self.last_topk_ids)
        y_sorted = self.experts(dispatch(x, plan), plan.offsets)  # [S, H]
        out = combine(y_sorted, topk_weights, plan)  # [T, H]
        return out.reshape(batch, seq, hidden)


def from_hf_block(
    block: nn.Module, config=None, impl: str = "auto", fused_act: bool | None = None
) -> GroupedMoeBlock:
    """Factory for `moe_trainer.model.models.swap_moe_blocks(model, factory)`: `(block, config) ->
    block`."""
    return GroupedMoeBlock.from_hf(block, impl=impl, fused_act=fused_act)


def swap_moe_blocks(model: nn.Module, impl: str = "auto", fused_act: bool | None = None) -> int:
    """Replace every supported HF MoE block in `model` in place; returns how many were swapped.

    Parameters are shared, not copied: call it before `deepspeed.initialize` (and before or after
    the placement permutation: both act on the same tensors). Unsupported MoE blocks (e.g.
    DeepSeek-V3 with shared experts) are left as they are.
    """
    targets = [
        (name, mod) for name, mod in model.named_modules() if type(mod).__name__ in SUPPORTED_BLOCKS
    ]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, GroupedMoeBlock.from_hf(mod, impl=impl, fused_act=fused_act))
    return len(targets)
