"""Token-dispatch and grouped-GEMM primitives for the grouped MoE block.

Shapes: T tokens, H hidden, E experts, k top-k, F expert intermediate size, S = T * k routed rows
("slots"; slot s = t * k + j is token t's j-th choice). Rows sorted by expert are "sorted rows".

Why custom autograd functions: the stock backward of a gather (`x[idx]`) is a scatter-add with
atomics, and the stock `torch._grouped_mm` backward saves a transposed *view* of the expert
weights, which under ZeRO-3 keeps the gathered full weights alive until backward. Here every
backward is a gather (each token has exactly k slots, so the inverse map is a permutation) and
the grouped linear saves the parameter itself, so ZeRO-3 re-gathers it for backward as it does
for `nn.Linear`. Nothing in the hot path syncs with the host (no `.item()`, `.tolist()`,
`nonzero`, `bincount` on CUDA, boolean indexing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "DispatchPlan",
    "combine",
    "dispatch",
    "grouped_linear",
    "grouped_linear_loop",
    "grouped_mm_supported",
    "plan_dispatch",
    "swiglu",
]


class DispatchPlan:
    """How the S = T*k routed slots are ordered by expert.

    perm[S]      sorted row i holds slot perm[i]   (slot -> token is perm // k)
    inv[S]       slot s sits at sorted row inv[s]  (inv[perm[i]] == i)
    offsets[E]   int32 end offset of each expert's rows (cumulative counts), as grouped_mm wants
    token_idx[S] token of each sorted row
    """

    __slots__ = ("inv", "offsets", "perm", "token_idx", "top_k")

    def __init__(self, perm, inv, offsets, token_idx, top_k):
        self.perm, self.inv, self.offsets, self.token_idx, self.top_k = (
            perm,
            inv,
            offsets,
            token_idx,
            top_k,
        )

    def tokens_per_expert(self) -> torch.Tensor:
        """counts[E] (int32, on device, no host sync)."""
        return torch.diff(self.offsets, prepend=self.offsets.new_zeros(1))


def plan_dispatch(topk_ids: torch.Tensor, num_experts: int) -> DispatchPlan:
    """Sort the routed slots by expert once: topk_ids[T, k] -> DispatchPlan. No host sync."""
    top_k = topk_ids.shape[-1]
    flat = topk_ids.reshape(-1)
    # int32 keys sort faster (radix sort on 32 bits); stable keeps token order inside an expert.
    sorted_ids, perm = torch.sort(flat.to(torch.int32), stable=True)
    inv = torch.empty_like(perm)
    inv.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))
    bounds = torch.arange(num_experts, device=flat.device, dtype=torch.int32)
    offsets = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)
    token_idx = torch.div(perm, top_k, rounding_mode="floor")
    return DispatchPlan(perm, inv, offsets, token_idx, top_k)


class _Dispatch(torch.autograd.Function):
    """x[T, H] -> x_sorted[S, H] = x[token_idx]; backward gathers by `inv` and sums the k copies."""

    @staticmethod
    def forward(ctx, x, token_idx, inv, top_k):
        ctx.save_for_backward(inv)
        ctx.top_k = top_k
        return x.index_select(0, token_idx)

    @staticmethod
    def backward(ctx, grad_sorted):
        (inv,) = ctx.saved_tensors
        num_slots, hidden = grad_sorted.shape
        grad_x = (
            grad_sorted.index_select(0, inv).view(num_slots // ctx.top_k, ctx.top_k, hidden).sum(1)
        )
        return grad_x, None, None, None


class _Combine(torch.autograd.Function):
    """y_sorted[S, H], weights[T, k] -> out[T, H] = sum_j weights[t, j] * y_sorted[inv[t*k + j]]."""

    @staticmethod
    def forward(ctx, y_sorted, weights, inv, perm):
        num_tokens, top_k = weights.shape
        y_slots = y_sorted.index_select(0, inv).view(num_tokens, top_k, -1)  # [T, k, H]
        w = weights.to(y_sorted.dtype)
        ctx.save_for_backward(y_slots, w, perm)
        ctx.weights_dtype = weights.dtype
        return torch.bmm(w.unsqueeze(1), y_slots).squeeze(1)

    @staticmethod
    def backward(ctx, grad_out):
        y_slots, w, perm = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_slots = w.unsqueeze(-1) * grad_out.unsqueeze(1)  # [T, k, H]
            grad_y = grad_slots.view(-1, grad_out.shape[-1]).index_select(0, perm)
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(y_slots, grad_out.unsqueeze(-1)).squeeze(-1).to(ctx.weights_dtype)
        return grad_y, grad_w, None, None


def dispatch(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """x[T, H] -> x_sorted[S, H], rows grouped by expert."""
    return _Dispatch.apply(x, plan.token_idx, plan.inv, plan.top_k)


def combine(y_sorted: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """y_sorted[S, H], routing weights[T, k] -> out[T, H] (dtype of y_sorted)."""
    return _Combine.apply(y_sorted, weights, plan.inv, plan.perm)


class _GroupedLinear(torch.autograd.Function):
    """x_sorted[S, in] @ weight[E, out, in]^T per expert group -> [S, out]."""

    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_out, weight, offs=offsets)  # [S, in]
        if ctx.needs_input_grad[1]:
            # 2d x 2d with offsets on the contraction dim -> one [out, in] block per expert;
            # experts with no rows get zeros.
            grad_w = torch._grouped_mm(grad_out.t(), x, offs=offsets)  # [E, out, in]
        return grad_x, grad_w, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Fast path: one `torch._grouped_mm` per direction, weight in HF layout [E, out, in]."""
    return _GroupedLinear.apply(x, weight, offsets)


def grouped_linear_loop(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Reference path (any dtype/device): a loop over experts. Syncs once (offsets.tolist())."""
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        outs.append(F.linear(x[start:end], weight[e]))
        start = end
    return torch.cat(outs, dim=0)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for this device/dtype (CUDA: bf16 on sm80+; CPU:
    fp32/bf16)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    return False


def _swiglu_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_bwd(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    acc = torch.promote_types(gate_up.dtype, torch.float32)  # bf16 math in fp32, fp64 stays fp64
    g32, u32, d32 = gate.to(acc), up.to(acc), grad.to(acc)
    sig = torch.sigmoid(g32)
    d_gate = d32 * u32 * sig * (1.0 + g32 * (1.0 - sig))
    d_up = d32 * g32 * sig
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


_COMPILED: dict[str, object] = {}


def _kernels(fused: bool):
    if not fused:
        return _swiglu_fwd, _swiglu_bwd
    if not _COMPILED:
        _COMPILED["fwd"] = torch.compile(_swiglu_fwd, fullgraph=True, dynamic=False)
        _COMPILED["bwd"] = torch.compile(_swiglu_bwd, fullgraph=True, dynamic=False)
    return _COMPILED["fwd"], _COMPILED["bwd"]


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up on gate_up[S, 2F] = [gate | up] (HF chunk order); saves only gate_up."""

    @staticmethod
    def forward(ctx, gate_up, fused):
        ctx.save_for_backward(gate_up)
        ctx.fused = fused
        return _kernels(fused)[0](gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return _kernels(ctx.fused)[1](gate_up, grad.contiguous()), None


def swiglu(gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """gate_up[S, 2F] -> [S, F]. `fused=True` compiles fwd/bwd into one kernel each
    (torch.compile)."""
    return _SwiGLU.apply(gate_up, fused)
