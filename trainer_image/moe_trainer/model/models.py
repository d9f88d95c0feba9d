"""Hugging Face MoE models for the trainer: build, find the MoE blocks, apply the placement.

The supported families and where each keeps its router and expert tensors are in
``moe_trainer/families/`` (transformers 5.x layout: `model.layers[i].mlp` with a router
`gate.weight[E, H]` (+ per-expert router buffers such as DeepSeek's
`gate.e_score_correction_bias[E]`) and stacked experts `experts.gate_up_proj[E, 2F, H]`,
`experts.down_proj[E, H, F]`; dense layers are not MoE layers).

A placement permutes each layer's experts together with the router's output rows, so the model
computes the same function while original expert `permutation[l][s]` sits in slot `s` (and so on
EP rank `s // (E / ep_size)`, since DeepSpeed AutoEP places slots contiguously).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from moe_trainer import families
from moe_trainer.families import FamilyError

# Tiny debug sizes for CPU tests (~0.1-3 M parameters each), one per family (its module's
# ``tiny_config``).
TINY_HF_CONFIGS: dict[str, dict] = families.TINY_HF_CONFIGS
FAMILY_TO_AUTOEP_PRESET = families.AUTOEP_PRESETS
EXPERT_PARAM_NAMES = ("gate_up_proj", "down_proj")


class ModelError(FamilyError):
    """The model cannot be built or does not have the MoE layout the trainer expects."""


@dataclass
class MoELayerRef:
    """One MoE block of the model, by MoE-layer index (0..numLayers-1, dense layers skipped)."""

    index: int
    decoder_layer: int
    name: str  # module path, e.g. "model.layers.1.mlp"
    block: nn.Module

    @property
    def gate(self) -> nn.Module:
        return self.block.gate

    @property
    def experts(self) -> nn.Module:
        return self.block.experts


def build_hf_config(hf_config: dict):
    from transformers import AutoConfig

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"model.hfConfig: cannot build a {model_type!r} config: {exc}") from exc
    # Router logits are captured by the trainer's own hooks; HF's summed aux loss is not used.
    config.output_router_logits = False
    return config


def build_model(
    hf_config: dict | None = None,
    path: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> nn.Module:
    """A causal-LM MoE model from a config dict (random init, seeded) or a local directory.

    `device`: where a config-built model is created and initialised (a multi-billion-parameter
    model initialises in seconds on a GPU, in minutes on the host CPU); None = CPU."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if path:
        if not os.path.isdir(path):
            raise ModelError(
                f"model.path: {path!r} is not a local directory (no hub access at run time)"
            )
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    elif hf_config is not None:
        with torch.device(device or "cpu"):
            model = AutoModelForCausalLM.from_config(build_hf_config(hf_config), dtype=dtype)
    else:
        raise ModelError("model: neither hfConfig nor path given")
    model.config.use_cache = False
    return model


def find_moe_layers(model: nn.Module) -> list[MoELayerRef]:
    """The MoE blocks in decoder-layer order: modules `*.layers.<i>.mlp` with `experts` and a
    router."""
    refs = []
    for name, module in model.named_modules():
        parts = name.split(".")
        # HF blocks have `gate`; AutoEP layers have `router` (aliased as `gate` only for some
        # presets)
        if (
            len(parts) >= 3
            and parts[-1] == "mlp"
            and parts[-3] == "layers"
            and hasattr(module, "experts")
            and (hasattr(module, "gate") or hasattr(module, "router"))
        ):
            refs.append(
                MoELayerRef(index=len(refs), decoder_layer=int(parts[-2]), name=name, block=module)
            )
    return refs


def num_experts_of(model: nn.Module) -> int:
    cfg = model.config
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(cfg, attr, None):
            return int(getattr(cfg, attr))
    raise ModelError(f"config of {type(model).__name__} names no expert count")


def top_k_of(model: nn.Module) -> int:
    return int(model.config.num_experts_per_tok)


@torch.no_grad()
def permute_experts(model: nn.Module, permutation: Sequence[Sequence[int]]) -> None:
    """Reorder each MoE layer's experts in place: new slot s <- original expert permutation[l][s].

    Permutes, along dim 0, the router weight rows (and DeepSeek's score-correction bias) and every
    3-D expert tensor. Function preserving: the router's softmax/sigmoid scores move with the
    experts they score, so every token reaches the same experts with the same weights.
    Call before `deepspeed.initialize` (parameters are still whole tensors).
    """
    layers = find_moe_layers(model)
    if len(permutation) != len(layers):
        raise ModelError(
            f"placement.permutation: {len(permutation)} rows, the model has {len(layers)} MoE "
            "layers"
        )
    num_experts = num_experts_of(model)
    fam = families.of_model(model)
    for ref, row in zip(layers, permutation, strict=True):
        if sorted(row) != list(range(num_experts)):
            raise ModelError(
                f"placement.permutation[{ref.index}]: not a permutation of 0..{num_experts - 1}"
            )
        idx = torch.as_tensor(list(row), dtype=torch.long)
        targets = [ref.gate.weight]
        for name in fam.router_buffers:
            buf = getattr(ref.gate, name, None)
            if buf is not None:
                targets.append(buf)
        for _pname, p in ref.experts.named_parameters(recurse=False):
            if p.dim() >= 2 and p.shape[0] == num_experts:
                targets.append(p)
        if len(targets) < 2:
            raise ModelError(f"{ref.name}: found no expert tensors to permute")
        for t in targets:
            t.data.copy_(t.data.index_select(0, idx.to(t.device)))


def original_expert_tensors(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Detached copies of each MoE layer's expert tensors, indexed [layer][name][expert, ...]."""
    return [
        {n: p.detach().clone() for n, p in ref.experts.named_parameters(recurse=False)}
        for ref in find_moe_layers(model)
    ]


BlockFactory = Callable[[nn.Module, object], nn.Module]


def swap_moe_blocks(model: nn.Module, factory: BlockFactory) -> int:
    """Replace every MoE block with `factory(block, config)` (the seam for alternative MoE kernels).

    The replacement must be function preserving and keep `gate` (router with `.weight[E, H]`)
    so the trainer's router hooks and placement still apply.
    """
    layers = find_moe_layers(model)
    for ref in layers:
        parent = model.get_submodule(ref.name.rsplit(".", 1)[0])
        parent.mlp = factory(ref.block, model.config)
    return len(layers)


def apply_moe_impl(model: nn.Module, impl: str) -> None:
    """`hf`: keep the Hugging Face blocks; `grouped`: stacked experts + torch._grouped_mm."""
    if impl == "hf":
        return
    if impl == "grouped":
        try:
            from moe_trainer.model import (
                grouped_moe,  # part 2 of issue 5, owned by another engineer
            )
        except ImportError as exc:
            raise ModelError(
                f"training.moeImpl: 'grouped' needs moe_trainer.model.grouped_moe ({exc})"
            ) from exc
        factory = getattr(grouped_moe, "from_hf_block", None)
        if factory is None:
            raise ModelError(
                "training.moeImpl: moe_trainer.model.grouped_moe has no from_hf_block(block, "
                "config)"
            )
        swap_moe_blocks(model, factory)
        return
    raise ModelError(f"training.moeImpl: {impl!r} is not 'hf' or 'grouped'")


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
