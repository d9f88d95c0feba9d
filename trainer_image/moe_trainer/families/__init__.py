"""The model families the trainer trains: one module per family, one :class:`Family` each.

A family is what the trainer needs to know about one kind of Hugging Face MoE model (the operator
keeps its planning side in ``moejob_operator.core.families``; the two meet only through the
plan's ``model.family``):

* which ``config.json`` ``model_type`` values it covers and the causal-LM class transformers
  5.17.0 builds for them (``AutoModelForCausalLM``);
* where an MoE block keeps its router (``router``: ``.weight[E, H]``, plus per-expert
  ``router_buffers[E]`` such as DeepSeek's ``e_score_correction_bias``) and its experts
  (``experts``: ``gate_up_proj[E, 2F, H]`` = [gate; up], ``down_proj[E, H, F]``): what a placement
  permutes, what the loader fills and what the export writes;
* its shared-expert submodules (``shared_modules``: not per expert, not permuted; AutoEP keeps
  them as ``shared_experts`` / ``shared_experts_gate``);
* how its checkpoints name those tensors on disk (``per_expert``: one ``experts.<e>.<name>.weight``
  per expert and projection, as transformers' ``save_pretrained`` and the hub files write them;
  None: the stacked tensors themselves), module renames between disk and model (``renames``,
  both ways) and prefixes of hub layouts read but not written (``load_prefixes``);
* whether DeepSpeed 0.19.8's AutoEP has a preset for it (``autoep_preset``) or its experts train
  as ordinary ZeRO-3 parameters inside the trainer's own grouped MoE block
  (``grouped_block``: ``moe_trainer.model.grouped_moe`` reproduces its block exactly);
* its tiny test model (``tiny_config``), the one every test of the family builds.

Adding a family = one module here + one in ``core/families/`` + tests (docs/architecture.md
"Adding a model family").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class FamilyError(ValueError):
    """The model is not of a family the trainer supports (exit 78)."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    causal_lm_class: str
    moe_block_class: str
    autoep_preset: str | None
    tiny_name: str
    tiny_config: dict[str, Any]
    grouped_block: bool = False
    router: str = "gate"
    router_buffers: tuple[str, ...] = ()
    experts: str = "experts"
    shared_modules: tuple[str, ...] = ()  # shared expert module (+ its gate) of a block
    per_expert: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    renames: tuple[tuple[str, str], ...] = ()
    load_prefixes: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = field(default=())

    def to_disk(self, name: str) -> str:
        """A model tensor name as this family's checkpoints spell it."""
        for disk, model in self.renames:
            name = name.replace(model, disk)
        return name

    def from_disk(self, name: str) -> str:
        """A checkpoint tensor name as the model spells it."""
        for disk, model in self.load_prefixes:
            if name.startswith(disk):
                name = model + name[len(disk) :]
        for disk, model in self.renames:
            name = name.replace(disk, model)
        return name


# What every family's tiny test model shares: the byte vocabulary padded to 320, hidden 64,
# 4 heads, 512 positions, untied embeddings. A ``tiny_config`` is
# ``{"model_type": ..., **TINY, <its own dims>}``.
TINY: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _load() -> dict[str, Family]:
    from . import (
        deepseek_v2,
        deepseek_v3,
        minimax_m3,
        mixtral,
        olmoe,
        qwen3_5_moe,
        qwen3_moe,
    )

    fams = [
        mixtral.FAMILY,
        qwen3_moe.FAMILY,
        qwen3_5_moe.FAMILY,
        deepseek_v2.FAMILY,
        deepseek_v3.FAMILY,
        minimax_m3.FAMILY,
        olmoe.FAMILY,
    ]
    return {f.name: f for f in fams}


REGISTRY: dict[str, Family] = _load()
NAMES: tuple[str, ...] = tuple(REGISTRY)


def get(name: str) -> Family:
    try:
        return REGISTRY[name]
    except KeyError:
        raise FamilyError(
            f"model.family: {name!r} is not a family the trainer supports ({', '.join(NAMES)})"
        ) from None


def for_model_type(model_type: str | None) -> Family:
    for fam in REGISTRY.values():
        if model_type in fam.model_types:
            return fam
    known = ", ".join(t for f in REGISTRY.values() for t in f.model_types)
    raise FamilyError(
        f"model.hfConfig.model_type: {model_type!r} is not a model type the trainer supports "
        f"({known})"
    )


def for_plan(family: str, hf_config: dict[str, Any] | None) -> Family:
    """The plan's family, checked against its ``hfConfig.model_type``."""
    fam = get(family)
    model_type = (hf_config or {}).get("model_type")
    if hf_config is not None and model_type not in fam.model_types:
        raise FamilyError(
            f"model.hfConfig.model_type: {model_type!r} differs from model.family {family!r} "
            f"(which reads {', '.join(fam.model_types)})"
        )
    return fam


def of_model(model: Any) -> Family:
    """The family of a built transformers model (by its config's ``model_type``)."""
    return for_model_type(getattr(model.config, "model_type", None))


TINY_HF_CONFIGS: dict[str, dict[str, Any]] = {f.tiny_name: f.tiny_config for f in REGISTRY.values()}
AUTOEP_PRESETS: dict[str, str] = {
    f.name: f.autoep_preset for f in REGISTRY.values() if f.autoep_preset is not None
}
GROUPED_BLOCK_CLASSES: tuple[str, ...] = tuple(
    f.moe_block_class for f in REGISTRY.values() if f.grouped_block
)
