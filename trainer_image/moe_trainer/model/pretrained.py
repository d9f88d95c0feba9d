"""Pretrained weights under ZeRO-3, the plan applied, without any rank holding the whole model.

When the plan names ``model.path`` (a Hugging Face model directory), the trainer

1. builds the model from the plan's ``hfConfig`` inside ``deepspeed.zero.Init`` with weight
   initialisation switched off (transformers' ``no_init_weights``): each parameter is partitioned
   over its ZeRO group as soon as its module exists, so a rank never holds more than one module's
   parameters whole, and nothing is initialised that is about to be overwritten;
2. streams the checkpoint into the partitions (:func:`load`): tensor by tensor, in shard order,
   each rank reading through ``safe_open(...).get_slice`` only the rows of dim 0 that cover its
   own slice of the flattened tensor (a bounded number of rows at a time), expert tensors
   assembled slot by slot from the original experts the plan's permutation puts there (router
   rows and per-expert router buffers likewise), so the placement is applied while loading;
3. then ``deepspeed.initialize`` runs as for a fresh model: the optimizer's fp32 master copy is
   made from these partitions, and AutoEP (when on) re-partitions each MoE layer's experts over
   its expert-parallel layout, gathering one layer's experts at a time from the partitions (that
   transient is the loading peak the memory model counts, ``core.memory.loading_bytes``); the
   dedup dispatcher swaps those layers' class afterwards and needs no weights of its own.

Peak host memory per rank: this rank's partitions (it holds nothing else of the model) + the
rows being copied (:data:`CHUNK_ELEMENTS` at most, or one expert) + the pages of the one shard
being read (its memory map is closed before the next shard is opened).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_trainer import families
from moe_trainer.model import models
from moe_trainer.model.hf_checkpoint import (
    CheckpointError,
    ShardReader,
    Source,
    numel,
    sources,
    weight_map,
)

log = logging.getLogger("moe_trainer.model.pretrained")

# Rows are read in blocks of at most this many elements (64 Mi elements = 128 MiB in bf16),
# except that one row (one expert, one embedding row) is always read whole.
CHUNK_ELEMENTS = 64 << 20

__all__ = ["CheckpointError", "build_empty", "load", "original_experts"]


def ds_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype ZeRO-3 keeps the 16-bit (or fp32) parameters in."""
    if (ds_config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds_config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def build_empty(hf_config: dict, ds_config: dict[str, Any]) -> nn.Module:
    """The model of ``hf_config``, its parameters ZeRO-3 partitioned and not initialised."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage", 0) != 3:
        raise models.ModelError(
            "model.path: loading pretrained weights needs ZeRO stage 3 "
            f"(deepspeed.zero_optimization.stage is {zero.get('stage', 0)})"
        )
    if (zero.get("offload_param") or {}).get("device") == "nvme":
        raise models.ModelError(
            "model.path: loading pretrained weights into NVMe-offloaded parameters is not "
            "supported (deepspeed.zero_optimization.offload_param.device 'nvme')"
        )
    if zero.get("zero_hpz_partition_size", 1) > 1:
        raise models.ModelError(
            "model.path: loading pretrained weights with ZeRO++ hpZ "
            "(zero_hpz_partition_size > 1) is not supported"
        )
    dtype = ds_dtype(ds_config)
    config = models.build_hf_config(hf_config)
    # zero.Init's dtype comes from the config (bf16 / fp16 / else fp32): DeepSpeed 0.19.8 reads an
    # explicit ``dtype`` argument wrongly where the accelerator lacks fp16 (CPU: bf16 for fp32)
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def _partition_of(param: nn.Parameter) -> tuple[torch.Tensor, int, int] | None:
    """(this rank's flat partition, its first element, its length) of a ZeRO-3 parameter;
    None for an ordinary tensor."""
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return None
    if getattr(param, "ds_secondary_tensor", None) is not None:
        raise models.ModelError(f"{param.ds_id}: hpZ secondary partitions are not supported")
    group = getattr(param, "ds_process_group", None)
    rank = dist.get_rank(group=group) if dist.is_initialized() else 0
    size = int(part.ds_numel)
    return part, rank * size, size


def _model_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))


@torch.no_grad()
def _fill(target: torch.Tensor, src: Source) -> int:
    """Copy ``src`` into ``target``'s partition (or whole tensor); returns elements copied."""
    shape = src.shape
    total = numel(shape)
    row = numel(shape[1:]) if shape else 1
    nrows = shape[0] if shape else 1
    part = _partition_of(target) if isinstance(target, nn.Parameter) else None
    if part is None:
        flat_dst, start, end = target.data.view(-1), 0, total
    else:
        flat_dst, start, size = part
        end = min(start + size, total)
        if start >= total:
            return 0  # only padding on this rank
    r0, r1 = start // row, math.ceil(end / row)
    step = max(1, CHUNK_ELEMENTS // max(row, 1))
    copied = 0
    for c0 in range(r0, min(r1, nrows), step):
        c1 = min(r1, c0 + step, nrows)
        block = src.rows(c0, c1).reshape(-1)
        lo, hi = max(start, c0 * row), min(end, c1 * row)
        flat_dst[lo - start : hi - start].copy_(block[lo - c0 * row : hi - c0 * row])
        copied += hi - lo
    return copied


def _tensors(model: nn.Module, fam: families.Family) -> dict[str, torch.Tensor]:
    """Every parameter (each once) and every per-expert router buffer of the model, by name."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    wanted = set(fam.router_buffers)
    out.update({n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in wanted})
    return out


def load(
    model: nn.Module,
    path: str | Path,
    permutation,
    *,
    rank: int = 0,
) -> dict[str, Any]:
    """Stream the checkpoint at ``path`` into ``model`` (built by :func:`build_empty`, or an
    ordinary model), experts placed as ``permutation`` says (None: original order). Returns
    what was read (tensors, bytes, seconds, unused checkpoint tensors)."""
    t0 = time.perf_counter()
    fam = families.of_model(model)
    wmap = weight_map(path)
    reader = ShardReader(path, wmap)
    targets = _tensors(model, fam)
    try:
        srcs, unused = sources(
            model,
            fam,
            reader,
            permutation,
            [(n, _model_shape(t)) for n, t in targets.items()],
        )
        copied = 0
        for src in srcs:
            t = targets[src.name]
            copied += _fill(t, src)
    finally:
        reader.close()
    if unused and rank == 0:
        log.info(
            "model.path: %d checkpoint tensor(s) the model has no parameter for, not read "
            "(e.g. %s)",
            len(unused),
            unused[:3],
        )
    report = {
        "tensors": len(srcs),
        "elementsCopied": copied,
        "bytesRead": reader.bytes_read,
        "seconds": round(time.perf_counter() - t0, 3),
        "unused": unused,
    }
    if rank == 0:
        log.info(
            "loaded %d tensors from %s: %.1f MiB read by rank 0 in %.1fs",
            report["tensors"],
            path,
            reader.bytes_read / 2**20,
            report["seconds"],
        )
    return report


def original_experts(model: nn.Module, path: str | Path) -> list[dict[str, torch.Tensor]]:
    """Each MoE layer's expert tensors as the checkpoint has them, original order
    ``[layer][name][E, ...]`` (for the placement check of tests and first runs only: it reads
    every expert into memory)."""
    fam = families.of_model(model)
    reader = ShardReader(path, weight_map(path))
    from moe_trainer.model.hf_checkpoint import moe_names

    names = moe_names(model, fam)
    tensors = [(n, None) for b in names.values() for n in (b.gate_up, b.down)]
    params = dict(model.named_parameters())
    try:
        srcs, _ = sources(
            model, fam, reader, None, [(n, _model_shape(params[n])) for n, _ in tensors]
        )
        by_name = {s.name: s.rows(0, s.shape[0]) for s in srcs}
    finally:
        reader.close()
    return [
        {"gate_up_proj": by_name[b.gate_up], "down_proj": by_name[b.down]}
        for b in sorted(names.values(), key=lambda b: b.layer)
    ]
