"""Speed options of the plan's `training.performance` block (chosen by the planner, see
docs/performance.md and docs/contracts.md).

  compileLayers    torch.compile each decoder layer's forward (not the module call: DeepSpeed's
                   ZeRO-3 fetch/release hooks stay outside the compiled region, on the layer)
  fusedLoss        LM head + cross-entropy in token chunks, gradients computed in the forward
                   (no [tokens, vocab] fp32 logits tensor; the same matmul FLOPs)
  fusedOptimizer   torch.optim.AdamW(fused=True) (one kernel over all tensors of a group);
                   under ZeRO-3 also a leaner step around it (`install_zero3_fused_step`): the
                   gradient-clipping scale goes into the AdamW kernel (`grad_scale`) instead of a
                   separate multiply over every fp32 gradient, and the gradient norm is taken in
                   fp32 (one read of the gradients) instead of over an fp64 copy of them;
                   on one rank each gradient goes straight into its ZeRO-3 partition
                   (`install_single_rank_grads`) instead of through the reduce-scatter path;
                   the step's fp32 gradients are slices of the gradient partitions
                   (`install_flat_sub_group_grads`) instead of a concatenated, converted copy
  zeroLeafModules  class names DeepSpeed ZeRO-3 treats as leaves (`set_z3_leaf_modules`): one
                   fetch/release and one pair of hooks per decoder layer instead of per submodule
  lossChunkTokens  tokens per chunk of the fused loss [8192]

Everything here changes speed and memory only; the function trained is the same (the fused loss
equals `F.cross_entropy(logits.float(), targets)` up to bf16 rounding of the logits matmul).
"""

from __future__ import annotations

import logging
import os
import types

import torch
import torch.nn.functional as F
from torch import nn

from moe_contracts.plan import PerfSpec

log = logging.getLogger("moe_trainer")

IGNORE_INDEX = -100


class PerfError(ValueError):
    """A `training.performance` option this model cannot take."""


# ---- fused LM head + cross-entropy -----------------------------------------------------------


class _LinearCrossEntropy(torch.autograd.Function):
    """mean over valid tokens of CE(hidden @ weight.T, targets), chunked over tokens.

    The forward computes the gradients too (softmax - one_hot per chunk, then two matmuls), so
    neither the [N, V] logits nor their fp32 copy outlive a chunk; backward only scales them.
    hidden[N, H], weight[V, H], targets[N] (IGNORE_INDEX rows count for nothing).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 -> fp32 math, fp64 stays
        valid_all = targets != IGNORE_INDEX
        count = valid_all.sum().clamp(min=1).to(acc)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for s in range(0, n, chunk):
            h = hidden[s : s + chunk]
            y = targets[s : s + chunk]
            valid = valid_all[s : s + chunk]
            ysafe = y.clamp(min=0).unsqueeze(1)
            logits = F.linear(h, weight).to(acc)  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, ysafe).squeeze(1)
            total = total + ((lse - picked) * valid).sum()
            if need_h or need_w:
                probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place
                probs.scatter_add_(1, ysafe, torch.full_like(picked, -1.0).unsqueeze(1))
                probs.mul_((valid.to(probs.dtype) / count).unsqueeze(1))
                g = probs.to(hidden.dtype)
                if need_h:
                    grad_h[s : s + chunk] = g @ weight
                if need_w:
                    grad_w.add_(g.t() @ h)  # bf16 matmul, fp32 sum
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if need_w else None)
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
            grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 8192
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` without materialising logits."""
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk
    )


class FusedLossHead(nn.Linear):
    """`lm_head` with a second mode: `forward(hidden, targets=...)` returns the mean CE loss.

    Installed by swapping the class of the model's own `lm_head` (same parameter, same state-dict
    key), so DeepSpeed ZeRO-3 fetches the weight through the module's hooks as it would for the
    plain head."""

    loss_chunk_tokens = 8192

    def forward(self, hidden, targets=None):
        if targets is None:
            return super().forward(hidden)
        if self.bias is not None:
            raise PerfError("training.performance.fusedLoss: lm_head has a bias (not supported)")
        return linear_cross_entropy(hidden, self.weight, targets, self.loss_chunk_tokens)


class LossOutput:
    """What the patched forward returns: `.loss` (and `.logits = None`). A plain object with a
    `__dict__`: DeepSpeed's ZeRO-3 post-forward hook walks `vars(output)`."""

    def __init__(self, loss):
        self.loss, self.logits = loss, None


def _fused_causal_forward(self, input_ids=None, targets=None, **kwargs):
    if targets is None:
        return type(self).forward(self, input_ids=input_ids, **kwargs)
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    return LossOutput(self.lm_head(hidden, targets=targets))


def install_fused_loss(model: nn.Module, chunk: int) -> None:
    """Make `model(input_ids=..., targets=...)` return `.loss` through the fused head."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or not hasattr(model, "model"):
        raise PerfError(
            "training.performance.fusedLoss: the model has no plain `lm_head` Linear "
            f"over `model` (lm_head is {type(head).__name__})"
        )
    head.__class__ = FusedLossHead
    head.loss_chunk_tokens = chunk
    model.forward = types.MethodType(_fused_causal_forward, model)


# ---- ZeRO-3 leaves, compile ------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise PerfError(f"{type(model).__name__}: no `model.layers` (decoder layers) found")
    return list(layers)


def set_zero_leaves(model: nn.Module, class_names) -> int:
    """Mark every module whose class name is in `class_names` a ZeRO-3 leaf; returns how many."""
    from deepspeed.utils import set_z3_leaf_module

    names = set(class_names)
    hits = [m for m in model.modules() if type(m).__name__ in names]
    found = {type(m).__name__ for m in hits}
    if names - found:
        raise PerfError(
            f"training.performance.zeroLeafModules: {sorted(names - found)} not in the model "
            f"(decoder layers are {sorted({type(m).__name__ for m in decoder_layers(model)})})"
        )
    for m in hits:
        set_z3_leaf_module(m, True)
    return len(hits)


def compile_layers(model: nn.Module, backend: str | None = None) -> int:
    """torch.compile each decoder layer's `forward` (hooks on the layer module stay eager)."""
    import torch._dynamo

    layers = decoder_layers(model)
    # one compiled graph per layer object (guards on the module); keep them all cached
    cfg = torch._dynamo.config
    for knob in (
        "cache_size_limit",
        "recompile_limit",
        "accumulated_cache_size_limit",
        "accumulated_recompile_limit",
    ):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), 8 * len(layers) + 8))
    backend = backend or os.environ.get("MOE_COMPILE_BACKEND", "inductor")
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False)
    return len(layers)


def apply_before_initialize(model: nn.Module, spec: PerfSpec, device: torch.device) -> list[str]:
    """Apply the model-side options (before `deepspeed.initialize`); returns what was done."""
    done = []
    if spec.zero_leaf_modules:
        n = set_zero_leaves(model, spec.zero_leaf_modules)
        done.append(f"{n} ZeRO-3 leaf modules ({', '.join(spec.zero_leaf_modules)})")
    if spec.fused_loss:
        install_fused_loss(model, spec.loss_chunk_tokens)
        done.append(f"fused LM head + cross-entropy ({spec.loss_chunk_tokens} tokens per chunk)")
    if spec.compile_layers:
        n = compile_layers(model)
        done.append(f"torch.compile of {n} decoder layers")
    return done


def fused_optimizer_ok(spec: PerfSpec, device: torch.device) -> bool:
    return spec.fused_optimizer and device.type == "cuda"


# DeepSpeed versions whose ZeRO-3 step the lean step was checked against (install_zero3_fused_step)
LEAN_STEP_DEEPSPEED = ("0.19.",)


def _lean_step_stage3(zero_opt) -> bool:
    """Whether ``zero_opt`` is the DeepSpeed ZeRO-3 optimizer whose step the lean-step installs
    replace parts of: ``DeepSpeedZeroOptimizer_Stage3`` of a version in ``LEAN_STEP_DEEPSPEED``
    (other versions keep their own step), without optimizer offload."""
    import deepspeed
    from deepspeed.runtime.zero import stage3

    return (
        isinstance(zero_opt, stage3.DeepSpeedZeroOptimizer_Stage3)
        and deepspeed.__version__.startswith(LEAN_STEP_DEEPSPEED)
        and not getattr(zero_opt, "offload_optimizer", True)
    )


def install_zero3_fused_step(zero_opt) -> list[str]:
    """Lean ZeRO-3 optimizer step around torch's fused AdamW, on a DeepSpeed 0.19
    ``DeepSpeedZeroOptimizer_Stage3`` (``engine.optimizer``); returns what was installed (nothing
    when the optimizer is not that, the step is not the plain GPU path, or DeepSpeed is not a
    version in ``LEAN_STEP_DEEPSPEED``).

    DeepSpeed's step multiplies every fp32 gradient partition by ``1 / (loss scale x clip
    factor)`` (``unscale_and_clip_grads``, even when that is 1) and then runs the optimizer, a
    second full pass over the gradients. Torch's fused AdamW divides by ``grad_scale`` inside
    its kernel (the hook ``torch.amp.GradScaler`` uses), so the factor is handed over instead:
    the same update, up to the rounding of a division instead of a multiply by the reciprocal;
    when the factor is 1 (clipping does not trigger, bf16 has no loss scale) none is handed over.
    The gradient norm for clipping is taken per fp32 gradient in fp32 (DeepSpeed's
    ``get_norm_dtype`` casts each one to fp64 first: a copy twice its size); the per-tensor norms
    are still summed as DeepSpeed does."""
    from deepspeed.runtime.zero import stage3

    inner = getattr(zero_opt, "optimizer", None)
    if not (
        _lean_step_stage3(zero_opt)
        and isinstance(inner, torch.optim.AdamW)
        and inner.defaults.get("fused")
        and not getattr(zero_opt, "torch_autocast_gradscaler", None)
        and not getattr(zero_opt, "zenflow", False)
        and not getattr(zero_opt, "use_muon", False)
        and all(
            hasattr(zero_opt, a)
            for a in ("clip_grad", "loss_scale", "fp32_partitioned_groups_flat")
        )
    ):
        return []

    last: dict = {"norm": None, "scale": None}  # one factor per step, for every sub-group

    def unscale_and_clip_grads(sub_group_id, total_norm):
        if last["norm"] is total_norm:
            inner.grad_scale = last["scale"]
            return
        combined = zero_opt.loss_scale
        if zero_opt.clip_grad > 0.0:
            clip = ((total_norm / zero_opt.loss_scale) + 1e-6) / zero_opt.clip_grad
            combined = torch.clamp(clip, min=1.0) * zero_opt.loss_scale
        if isinstance(combined, torch.Tensor):
            # A factor of exactly 1 (no clipping, no loss scale) goes as no scale at all: the
            # kernel then neither divides nor writes the gradients back. Asking costs no wait:
            # DeepSpeed's step has just read this norm on the host (``is_invalid_grad_norm``).
            if bool(combined == 1):
                inner.grad_scale = None
            else:
                grad = zero_opt.fp32_partitioned_groups_flat[sub_group_id].grad
                inner.grad_scale = combined.to(device=grad.device, dtype=torch.float32).reshape(1)
        else:
            inner.grad_scale = None if combined == 1 else torch.tensor([float(combined)])
        last["norm"], last["scale"] = total_norm, inner.grad_scale

    zero_opt.unscale_and_clip_grads = unscale_and_clip_grads
    done = ["clipping scale inside fused AdamW"]
    if callable(getattr(stage3, "get_norm_dtype", None)):
        stage3.get_norm_dtype = _fp32_norm_dtype
        done.append("gradient norm in fp32")
    import torch.distributed as dist

    stock_norm = getattr(zero_opt, "get_grad_norm_direct", None)
    if callable(stock_norm) and (not dist.is_initialized() or dist.get_world_size() == 1):

        def grad_norm_direct(gradients, params, norm_type=2):
            """One rank: every gradient counts once and nothing is reduced, so DeepSpeed's norm is
            the 2-norm of the per-tensor 2-norms. DeepSpeed casts each 16-bit gradient to fp32
            first (a copy of every gradient); the multi-tensor norm accumulates in fp32 from the
            16-bit values in one pass. An inf/nan norm is -1, as DeepSpeed returns it."""
            grads = list(gradients)
            if float(norm_type) != 2.0 or not grads:
                return stock_norm(gradients, params, norm_type)
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            total = torch.sum(torch.pow(torch.stack(norms), 2.0)) ** 0.5
            bad = total.isinf().logical_or(total.isnan())
            return torch.where(bad, torch.full_like(total, -1.0), total)

        zero_opt.get_grad_norm_direct = grad_norm_direct
        done.append("gradient norm in one multi-tensor pass (one rank)")
    return done


def _fp32_norm_dtype() -> torch.dtype:
    return torch.float32


def install_single_rank_grads(zero_opt) -> list[str]:
    """On one rank, hand each 16-bit gradient straight to its ZeRO-3 gradient partition (in
    DeepSpeed's gradient-accumulation dtype: the 16-bit one by default under bf16, or fp32): one
    copy (or add, when accumulating micro-batches) per parameter, on the compute stream. Returns
    what was installed (nothing unless the whole job is one rank, the optimizer is a DeepSpeed
    ``DeepSpeedZeroOptimizer_Stage3`` of a version in ``LEAN_STEP_DEEPSPEED``, and none of the
    features that reshape gradients on their way is on: offload, ZenFlow, Muon, AutoTP folding,
    gradient pre-division).

    DeepSpeed's reduce path is built for many ranks and runs unchanged on one: it copies each
    gradient into a bucket, concatenates the bucket for ``reduce_scatter_coalesced`` (a second
    copy), divides it by the world size of one, "reduce-scatters" it, converts the partition to
    the accumulation dtype and copies that into the partition buffer. With one rank every
    partition is the whole gradient, so the result is the same bits as one copy: the gradient
    rounded to the communication dtype (as the stock path rounds it), then copied or added in the
    accumulation dtype. The copy is ``torch._foreach_copy_`` (what FSDP2 casts with). Anything
    the hand-off does not cover (a partition whose size is not the gradient's, a parameter
    DeepSpeed does not hold a partition for) goes the stock way."""
    import torch.distributed as dist

    if not (
        _lean_step_stage3(zero_opt)
        and (not dist.is_initialized() or dist.get_world_size() == 1)
        and not getattr(zero_opt, "zenflow", False)
        and not getattr(zero_opt, "use_muon", False)
        and getattr(zero_opt, "autoep_folding_tp_group", None) is None
        and getattr(zero_opt, "gradient_predivide_factor", None) == 1.0
        and getattr(zero_opt, "sequence_parallel_size", 1) == 1
    ):
        return []
    parts = getattr(zero_opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None)
    stock = getattr(zero_opt, "reduce_independent_p_g_buckets_and_remove_grads", None)
    if not isinstance(parts, dict) or stock is None:
        return []
    done = ["gradients straight into their ZeRO-3 partitions (one rank)"]
    fallback, freed = stock, _free_reduce_buckets(zero_opt)
    if freed is not None:
        done.append("reduce bucket freed (unused with the hand-off)")

        def fallback(param) -> None:
            freed()
            stock(param)

    @torch.no_grad()
    def hand_off(param) -> None:
        if not getattr(param, "ds_grad_is_ready", True):  # the stock path's own check
            return
        grad, part = param.grad, parts.get(getattr(param, "ds_id", None))
        if (
            grad is None
            or part is None
            or grad.numel() != part.numel()
            or zero_opt.autoep_folding_tp_group is not None  # configured after initialize
        ):
            fallback(param)
            return
        comm = zero_opt.get_param_comm_dtype(param)
        if grad.dtype != comm:
            grad = grad.to(comm)
        if zero_opt.micro_step_id == 0:
            # the multi-tensor copy casts with the types known at compile time, in aligned vector
            # loads; Tensor.copy_ from bf16 to fp32 takes CUDA's per-element dynamic-cast loop
            torch._foreach_copy_([part], [grad.reshape(-1)])
        else:
            part.add_(grad.reshape(-1))
        param.grad = None

    zero_opt.reduce_independent_p_g_buckets_and_remove_grads = hand_off
    return done


def _free_reduce_buckets(zero_opt):
    """Free DeepSpeed's reduce buckets (``contiguous_gradients``: one ``reduce_bucket_size``
    buffer per gradient dtype, allocated at initialize), which the hand-off leaves unused;
    returns the function that allocates them again (for a gradient that takes the stock path),
    or None when there is nothing to free."""
    buckets = getattr(zero_opt, "ipg_buckets", None)
    if not isinstance(buckets, dict) or not buckets:
        return None
    if not all(isinstance(getattr(b, "buffer", None), torch.Tensor) for b in buckets.values()):
        return None
    shapes = {dtype: (b.buffer.numel(), b.buffer.device) for dtype, b in buckets.items()}
    for dtype, b in buckets.items():
        b.buffer = torch.empty(0, dtype=dtype, device=shapes[dtype][1])

    def allocate() -> None:
        for dtype, b in buckets.items():
            numel, device = shapes[dtype]
            if b.buffer is not None and b.buffer.numel() < numel:
                b.buffer = torch.empty(numel, dtype=dtype, device=device)

    return allocate


def install_flat_sub_group_grads(zero_opt) -> list[str]:
    """The optimizer step's fp32 gradient of each sub-group without DeepSpeed's two copies.
    Returns what was installed (nothing unless the optimizer is a DeepSpeed
    ``DeepSpeedZeroOptimizer_Stage3`` of a version in ``LEAN_STEP_DEEPSPEED`` without optimizer
    offload).

    DeepSpeed keeps the rank's gradient partitions in one flat buffer in its gradient-accumulation
    dtype and, for each sub-group, concatenates them (``torch.cat``: a copy) and converts the
    result to fp32 (a second copy, in CUDA's per-element dynamic-cast loop). The partitions of a
    sub-group lie next to each other in that buffer, so the same values are one slice of it: with
    fp32 accumulation (``data_types.grad_accum_dtype``) the slice itself is the gradient (no copy);
    with 16-bit accumulation one multi-tensor copy casts it. A sub-group whose partitions are not
    one slice (a frozen parameter's zeros) goes the stock way. The optimizer may write into the
    gradient it is handed (fused AdamW unscales in place when given ``grad_scale``); the slice is
    overwritten by the next step's first micro-batch, as DeepSpeed's copy would have been."""
    stock = getattr(zero_opt, "_prepare_fp32_grad_for_sub_group", None)
    if not (
        _lean_step_stage3(zero_opt)
        and callable(stock)
        and isinstance(getattr(zero_opt, "grad_partitions_flat_buffer", None), torch.Tensor)
    ):
        return []

    def prepare(sub_group_id: int) -> None:
        fp32 = zero_opt.fp32_partitioned_groups_flat[sub_group_id]
        flat = _one_slice(
            zero_opt.averaged_gradients[sub_group_id], zero_opt.grad_partitions_flat_buffer
        )
        if flat is None or flat.numel() != fp32.numel() or flat.device != fp32.device:
            stock(sub_group_id)
            return
        if flat.dtype == fp32.dtype:
            fp32.grad = flat
        else:
            grad = torch.empty_like(fp32)
            torch._foreach_copy_([grad], [flat])
            fp32.grad = grad
        zero_opt.averaged_gradients[sub_group_id] = None

    zero_opt._prepare_fp32_grad_for_sub_group = prepare
    accum = zero_opt.grad_partitions_flat_buffer.dtype
    return [
        "fp32 gradients as slices of the gradient partitions (fp32 accumulation, no copy)"
        if accum == torch.float32
        else f"fp32 gradients cast from one slice of the {str(accum).removeprefix('torch.')} "
        "gradient partitions (one copy)"
    ]


def _one_slice(tensors, buffer: torch.Tensor) -> torch.Tensor | None:
    """``buffer``'s slice that ``tensors`` (1-D views of it, in order) tile, or None."""
    if not tensors:
        return None
    base = buffer.untyped_storage().data_ptr()
    start = expected = None
    for t in tensors:
        if (
            t.dtype != buffer.dtype
            or t.dim() != 1
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != base
            or (expected is not None and t.storage_offset() != expected)
        ):
            return None
        if start is None:
            start = t.storage_offset()
        expected = t.storage_offset() + t.numel()
    assert start is not None and expected is not None
    offset = start - buffer.storage_offset()
    if offset < 0 or expected - buffer.storage_offset() > buffer.numel():
        return None
    return buffer.narrow(0, offset, expected - start)
