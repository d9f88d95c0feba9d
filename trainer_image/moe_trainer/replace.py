"""Re-placement in place: move every MoE layer's experts to new slots on a live ZeRO-3 engine.

``permutation[layer][slot]`` is the original expert in each slot (the plan's convention). Going
from ``old`` to ``new``, new slot ``s`` takes what old slot ``src[l][s]`` held (``src`` =
:func:`slot_sources`). Per MoE layer, along dim 0 (the slot):

* the router's tensors: ``weight[E, H]``, ``bias[E]`` when there is one, per-expert router
  buffers (DeepSeek's ``e_score_correction_bias``), AutoEP's ``expert_bias`` and
  ``tokens_per_expert``;
* the expert tensors: HF / grouped experts ``[E, ...]`` (every rank holds all slots), or AutoEP's
  ``GroupedExperts.w1/w3/w2[E_local, ...]`` (EP rank ``r`` holds slots ``r * E_local ..``): the
  rows a rank needs come from the EP ranks that hold them in one ``all_to_all_single`` per
  tensor, so no rank ever holds more than its own ``E_local`` slots of a tensor.

For every parameter the fp32 master copy and every per-element optimizer state (Adam's
``exp_avg`` / ``exp_avg_sq``) move with it, through DeepSpeed's supported API
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` and the ``safe_set_`` pair).
ZeRO-3's ``set_full_hp_param`` writes the fp32 partition only, not the low-precision partition
the forward gathers (``ds_tensor``) nor the full tensor of a persistent (always gathered)
parameter: both are refreshed here from the new fp32 master.

Function preserving: the router's scores move with the experts they score, so every token reaches
the same experts with the same weights; only the summation order of floating-point reductions can
change. Collective: every rank calls :func:`apply` with the same arguments, in step (between
optimizer steps: no gradients pending).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("moe_trainer.replace")

Permutation = Sequence[Sequence[int]]


class ReplaceError(RuntimeError):
    """The engine or the permutation does not allow an in-place re-placement."""


def slot_sources(old: Permutation, new: Permutation) -> list[list[int]]:
    """``src[l][s]``: the old slot that holds the expert new slot ``s`` of layer ``l`` gets."""
    if len(old) != len(new):
        raise ReplaceError(f"permutation: {len(new)} layers, the running one has {len(old)}")
    out = []
    for layer, (o, n) in enumerate(zip(old, new, strict=True)):
        if sorted(o) != sorted(n) or sorted(n) != list(range(len(n))):
            raise ReplaceError(f"permutation[{layer}] is not a permutation of 0..{len(o) - 1}")
        where = {int(e): s for s, e in enumerate(o)}
        out.append([where[int(e)] for e in n])
    return out


@dataclass
class _Target:
    name: str
    tensor: torch.Tensor  # a parameter (ZeRO-3) or a plain buffer
    expert_parallel: bool  # AutoEP experts: this rank holds E_local slots of an EP group


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))


def is_autoep(block: nn.Module) -> bool:
    return hasattr(block, "router") and hasattr(block, "ep_group") and hasattr(block, "experts")


def layer_targets(block: nn.Module, num_experts: int, router_name: str = "gate") -> list[_Target]:
    """The slot-indexed tensors of one MoE block (dim 0 = slot), in a fixed order."""
    autoep = is_autoep(block)
    router = block.router if autoep else getattr(block, router_name)
    out: list[_Target] = []
    seen: set[int] = set()

    def add(name: str, t: torch.Tensor | None, ep: bool, rows: int) -> None:
        if t is not None and id(t) not in seen and len(_shape(t)) >= 1 and _shape(t)[0] == rows:
            seen.add(id(t))
            out.append(_Target(name, t, ep))

    for n, p in router.named_parameters():
        add(f"router.{n}", p, False, num_experts)
    for n, b in router.named_buffers():
        add(f"router.{n}", b, False, num_experts)
    if autoep:
        for n in ("expert_bias", "tokens_per_expert"):
            add(n, getattr(block, n, None), False, num_experts)
        local = num_experts // int(block.ep_size)
        for n, p in block.experts.named_parameters(recurse=False):
            add(f"experts.{n}", p, int(block.ep_size) > 1, local)
    else:
        for n, p in block.experts.named_parameters(recurse=False):
            add(f"experts.{n}", p, False, num_experts)
    if not any(t.name.startswith("experts.") for t in out):
        raise ReplaceError(f"{type(block).__name__}: found no expert tensors to move")
    return out


def _exchange(
    local: torch.Tensor, src: list[int], ep_rank: int, ep_size: int, group
) -> torch.Tensor:
    """EP rank ``ep_rank``'s new ``[E_local, ...]`` slots from every EP rank's old ones: new slot
    ``s`` (global) takes old slot ``src[s]``, held by EP rank ``src[s] // E_local``."""
    n_local = local.shape[0]
    mine = range(ep_rank * n_local, (ep_rank + 1) * n_local)
    send_rows: list[int] = []  # my old local rows, grouped by receiver, in its slot order
    send_sizes = []
    for dst in range(ep_size):
        rows = [
            src[s] - ep_rank * n_local
            for s in range(dst * n_local, (dst + 1) * n_local)
            if src[s] // n_local == ep_rank
        ]
        send_rows += rows
        send_sizes.append(len(rows))
    recv_order = []  # my new local slots, grouped by sender, ascending
    recv_sizes = []
    for sender in range(ep_size):
        slots = [s - ep_rank * n_local for s in mine if src[s] // n_local == sender]
        recv_order += slots
        recv_sizes.append(len(slots))
    send = local.index_select(0, torch.as_tensor(send_rows, dtype=torch.long, device=local.device))
    recv = torch.empty_like(local)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    out = torch.empty_like(local)
    out[torch.as_tensor(recv_order, dtype=torch.long, device=local.device)] = recv
    return out


def optimizer_state_keys(engine) -> list[str]:
    """Per-element optimizer states of the engine's optimizer (Adam: exp_avg, exp_avg_sq); none
    before its first step."""
    inner = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    keys: set[str] = set()
    for st in getattr(inner, "state", {}).values():
        keys |= {k for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1}
    return sorted(keys)


def _move_param(
    p: nn.Parameter, reorder: Callable[[torch.Tensor], torch.Tensor], keys: list[str]
) -> None:
    """fp32 master, optimizer states and the low-precision copies of one ZeRO-3 parameter."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    if not hasattr(p, "ds_id"):
        raise ReplaceError("parameter is not a ZeRO-3 parameter (re-placement needs stage 3)")
    if not p.requires_grad:
        raise ReplaceError("parameter is frozen (no fp32 master to move)")
    shape = _shape(p)
    for key in keys:
        state = safe_get_full_optimizer_state(p, key)
        if state is not None:
            safe_set_full_optimizer_state(p, reorder(state.view(shape)), key)
    master = reorder(safe_get_full_fp32_param(p).view(shape))
    safe_set_full_fp32_param(p, master)
    local = safe_get_local_fp32_param(p)
    p.ds_tensor.data.copy_(local.view(-1)[: p.ds_tensor.numel()].view_as(p.ds_tensor))
    if p.ds_status == ZeroParamStatus.AVAILABLE and p.data.numel() == master.numel():
        p.data.copy_(master.view(p.data.shape).to(p.data.dtype))  # persistent: forward reads it


@torch.no_grad()
def apply(
    engine,
    blocks: Sequence[nn.Module],
    old: Permutation,
    new: Permutation,
    router_name: str = "gate",
) -> dict:
    """Move every layer's slots from ``old`` to ``new`` (collective). Returns a summary:
    ``{"layers": moved layers, "tensors": tensors moved, "stateKeys": [...]}``."""
    sources = slot_sources(old, new)
    if len(sources) != len(blocks):
        raise ReplaceError(f"permutation: {len(sources)} layers, the model has {len(blocks)}")
    keys = optimizer_state_keys(engine)
    moved = tensors = 0
    for block, src in zip(blocks, sources, strict=True):
        if src == list(range(len(src))):
            continue
        moved += 1
        idx_cache: dict[torch.device, torch.Tensor] = {}

        def index(dev: torch.device, src=src, cache=idx_cache) -> torch.Tensor:
            if dev not in cache:
                cache[dev] = torch.as_tensor(src, dtype=torch.long, device=dev)
            return cache[dev]

        for target in layer_targets(block, len(src), router_name):
            t = target.tensor
            if target.expert_parallel:
                group = block.ep_group
                ep_rank, ep_size = dist.get_rank(group=group), dist.get_world_size(group=group)
                if ep_rank != int(block.ep_rank):
                    raise ReplaceError(f"EP group rank {ep_rank} != the layer's ep_rank")

                def reorder(x, src=src, r=ep_rank, n=ep_size, g=group):
                    return _exchange(x, src, r, n, g)
            else:

                def reorder(x, index=index):
                    return x.index_select(0, index(x.device))

            if isinstance(t, nn.Parameter):
                _move_param(t, reorder, keys)
            else:
                t.copy_(reorder(t))
            tensors += 1
    return {"layers": moved, "tensors": tensors, "stateKeys": keys}
