"""The DeepSpeed config of a plan: ZeRO-3, AutoEP expert parallelism, batch sizes, precision.

Rules (docs/planning.md has the table):

* ZeRO stage 3, buckets by Hugging Face's "auto" rules (``reduce_bucket_size = h*h``,
  ``stage3_prefetch_bucket_size = 0.9*h*h``, ``stage3_param_persistence_threshold = 10*h``;
  DeepSpeed counts elements, not bytes).
* ``train_batch_size = micro x accumulation x DP`` with DP = world size (ZeRO shards over every
  rank; AutoEP adds expert-data-parallel groups inside that, it does not shrink DP).
* bf16 on compute capability >= 8.0, else fp16 with dynamic loss scaling; CPU: fp32.
* AutoEP (``expert_parallel``) for the families DeepSpeed 0.19.8 has presets for; otherwise
  ZeRO-3 with experts as ordinary parameters.
* User overrides are deep-merged last. Unsafe ones give a warning; combinations DeepSpeed 0.19.8
  rejects (engine ``_validate_zero3_moe_compatibility``, ``validate_folding_global``, removed
  keys) are refused here with a :class:`FieldError`, before any pod starts.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from . import families
from .errors import FieldError
from .model_spec import MoEModelSpec

# family -> DeepSpeed 0.19.8 AutoEP preset (module_inject/auto_ep_presets/), from core.families
AUTOEP_PRESETS = families.autoep_presets()
# every preset DeepSpeed 0.19.8 registers (module_inject/auto_ep_presets/registry.py)
DEEPSPEED_AUTOEP_PRESETS = (
    "mixtral",
    "qwen3_moe",
    "qwen3_5_moe",
    "deepseek_v2",
    "deepseek_v3",
    "minimax_m3",
)

# A bucket larger than this many elements is almost certainly a units mistake (bytes vs elements).
HUGE_BUCKET_ELEMENTS = 2_000_000_000


@dataclass(frozen=True)
class GpuCaps:
    """What the config needs to know about the accelerator; ``None`` compute capability = CPU."""

    name: str = "cpu"
    memory_bytes: int = 0
    compute_capability: str | None = None

    @property
    def is_cpu(self) -> bool:
        return self.compute_capability is None

    @property
    def supports_bf16(self) -> bool:
        if self.compute_capability is None:
            return False
        major, _, minor = self.compute_capability.partition(".")
        return (int(major), int(minor or 0)) >= (8, 0)


CPU = GpuCaps()


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` merged into a copy of ``base``: dicts recurse, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def batch_sizes(*, world_size: int, global_batch: int, micro_batch: int | None) -> tuple[int, int]:
    """``(micro_batch, grad_accum)`` with ``global = micro x accum x world_size``.

    Without a micro batch, take the largest micro batch <= 16 that divides the per-rank batch
    (fewest accumulation steps at a size that usually fits)."""
    if world_size < 1:
        raise FieldError("worldSize", f"{world_size} must be >= 1")
    if global_batch < 1:
        raise FieldError("globalBatch", f"{global_batch} must be >= 1")
    if global_batch % world_size:
        raise FieldError(
            "globalBatch",
            f"{global_batch} is not divisible by the data-parallel size "
            f"{world_size} (ZeRO shards over every rank); use a multiple of {world_size}",
        )
    per_rank = global_batch // world_size
    if micro_batch is None:
        micro_batch = max(d for d in range(1, min(per_rank, 16) + 1) if per_rank % d == 0)
    if micro_batch < 1:
        raise FieldError("microBatch", f"{micro_batch} must be >= 1")
    if per_rank % micro_batch:
        raise FieldError(
            "microBatch",
            f"{micro_batch} does not divide the per-rank batch {per_rank} "
            f"(globalBatch {global_batch} / {world_size} ranks); global = micro x accumulation x "
            f"{world_size}",
        )
    return micro_batch, per_rank // micro_batch


def choose_ep_size(group_sizes: list[int], num_experts: int, world_size: int) -> int:
    """Largest EP size that divides ``num_experts`` and ``world_size`` and keeps every EP group
    (``ep`` consecutive ranks) inside one NVLink group.

    ``group_sizes``: the number of ranks in each NVLink group, in rank order (ranks are laid out
    group after group). Blocks of ``ep`` consecutive ranks never straddle a group boundary iff
    ``ep`` divides every group size, so the answer is ``gcd(num_experts, *group_sizes)``; with
    no NVLink every group has size 1 and EP falls back to 1.
    """
    if sum(group_sizes) != world_size:
        raise FieldError(
            "worldSize", f"{world_size} ranks but the NVLink groups hold {sum(group_sizes)}"
        )
    return math.gcd(num_experts, *group_sizes)


def _base_config(
    model: MoEModelSpec,
    *,
    world_size: int,
    micro: int,
    accum: int,
    gpu: GpuCaps,
    gradient_clipping: float,
    lr: float,
    warmup_steps: int,
    weight_decay: float,
    include_optimizer: bool,
) -> dict[str, Any]:
    h = model.hidden_size
    cfg: dict[str, Any] = {
        "train_batch_size": micro * accum * world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": gradient_clipping,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": not gpu.is_cpu,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "sub_group_size": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    if include_optimizer:
        cfg["optimizer"] = {
            "type": "AdamW",
            # torch's AdamW on CPU (DeepSpeed's FusedAdam needs CUDA); FusedAdam on GPU.
            "params": {
                "lr": lr,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": weight_decay,
                "torch_adam": gpu.is_cpu,
            },
        }
        if warmup_steps > 0:
            cfg["scheduler"] = {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": lr,
                    "warmup_num_steps": warmup_steps,
                    "warmup_type": "linear",
                },
            }
    if gpu.supports_bf16:
        cfg["bf16"] = {"enabled": True}
    elif not gpu.is_cpu:
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return cfg


def deepspeed_config(
    model: MoEModelSpec,
    *,
    world_size: int,
    ep_size: int,
    global_batch: int,
    micro_batch: int | None = None,
    gpu: GpuCaps = CPU,
    autoep: bool = True,
    native_moe: bool = False,
    overrides: dict[str, Any] | None = None,
    gradient_clipping: float = 1.0,
    lr: float = 1e-3,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    include_optimizer: bool = False,
) -> tuple[dict[str, Any], list[str]]:
    """The complete DeepSpeed config and the warnings a person should read.

    ``native_moe``: the model uses ``deepspeed.moe.layer.MoE`` (refused under ZeRO-3).
    ``include_optimizer``: add DeepSpeed ``optimizer`` (AdamW) and ``scheduler`` (WarmupLR)
    blocks. Off by default: the trainer then builds torch AdamW and its warmup + cosine schedule
    from the plan's ``training`` block, and no FusedAdam JIT build (~47 s on a fresh H200) is
    needed. The memory model's 12 B/param Adam states hold either way.
    """
    if ep_size < 1 or model.num_experts % ep_size:
        raise FieldError("epSize", f"{ep_size} does not divide numExperts {model.num_experts}")
    if world_size % ep_size:
        raise FieldError("epSize", f"{ep_size} does not divide worldSize {world_size}")
    micro, accum = batch_sizes(
        world_size=world_size, global_batch=global_batch, micro_batch=micro_batch
    )
    warnings: list[str] = []
    cfg = _base_config(
        model,
        world_size=world_size,
        micro=micro,
        accum=accum,
        gpu=gpu,
        gradient_clipping=gradient_clipping,
        lr=lr,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        include_optimizer=include_optimizer,
    )
    use_autoep = autoep and not native_moe
    if use_autoep and model.family not in AUTOEP_PRESETS:
        warnings.append(
            f"AutoEP has no preset for family {model.family!r}: experts train as "
            "ordinary ZeRO-3 parameters (no expert parallelism)"
        )
        use_autoep = False
    if use_autoep:
        cfg["expert_parallel"] = {
            "enabled": True,
            "autoep_size": ep_size,
            "preset_model": AUTOEP_PRESETS[model.family],
        }
        if ep_size == 1:
            warnings.append(
                "epSize 1: AutoEP replaces the MoE blocks but every rank holds all "
                "experts (no all-to-all)"
            )
    elif ep_size != 1 and not native_moe:
        raise FieldError(
            "epSize",
            f"{ep_size} needs AutoEP; without it experts are ordinary "
            "ZeRO-3 parameters and the EP size must be 1",
        )
    if overrides:
        cfg = deep_merge(cfg, overrides)
    warnings += check_config(
        cfg,
        model=model,
        world_size=world_size,
        ep_size=ep_size,
        gpu=gpu,
        native_moe=native_moe,
        overridden=set(overrides or {}),
    )
    return cfg, warnings


def check_config(
    cfg: dict[str, Any],
    *,
    model: MoEModelSpec,
    world_size: int,
    ep_size: int,
    gpu: GpuCaps,
    native_moe: bool = False,
    overridden: AbstractSet[str] = frozenset(),
) -> list[str]:
    """Refuse what DeepSpeed 0.19.8 rejects (or what would break the plan); return warnings."""
    warnings: list[str] = []
    zero = cfg.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise FieldError("deepspeed.zero_optimization.stage", f"{stage!r} is not 0, 1, 2 or 3")
    ep_cfg = cfg.get("expert_parallel") or {}
    autoep = bool(ep_cfg.get("enabled", False))

    micro = cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps")
    total = cfg.get("train_batch_size")
    if not (
        isinstance(micro, int)
        and isinstance(accum, int)
        and isinstance(total, int)
        and min(micro, accum, total) > 0
        and total == micro * accum * world_size
    ):
        raise FieldError(
            "deepspeed.train_batch_size",
            f"{total!r} != train_micro_batch_size_per_gpu "
            f"{micro!r} x gradient_accumulation_steps {accum!r} x data-parallel size {world_size}",
        )

    for key in ("mics_shard_size", "mics_hierarchical_params_gather"):
        if key in zero:
            raise FieldError(
                f"deepspeed.zero_optimization.{key}",
                "MiCS was removed in DeepSpeed 0.19.8 (and is unavailable with AutoEP + ZeRO-3)",
            )
    if native_moe and stage == 3:
        raise FieldError(
            "deepspeed.zero_optimization.stage",
            "3 rejects DeepSpeed's native MoE "
            "layer (deepspeed.moe.layer.MoE); use AutoEP or ZeRO stage 1/2",
        )
    if autoep:
        if ep_cfg.get("autoep_size", 1) != ep_size:
            raise FieldError(
                "deepspeed.expert_parallel.autoep_size",
                f"{ep_cfg.get('autoep_size')!r} differs from the plan's epSize "
                f"{ep_size} (the placement is computed for {ep_size})",
            )
        preset = ep_cfg.get("preset_model")
        if preset is not None and preset not in DEEPSPEED_AUTOEP_PRESETS:
            raise FieldError(
                "deepspeed.expert_parallel.preset_model",
                f"{preset!r} is not a DeepSpeed 0.19.8 AutoEP preset",
            )
        etp = ep_cfg.get("expert_tensor_parallel_size", 1)
        if etp != 1:
            raise FieldError(
                "deepspeed.expert_parallel.expert_tensor_parallel_size",
                f"{etp} is not supported by AutoEP (must be 1)",
            )
        if stage == 3:
            hpz = zero.get("zero_hpz_partition_size", 1)
            if hpz > 1:
                raise FieldError(
                    "deepspeed.zero_optimization.zero_hpz_partition_size",
                    f"{hpz} (ZeRO++ hpZ) is refused by AutoEP + ZeRO-3; leave it at 1",
                )
            if zero.get("zero_quantized_gradients"):
                raise FieldError(
                    "deepspeed.zero_optimization.zero_quantized_gradients",
                    "refused by AutoEP + ZeRO-3; set it to false",
                )
            sp = cfg.get("sequence_parallel_size", 1)
            if sp != 1:
                raise FieldError(
                    "deepspeed.sequence_parallel_size",
                    f"{sp}: sequence parallelism is refused by AutoEP + ZeRO-3",
                )
        else:
            warnings.append(
                f"ZeRO stage {stage} with AutoEP works, but the product is built and "
                "tested for stage 3 (the memory estimate assumes stage 3)"
            )
    elif stage != 3:
        warnings.append(
            f"ZeRO stage {stage}: the product targets stage 3 (the memory estimate assumes stage 3)"
        )

    bf16 = bool((cfg.get("bf16") or {}).get("enabled", False))
    fp16 = bool((cfg.get("fp16") or {}).get("enabled", False))
    if bf16 and fp16:
        raise FieldError(
            "deepspeed.fp16.enabled", "true as well as deepspeed.bf16.enabled: both true; pick one"
        )
    if bf16 and not gpu.is_cpu and not gpu.supports_bf16:
        raise FieldError(
            "deepspeed.bf16.enabled",
            f"{gpu.name} (compute capability {gpu.compute_capability}) has no bf16; use fp16",
        )
    if gpu.supports_bf16 and not bf16:
        warnings.append(
            f"bf16 is off on {gpu.name}, which supports it: "
            + (
                "fp16 needs loss scaling and can overflow"
                if fp16
                else "fp32 doubles parameter memory and is far slower"
            )
        )
    if gpu.is_cpu and (bf16 or fp16):
        warnings.append(
            "half precision on CPU: gloo and CPU kernels are slow or unsupported for bf16/fp16"
        )

    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "allgather_bucket_size"):
        value = zero.get(key)
        if isinstance(value, (int, float)) and value > HUGE_BUCKET_ELEMENTS:
            warnings.append(
                f"zero_optimization.{key} = {value:.3g} elements: buckets count "
                "elements, not bytes; this one holds "
                f"{value * 2 / 2**30:.1f} GiB in 16-bit"
            )
    if "zero_optimization" in overridden and stage == 3:
        for key in ("stage3_param_persistence_threshold",):
            value = zero.get(key, 0)
            if value > 100 * model.hidden_size * model.hidden_size:
                warnings.append(
                    f"zero_optimization.{key} = {value:.3g}: parameters below it are "
                    "kept whole on every rank (not sharded)"
                )
    return warnings
