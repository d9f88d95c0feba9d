"""Per-GPU memory estimate for ZeRO-3 (+ AutoEP) training, with the sum spelled out.

How DeepSpeed 0.19.8 shards (read from ``runtime/engine.py`` ``_partition_autoep_zero3_experts``
and ``runtime/zero/stage3.py``): dense parameters are ZeRO-3 partitioned over the whole
data-parallel group (``world_size`` ranks). AutoEP replaces every MoE block; each EP rank keeps
``num_experts / ep_size`` experts, and those expert parameters are ZeRO-3 partitioned over the
expert-data-parallel group (``world_size / ep_size`` ranks). So the *stored* expert bytes per GPU
are ``expert_params / ep / (world / ep) = expert_params / world`` either way; what AutoEP changes
is the *gathered* working set: a layer gathers only its ``E / ep`` local experts, not all ``E``.

Terms (bytes, per GPU; ``p`` = 2 for bf16/fp16, 4 for fp32):

* parameters: ``p * params / world`` + small params kept whole (numel below
  ``stage3_param_persistence_threshold``: norms, small routers); on one rank a whole parameter
  is a view of its partition (``_no_gather_coalesced``), so neither term adds anything there;
* gradients: same sharding, in the gradient-accumulation dtype (ZeRO-3 keeps the rank's
  partitions in one flat buffer of ``data_types.grad_accum_dtype``, default the 16-bit one), plus
  the 16-bit gradients on their way (with the trainer's one-rank hand-off, the largest one);
* optimizer: Adam, fp32 master + m + v = 12 bytes per sharded parameter;
* gathered: the largest module ZeRO-3 gathers (full ``p``-byte params plus their full gradient
  during backward, before the reduce-scatter) + the prefetch bucket; nothing on one rank;
* activations: see :func:`activation_bytes_per_token_layer` (saved tensors per token per layer,
  from the transformers 5.17.0 forward), times ``ACTIVATION_FACTOR`` (``COMPILED_ACTIVATION_FACTOR``
  with ``compileLayers``: the compiled layer saves fewer intermediates); with activation
  checkpointing only each layer's input is kept, plus one layer recomputed; plus the logits
  (``V * (p + 8)`` per token: bf16 logits, fp32 upcast and log-softmax in the loss);
* MoE dispatch: all-to-all send + receive buffers, ``tokens * top_k * h * p * capacity``;
* buffers: the gradient reduce bucket (ZeRO-3: one, plus its concatenated copy while it is
  reduced; ZeRO-1/2: two with ``overlap_comm``); none with the one-rank hand-off, which frees it;
* overhead: CUDA context, NCCL and cuBLAS workspaces (``GPU_CONTEXT_BYTES``) plus allocator
  fragmentation (``FRAGMENTATION`` of the dynamic total). On CPU, the process baseline.

The peak is ``max(forward/backward, optimizer step)``: at the step activations are gone but a
fp32 copy of one ``sub_group_size`` slice of the gradients is made (not with the trainer's lean
step and fp32 gradient accumulation: the slices are the partitions themselves).

Loading a pretrained checkpoint (``model.path``, :func:`loading_bytes`) has its own peak, before
any optimizer state exists: the rank's parameter partitions, plus, with AutoEP, one MoE layer's
experts gathered whole while AutoEP re-partitions them (and the rank's new local copy of them);
on the host the rows being copied and the pages of the one checkpoint shard being read. Where it
exceeds the training peak, ``loadingExtraBytes`` carries the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .models import MoEModelSpec

GiB = 1 << 30

# Calibrated on one H200 (bench-mixtral, bf16, seq 1024, ZeRO-3): the formula over-counted measured
# activation memory by 1/0.845 (micro-batch 16) and 1/0.855 (32); see docs/planning.md.
ACTIVATION_FACTOR = 0.85
# With compileLayers (torch.compile of each decoder layer; Inductor recomputes cheap pointwise ops
# instead of saving them): calibrated on one H200 (benchmarks/results/mfu_h200_run8.json, 3.4 B
# model, fp32 and bf16 gradient accumulation alike): the peak allocation less the states after the
# first step, the fused loss's buffers and the gradient in flight; see docs/planning.md.
COMPILED_ACTIVATION_FACTOR = 0.65
DEFAULT_CAPACITY_FACTOR = 2.0  # all-to-all receive buffer vs a perfectly balanced one
GPU_CONTEXT_BYTES = int(1.5 * GiB)  # CUDA context ~0.5 GiB + NCCL ~0.5 GiB + cuBLAS/workspaces
CPU_BASELINE_BYTES = int(0.6 * GiB)  # python + torch + deepspeed + transformers imported (RSS)
FRAGMENTATION = 0.10  # caching-allocator slack over the dynamic total
# fp32 temporaries of the optimizer step per element of the rank's partition (per sub-group): the
# fp32 gradient copy and one more of the same size (unscale/clip + torch's fused AdamW). Measured
# on the 2-GPU H200 (benchmarks/results/multigpu_h200x2_*): one GPU holding 816M elements peaked
# at 18.24 GiB allocated at micro-batch 4 and 8 alike = states 12.17 GiB + 8 B x 816M; 4 B (the
# earlier value) put that peak 3 GiB low.
STEP_TEMP_BYTES = 8
ADAM_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq
# deepspeed.bf16.bf16_master_weights_and_grads + bf16_optimizer_states: the 16-bit partition is
# the master (no copy), moments are bf16; the step's temporaries are bf16 too
BF16_MASTER_ADAM_BYTES = 4
BF16_MASTER_STEP_TEMP_BYTES = 4


def optimizer_bytes(dsconfig: dict[str, Any]) -> tuple[int, int]:
    """(optimizer-state bytes, optimizer-step temporary bytes) per element of the partition."""
    bf16 = dsconfig.get("bf16") or {}
    if (
        bf16.get("enabled")
        and bf16.get("bf16_master_weights_and_grads")
        and bf16.get("bf16_optimizer_states")
    ):
        return BF16_MASTER_ADAM_BYTES, BF16_MASTER_STEP_TEMP_BYTES
    return ADAM_BYTES, STEP_TEMP_BYTES


def grad_accum_bytes(dsconfig: dict[str, Any]) -> int:
    """Bytes per element of ZeRO's gradient partitions (``data_types.grad_accum_dtype``; DeepSpeed
    defaults it to the model's dtype)."""
    dtype = (dsconfig.get("data_types") or {}).get("grad_accum_dtype")
    if dtype is None:
        return precision_bytes(dsconfig)
    return {"fp32": 4, "fp16": 2, "bf16": 2}.get(str(dtype), 4)


def grad_handoff_applies(dsconfig: dict[str, Any], performance: dict[str, Any] | None) -> bool:
    """Whether the trainer hands gradients straight to their ZeRO-3 partitions (with
    ``training.performance.fusedOptimizer``, ZeRO-3, no optimizer offload; ``estimate_memory``
    checks the world size of one)."""
    zero = dsconfig.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    return (
        bool((performance or {}).get("fusedOptimizer"))
        and zero.get("stage", 0) >= 3
        and (offload in (None, "none"))
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """``breakdown``: term -> bytes (camelCase keys, as in the MoEPlan ``memory.breakdown``)."""

    breakdown: dict[str, int]
    total: int
    peak_phase: str  # "forward/backward" or "optimizer step"
    notes: tuple[str, ...] = field(default=())

    def fits(self, gpu_memory_bytes: int, headroom: float = 0.9) -> bool:
        return self.total <= headroom * gpu_memory_bytes

    def shortfall(self, gpu_memory_bytes: int, headroom: float = 0.9) -> int:
        """Bytes over the usable memory (<= 0 when it fits)."""
        return int(self.total - headroom * gpu_memory_bytes)

    def explain(self, gpu_memory_bytes: int | None = None, headroom: float = 0.9) -> str:
        rows = [(k.removesuffix("Bytes"), v) for k, v in self.breakdown.items()]
        width = max(len(k) for k, _ in [*rows, ("total (peak)", 0)])
        lines = [f"{'term':<{width}}  {'GiB':>9}  {'share':>6}"]
        for key, value in rows:
            lines.append(f"{key:<{width}}  {value / GiB:9.3f}  {value / max(self.total, 1):6.1%}")
        lines.append(f"{'total (peak)':<{width}}  {self.total / GiB:9.3f}")
        lines.append(f"peak during: {self.peak_phase}")
        if gpu_memory_bytes:
            verdict = "fits" if self.fits(gpu_memory_bytes, headroom) else "DOES NOT FIT"
            lines.append(
                f"{verdict}: {self.total / GiB:.2f} GiB of {gpu_memory_bytes / GiB:.2f} GiB "
                f"({headroom:.0%} usable = {headroom * gpu_memory_bytes / GiB:.2f} GiB)"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def precision_bytes(dsconfig: dict[str, Any]) -> int:
    half = (dsconfig.get("bf16") or {}).get("enabled") or (dsconfig.get("fp16") or {}).get(
        "enabled"
    )
    return 2 if half else 4


def activation_bytes_per_token_layer(model: MoEModelSpec, layer: int, p: int) -> int:
    """Bytes one token leaves saved for backward in decoder layer ``layer`` (no checkpointing).

    Attention: RMSNorm input (fp32 upcast, 4h) and output, q/k/v projections and their rotary
    copies, the attention output (SDPA/flash: no ``seq^2`` term) and o_proj input. Dense MLP
    (SwiGLU): input, gate, up, act(gate), act*up. MoE: router logits and probabilities (fp32),
    per routed copy the permuted input and SwiGLU intermediates, the weighted outputs; shared
    experts as a dense MLP.
    """
    h = model.hidden_size
    if model.mla is not None:
        m = model.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q_out = model.num_attention_heads * qk
        kv_out = model.num_attention_heads * (qk + m.v_head_dim) // 2  # k and v, averaged width
        lora = (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim
        attn = p * (lora + 3 * q_out + 3 * kv_out + 2 * h)
    else:
        q_out = model.num_attention_heads * model.head_dim
        kv_out = model.num_kv_heads * model.head_dim
        attn = p * (2 * h + 3 * q_out + 3 * kv_out + q_out)
    norms = 2 * (4 * h + p * h)
    if layer in model.moe_layer_ids:
        f, k, e = model.expert_intermediate_size, model.top_k, model.num_experts
        mlp = 8 * e + p * (h + k * (h + 4 * f) + k * h)
        mlp += p * (h + 4 * model.shared_expert_size) if model.shared_expert_size else 0
    else:
        mlp = p * (h + 4 * model.dense_intermediate_size)
    return int(attn + norms + mlp)


def _largest_gathered_module(model: MoEModelSpec, ep_size: int, autoep: bool) -> tuple[int, str]:
    """Elements of the largest module ZeRO-3 gathers at once, and its name."""
    experts_local = model.num_experts // ep_size if autoep else model.num_experts
    candidates = [
        (experts_local * model.expert_params(), f"experts ({experts_local} per rank)"),
        (model.vocab_size * model.hidden_size, "embedding / lm_head"),
        (model.dense_mlp_params(), "dense MLP"),
        (3 * model.hidden_size * model.shared_expert_size, "shared experts"),
    ]
    return max(candidates)


def _param_tensors(model: MoEModelSpec, ep: int) -> list[int]:
    """Element counts of the model's parameter tensors as one rank's module holds them
    (transformers 5.x layout: stacked experts are one tensor per projection; AutoEP keeps
    ``E / ep`` experts per rank)."""
    h = model.hidden_size
    tensors = [model.vocab_size * h, h]  # embedding, final norm
    if not model.tie_word_embeddings:
        tensors.append(model.vocab_size * h)  # lm_head
    for layer in range(model.num_layers):
        tensors += [h, h]  # the two layer norms
        tensors += model.attention_layer_tensors(layer)
        if layer in model.moe_layer_ids:
            e = model.num_experts // ep
            f = model.expert_intermediate_size
            tensors += [model.num_experts * h, e * 2 * f * h, e * h * f]  # router, gate_up, down
            if model.shared_expert_size:
                tensors += [h * model.shared_expert_size] * 3
            if model.shared_expert_gate:
                tensors.append(h)
        else:
            tensors += [h * model.dense_intermediate_size] * 3
    return [n for n in tensors if n > 0]


def _persistent_elements(model: MoEModelSpec, threshold: int, ep: int = 1) -> int:
    """Parameters at or below the persistence threshold stay whole on every rank (DeepSpeed
    keeps the full tensor besides its partition)."""
    return sum(n for n in _param_tensors(model, ep) if n <= threshold)


def fused_loss_bytes(model: MoEModelSpec, tokens: int, chunk: int, p: int) -> int:
    """Peak of the chunked LM head + cross-entropy (moe_trainer.model.perf): one chunk's fp32 logits
    (softmax in place) and their 16-bit copy, the fp32 weight-gradient accumulator and its
    16-bit copy, and the saved input gradient [tokens, h]."""
    c = min(chunk, tokens)
    v, h = model.vocab_size, model.hidden_size
    return c * v * (4 + p + p) + v * h * (4 + p + p) + tokens * h * p


# Rows the trainer reads at a time while loading (moe_trainer.model.pretrained.CHUNK_ELEMENTS), at
# fp32 (the widest checkpoint dtype it converts from).
LOAD_CHUNK_BYTES = (64 << 20) * 4


@dataclass(frozen=True)
class LoadingPeak:
    """Bytes per rank while ``model.path`` is streamed in (before the optimizer exists)."""

    partitions: int  # this rank's slice of every parameter, training precision
    autoep_layer: int  # one MoE layer's experts gathered whole + this rank's local copy
    host: int  # rows in flight + one checkpoint shard's pages (the device's on CPU plans)

    @property
    def device(self) -> int:
        return self.partitions + self.autoep_layer


def loading_bytes(
    model: MoEModelSpec,
    dsconfig: dict[str, Any],
    *,
    world_size: int,
    ep_size: int,
    largest_shard_bytes: int = 0,
) -> LoadingPeak:
    """The loading peak of :func:`estimate_memory`'s ``pretrained`` (docstring of the module).
    ``largest_shard_bytes``: the checkpoint's largest safetensors file, when known."""
    p = precision_bytes(dsconfig)
    counts = model.counts()
    partitions = int(p * counts.total / world_size)
    autoep = bool((dsconfig.get("expert_parallel") or {}).get("enabled"))
    layer = 0
    if autoep:
        experts = model.moe_layer_expert_params()
        layer = int(p * (experts + experts / ep_size))
    host = LOAD_CHUNK_BYTES + largest_shard_bytes
    return LoadingPeak(partitions, layer, host)


def estimate_memory(
    model: MoEModelSpec,
    dsconfig: dict[str, Any],
    *,
    world_size: int,
    ep_size: int,
    seq_len: int,
    micro_batch: int | None = None,
    activation_checkpointing: bool = False,
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
    device: str = "gpu",
    fused_loss_chunk: int | None = None,
    grad_handoff: bool = False,
    compiled_layers: bool = False,
    pretrained: bool = False,
    largest_shard_bytes: int = 0,
    expert_copies: int = 0,
) -> MemoryEstimate:
    """Peak memory per GPU (or per CPU process when ``device == 'cpu'``).

    ``fused_loss_chunk``: tokens per chunk of the fused LM head + cross-entropy
    (``training.performance.fusedLoss``); None = logits materialised (``tokens x V x (p + 8)``).
    ``grad_handoff``: the trainer's one-rank gradient hand-off (``fusedOptimizer`` on one rank,
    ZeRO-3; ``moe_trainer.model.perf.install_single_rank_grads``): each 16-bit gradient is copied
    into its ZeRO-3 partition as soon as it is produced and freed, so at most the largest one exists
    at a time instead of all of them (DeepSpeed's path keeps them in its bucket and concatenates
    it), and the unused reduce bucket is freed; at any world size with ZeRO-3 the optimizer step
    then takes its fp32 gradients as slices of fp32 partitions (no copy) where gradients accumulate
    in fp32. ``compiled_layers``: ``training.performance.compileLayers``. ``pretrained``: the
    weights are loaded from ``model.path`` (:func:`loading_bytes`; ``largest_shard_bytes`` the
    checkpoint's largest file when known). ``expert_copies``: the most extra expert copies one EP
    rank holds over all layers (``placement.replicas``); each is counted as a real expert
    (parameters + gradients + fp32 master + Adam moments, sharded as the rank's own experts are):
    conservative, as the dispatcher may instead send a copy's weights from its home each step,
    which needs no optimizer state."""
    p = precision_bytes(dsconfig)
    zero = dsconfig.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    autoep = bool((dsconfig.get("expert_parallel") or {}).get("enabled"))
    ep = ep_size if autoep else 1
    micro = micro_batch or dsconfig.get("train_micro_batch_size_per_gpu", 1)
    counts = model.counts()
    dense, expert = counts.dense, counts.expert

    def per_gpu(shard: bool) -> float:
        """Elements of params / grads / optimizer states a rank holds, sharded or not."""
        if shard:
            return (dense + expert) / world_size
        return dense + expert / ep

    params = per_gpu(stage >= 3) * p
    persistent = 0
    one_rank = world_size == 1  # a gathered parameter is a view of its partition
    if stage >= 3 and not one_rank:
        persistent = (
            _persistent_elements(model, zero.get("stage3_param_persistence_threshold", 100_000), ep)
            * p
        )
    accum = grad_accum_bytes(dsconfig) if stage >= 3 else p
    grads = per_gpu(stage >= 2) * accum
    handoff = grad_handoff and stage >= 3 and one_rank
    if handoff:  # + the 16-bit gradient on its way to its partition
        grads += max(_param_tensors(model, ep)) * p
    adam_bytes, step_temp_bytes = optimizer_bytes(dsconfig)
    if grad_handoff and stage >= 3 and accum == 4 and adam_bytes == ADAM_BYTES:
        step_temp_bytes -= 4  # the fp32 gradient slices are the partitions (no copy)
    optim = per_gpu(stage >= 1) * adam_bytes

    gathered = 0
    gathered_name = "none (stage < 3: parameters are resident)"
    if stage >= 3 and one_rank:
        gathered_name = "none (one rank: gathered parameters are views of their partitions)"
    elif stage >= 3:
        threshold = zero.get("stage3_param_persistence_threshold", 100_000)
        if max(_param_tensors(model, ep)) <= threshold:
            gathered_name = "none (every parameter persistent)"
        else:
            elements, gathered_name = _largest_gathered_module(model, ep, autoep)
            gathered = (2 * elements + zero.get("stage3_prefetch_bucket_size", 50_000_000)) * p

    tokens = seq_len * micro
    per_layer = [activation_bytes_per_token_layer(model, i, p) for i in range(model.num_layers)]
    if activation_checkpointing:
        act = tokens * (model.num_layers * p * model.hidden_size + 2 * max(per_layer))
    else:
        act = tokens * (sum(per_layer) + max(per_layer))  # + one layer of activation grads
    if fused_loss_chunk:
        logits = fused_loss_bytes(model, tokens, fused_loss_chunk, p)
    else:
        logits = tokens * model.vocab_size * (p + 8)
    factor = COMPILED_ACTIVATION_FACTOR if compiled_layers else ACTIVATION_FACTOR
    activations = int(factor * act) + logits
    dispatch = 0
    if autoep and ep > 1:
        dispatch = int(2 * tokens * model.top_k * model.hidden_size * p * capacity_factor)

    # ZeRO-3 allocates one contiguous reduce bucket per gradient dtype (stage3.py, "IPG") and
    # concatenates it for the reduce-scatter (one more copy of the filled part); the one-rank
    # hand-off frees it. ZeRO-1/2 double-buffer it with overlap_comm.
    bucket = zero.get("reduce_bucket_size", 500_000_000)
    if handoff:
        buffers = 0
    elif stage >= 3:
        buffers = (bucket + min(bucket, dense + expert)) * p
    else:
        buffers = bucket * p * (2 if zero.get("overlap_comm") else 1)

    copies = 0.0
    if expert_copies and autoep:
        edp = max(1, world_size // ep)  # expert-data-parallel ranks sharing one expert's shards
        elems = expert_copies * model.expert_params()
        copies = elems * (
            p / (edp if stage >= 3 else 1)
            + accum / (edp if stage >= 2 else 1)
            + adam_bytes / (edp if stage >= 1 else 1)
        )
    fwd_bwd = params + persistent + grads + optim + gathered + activations + dispatch + buffers
    fwd_bwd += copies
    sub_group = zero.get("sub_group_size", 1_000_000_000)
    step_temp = step_temp_bytes * min(per_gpu(stage >= 1), sub_group)
    step = params + persistent + grads + optim + step_temp + copies
    dynamic = max(fwd_bwd, step)
    loading_extra = 0
    load = None
    if pretrained:
        load = loading_bytes(
            model,
            dsconfig,
            world_size=world_size,
            ep_size=ep,
            largest_shard_bytes=largest_shard_bytes,
        )
        load_peak = load.device + (load.host if device == "cpu" else 0)
        loading_extra = max(0, load_peak - dynamic)
        dynamic += loading_extra
    base = CPU_BASELINE_BYTES if device == "cpu" else GPU_CONTEXT_BYTES
    overhead = base + FRAGMENTATION * dynamic
    breakdown = {
        "parametersBytes": int(params + persistent),
        "gradientsBytes": int(grads),
        "optimizerBytes": int(optim),
        "gatheredParametersBytes": int(gathered),
        "activationsBytes": int(activations),
        "moeDispatchBytes": int(dispatch),
        "buffersBytes": int(buffers),
        # > 0 only when the optimizer step (fp32 gradient copy, no activations) is the peak,
        # so that the terms always add up to the total
        "optimizerStepExtraBytes": int(max(0, step - fwd_bwd)),
        "overheadBytes": int(overhead),
    }
    if pretrained:
        breakdown["loadingExtraBytes"] = int(loading_extra)
    if expert_copies:
        breakdown["expertCopiesBytes"] = int(copies)
    notes = [
        f"precision {p} B/param, ZeRO stage {stage}, "
        + (
            f"AutoEP ep={ep} (expert shards over {world_size // ep} ranks)"
            if autoep
            else "no expert parallelism"
        ),
        f"largest gathered module: {gathered_name}",
        *(
            ["16-bit gradients handed to their partitions one at a time (reduce bucket freed)"]
            if handoff
            else []
        ),
        f"gradient partitions in {accum} B per element"
        + (" (data_types.grad_accum_dtype)" if "data_types" in dsconfig else ""),
        f"activations: {tokens} tokens/micro-batch, checkpointing "
        f"{'on' if activation_checkpointing else 'off'}, "
        f"{'compiled layers, ' if compiled_layers else ''}"
        + (
            f"fused loss ({fused_loss_chunk}-token chunks) {logits / GiB:.3f} GiB"
            if fused_loss_chunk
            else f"logits {logits / GiB:.3f} GiB"
        ),
    ]
    if load is not None:
        notes.append(
            f"loading model.path: {load.device / GiB:.3f} GiB on the "
            f"{'process' if device == 'cpu' else 'GPU'} (partitions "
            f"{load.partitions / GiB:.3f} + AutoEP layer {load.autoep_layer / GiB:.3f}), host "
            f"{load.host / GiB:.3f} GiB beyond the partitions (rows in flight + one shard)"
        )
    phase = "forward/backward" if fwd_bwd >= step else "optimizer step"
    return MemoryEstimate(
        breakdown=breakdown,
        total=int(dynamic + overhead),
        peak_phase="loading" if loading_extra > 0 else phase,
        notes=tuple(notes),
    )


def benchmark_estimate(
    *,
    device: str = "gpu",
    autoep: bool = True,
    activation_checkpointing: bool = False,
    preset: str = "bench-mixtral",
    seq_len: int = 1024,
    micro_batch: int = 16,
) -> MemoryEstimate:
    """The estimate for the trainer benchmark's run (one H200, bf16, seq 1024, micro-batch 16,
    world 1; benchmarks/memory_model.py) so a measured peak (``torch.cuda.max_memory_reserved``) can
    be set beside it.
    ``device='cpu'``: the same model in fp32 on one CPU process."""
    from .dsconfig import CPU, GpuCaps, deepspeed_config
    from .models import resolve_model

    spec = resolve_model(preset).spec
    gpu = CPU if device == "cpu" else GpuCaps("NVIDIA H200", 150754820096, "9.0")
    cfg, _ = deepspeed_config(
        spec,
        world_size=1,
        ep_size=1,
        global_batch=micro_batch,
        micro_batch=micro_batch,
        gpu=gpu,
        autoep=autoep,
    )
    return estimate_memory(
        spec,
        cfg,
        world_size=1,
        ep_size=1,
        seq_len=seq_len,
        micro_batch=micro_batch,
        device=device,
        activation_checkpointing=activation_checkpointing,
    )
