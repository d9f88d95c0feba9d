"""The planner's speed choices: the plan's ``training.performance`` block, ``training.moeImpl``
and the ZeRO-3 persistence threshold, each with the reason ``moectl plan`` prints.

Rules (docs/planning.md, measured in docs/performance.md):

* GPU plans only; CPU plans (the local demo, tests) keep every option off.
* ``fusedOptimizer``: torch ``AdamW(fused=True)`` unless the DeepSpeed config brings its own
  optimizer (one kernel over each parameter group instead of a dozen passes of ``foreach``).
* ``fusedLoss``: LM head + cross-entropy in token chunks: the ``[tokens, vocab]`` logits and
  their fp32 copies (``tokens x V x (p + 8)`` bytes) never exist at once.
* AutoEP at ``epSize`` 1 has nothing to parallelise: for the families the grouped MoE block
  reproduces (``FamilySpec.grouped_block``) the planner turns AutoEP off and uses
  ``moeImpl: grouped`` (one ``torch._grouped_mm`` per projection, no host sync), which also
  lets the next two apply.
* ``zeroLeafModules`` = the decoder layer class, ``compileLayers``: ZeRO-3 fetches a whole decoder
  layer at once (one pair of hooks per layer instead of one per submodule) and each layer's
  forward runs as one ``torch.compile``'d graph (RMSNorm, RoPE, SwiGLU, softmax fused). Only
  without AutoEP (its layers carry their own process groups and are not compiled here).
* One rank (``worldSize`` 1): ZeRO-3 partitions over one rank, so every parameter is made
  persistent (``stage3_param_persistence_threshold`` above the largest tensor): no per-step
  gather/release at all, for one extra 16-bit copy of the parameters (the memory model counts it);
  and the reduce bucket holds every gradient (``reduce_bucket_size`` = all parameters): one
  reduce after backward instead of one per large tensor, each of which DeepSpeed 0.19.8 tracks
  with an event it blocks the host on when more than two are in flight. With ``fusedOptimizer``
  on a bf16 GPU also ``data_types.grad_accum_dtype: fp32``: the trainer's hand-off casts each
  16-bit gradient once into its fp32 partition and the optimizer steps on slices of the
  partitions (``moe_trainer.model.perf.install_flat_sub_group_grads``), instead of DeepSpeed's
  concatenate-then-convert copy of every sub-group each step; +2 B per parameter.

Measured and not chosen: DeepSpeed's bf16 master weights (``bf16.bf16_master_weights_and_grads``
+ ``bf16_optimizer_states``) make the 3.4 B step ~9% faster but the 200-step loss curve ends ~5%
above the fp32-master path (outside the 3% tolerance; docs/performance.md). A user may set them in
``deepspeed.bf16``; the memory model counts them (``core.memory.optimizer_bytes``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from . import families
from .dsconfig import GpuCaps
from .model_spec import MoEModelSpec

DECODER_LAYER_CLASSES = {f.name: f.decoder_layer_class for f in families.REGISTRY.values()}
GROUPED_FAMILIES = tuple(f.name for f in families.REGISTRY.values() if f.grouped_block)
LOSS_CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class PerfChoice:
    performance: dict[str, Any]  # the plan's training.performance block
    moe_impl: str  # training.moeImpl
    autoep: bool  # whether AutoEP stays on
    zero_overrides: dict[str, Any]  # merged into deepspeed.zero_optimization
    notes: tuple[str, ...]
    data_types: dict[str, Any] = field(default_factory=dict)  # merged into deepspeed.data_types


def largest_tensor(spec: MoEModelSpec) -> int:
    """Elements of the model's largest parameter tensor (stacked experts count as one)."""
    h = spec.hidden_size
    cands = [
        spec.vocab_size * h,
        2 * spec.num_experts * spec.expert_intermediate_size * h,
        spec.dense_intermediate_size * 2 * h,
        spec.num_attention_heads * spec.head_dim * h,
    ]
    return max(cands)


def choose(
    spec: MoEModelSpec,
    *,
    world_size: int,
    ep_size: int,
    gpu: GpuCaps,
    autoep: bool,
    has_optimizer: bool = False,
    zero_stage: int = 3,
    user_perf: dict[str, Any] | None = None,
    user_zero: dict[str, Any] | None = None,
    user_data_types: dict[str, Any] | None = None,
) -> PerfChoice:
    """The fast settings for this model on this GPU set, and why."""
    if gpu.is_cpu:
        return PerfChoice({}, "hf", autoep, {}, ())
    notes: list[str] = []
    perf: dict[str, Any] = {}
    if not has_optimizer:
        perf["fusedOptimizer"] = True
        notes.append(
            "fusedOptimizer: torch AdamW(fused=True), one kernel per parameter group; under "
            "ZeRO-3 the clipping scale goes into that kernel and the clipping norm is taken in "
            "fp32 (no extra pass over the gradients, no fp64 copy)"
        )
    perf["fusedLoss"] = True
    perf["lossChunkTokens"] = LOSS_CHUNK_TOKENS
    notes.append(
        f"fusedLoss: LM head + cross-entropy in chunks of {LOSS_CHUNK_TOKENS} tokens "
        f"(no [tokens x {spec.vocab_size}] fp32 logits)"
    )
    use_autoep, moe_impl = autoep, "hf"
    if autoep and ep_size == 1 and spec.family in GROUPED_FAMILIES:
        use_autoep, moe_impl = False, "grouped"
        notes.append(
            "moeImpl grouped, AutoEP off: epSize 1 leaves AutoEP nothing to parallelise; "
            "the grouped block runs each expert projection as one grouped GEMM"
        )
    elif not autoep and spec.family in GROUPED_FAMILIES:
        moe_impl = "grouped"
        notes.append("moeImpl grouped: no AutoEP; each expert projection is one grouped GEMM")
    layer_cls = DECODER_LAYER_CLASSES.get(spec.family)
    if not use_autoep and layer_cls and zero_stage == 3:
        perf["zeroLeafModules"] = [layer_cls]
        notes.append(
            f"zeroLeafModules [{layer_cls}]: ZeRO-3 fetches a decoder layer at once "
            "(hooks per layer, not per submodule)"
        )
    if not use_autoep and layer_cls and gpu.supports_bf16:
        perf["compileLayers"] = True
        notes.append(
            "compileLayers: torch.compile of each decoder layer's forward (fused "
            "norms, RoPE, SwiGLU, router)"
        )
    if gpu.supports_bf16:
        notes.append(
            "fp32 master weights kept: DeepSpeed's bf16 master weights + bf16 optimizer "
            "states were faster on one H200 but their 200-step loss curve left the "
            "tolerance (docs/performance.md); set deepspeed.bf16 to opt in"
        )
    zero_overrides: dict[str, Any] = {}
    if world_size == 1 and zero_stage == 3:
        zero_overrides["stage3_param_persistence_threshold"] = largest_tensor(spec) + 1
        notes.append(
            "stage3_param_persistence_threshold above the largest tensor: one rank, so "
            "ZeRO-3 keeps every parameter whole (no per-step gathers; +1 16-bit copy)"
        )
        total = spec.counts().total
        zero_overrides["reduce_bucket_size"] = total
        notes.append(
            f"reduce_bucket_size {total} (all parameters): one rank, so gradients are "
            "reduced once after backward instead of once per large tensor (each reduce "
            "records an event DeepSpeed waits on, which stalls the host mid-backward)"
        )
    data_types: dict[str, Any] = {}
    if world_size == 1 and zero_stage == 3 and perf.get("fusedOptimizer") and gpu.supports_bf16:
        if "grad_accum_dtype" in (user_data_types or {}):
            notes.append("data_types.grad_accum_dtype: the user's setting is kept")
        else:
            data_types["grad_accum_dtype"] = "fp32"
            notes.append(
                "data_types.grad_accum_dtype fp32: one rank, so each 16-bit gradient is cast "
                "once into its fp32 partition and the optimizer steps on slices of those "
                "partitions (no per-step concatenate-and-convert copy; +2 B per parameter)"
            )
    if user_zero:
        for key in list(zero_overrides):
            if key in user_zero:
                zero_overrides.pop(key)
                notes.append(f"{key}: the user's override is kept")
    if user_perf:
        notes.extend(
            f"performance.{key}: set by the user ({user_perf[key]!r})" for key in user_perf
        )
        perf.update(copy.deepcopy(user_perf))
    perf["reasons"] = list(notes)
    return PerfChoice(perf, moe_impl, use_autoep, zero_overrides, tuple(notes), data_types)
