"""The model families the planner supports: one module per family, one :class:`FamilySpec` each.

A family is everything the operator knows about one kind of Hugging Face MoE model: which
``config.json`` ``model_type`` values it covers, how such a config parses into a
:class:`~..model_spec.MoEModelSpec` (shapes, limits, parameter counts, router groups), its
presets, whether DeepSpeed 0.19.8's AutoEP has a preset for it (otherwise its experts train as
ordinary ZeRO-3 parameters through the trainer's own MoE block) and the decoder layer class the
planner's ZeRO-3 leaf-module option names. The trainer keeps the matching entry on its side
(``moe_trainer/families/``): HF classes, tensor names, checkpoint mapping.

Adding a family = one module here + one in ``moe_trainer/families/`` + tests
(docs/architecture.md "Adding a model family").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import DocumentError
from ..model_spec import MoEModelSpec

Parser = Callable[[dict[str, Any], str], MoEModelSpec]


@dataclass(frozen=True)
class FamilySpec:
    """One model family, operator side.

    ``name``: the plan's ``model.family`` (AutoEP's preset names where it has one).
    ``model_types``: the ``config.json`` ``model_type`` values it reads. ``refused_model_types``:
    neighbouring values it recognises and refuses with a reason (a multimodal wrapper whose text
    backbone is the trainable model). ``parse(cfg, where)`` -> spec; raises DocumentError naming
    ``where.<field>``. ``presets``: name -> HF config dict (``architectures`` is added).
    ``grouped_block``: the trainer's grouped MoE block reproduces this family's MoE block (the
    planner may pick ``moeImpl: grouped``). ``smoke_config``: the gate's small model, if the
    gate's smoke run covers this family.
    """

    name: str
    model_types: tuple[str, ...]
    architecture: str
    parse: Parser
    autoep_preset: str | None
    decoder_layer_class: str
    grouped_block: bool = False
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    published_totals: dict[str, float] = field(default_factory=dict)
    published_active: dict[str, float] = field(default_factory=dict)
    smoke_config: dict[str, Any] | None = None
    refused_model_types: dict[str, str] = field(default_factory=dict)


# What every tiny debug model (CPU tests) shares: the byte tokenizer (256 bytes + BOS 256 /
# EOS 257 / PAD 258, vocabulary padded to 320, a multiple of 64), hidden 64, 4 heads, 512
# positions, untied embeddings. A family's tiny preset is
# ``dict(<family base>, **TINY, <its own dims>)``.
BYTE_TOKENS: dict[str, Any] = dict(bos_token_id=256, eos_token_id=257, pad_token_id=258)
TINY: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    **BYTE_TOKENS,
)


def text_backbone_only(wrapper: str, model_type: str, architecture: str) -> str:
    """``refused_model_types``' reason for a multimodal wrapper whose text backbone
    (``model_type``, ``architecture``) is the trainable model."""
    return (
        f"the multimodal {wrapper} wrapper; AutoEP and the trainer train its text backbone "
        f"(model_type {model_type!r}, {architecture})"
    )


def _load() -> dict[str, FamilySpec]:
    from . import (
        deepseek_v2,
        deepseek_v3,
        minimax_m3,
        mixtral,
        olmoe,
        qwen3_5_moe,
        qwen3_moe,
    )

    specs = [
        mixtral.FAMILY,
        qwen3_moe.FAMILY,
        qwen3_5_moe.FAMILY,
        deepseek_v2.FAMILY,
        deepseek_v3.FAMILY,
        minimax_m3.FAMILY,
        olmoe.FAMILY,
    ]
    return {f.name: f for f in specs}


REGISTRY: dict[str, FamilySpec] = _load()
NAMES: tuple[str, ...] = tuple(REGISTRY)
MODEL_TYPES: tuple[str, ...] = tuple(t for f in REGISTRY.values() for t in f.model_types)


def get(name: str, where: str = "model.family") -> FamilySpec:
    """The family named ``name``; DocumentError listing the supported ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise DocumentError(
            f"{where}: {name!r} is not a supported family; supported: {', '.join(NAMES)}"
        ) from None


def for_model_type(model_type: Any, where: str = "hfConfig") -> FamilySpec:
    """The family that reads ``config.json`` files of this ``model_type``."""
    for fam in REGISTRY.values():
        if model_type in fam.model_types:
            return fam
    for fam in REGISTRY.values():
        if model_type in fam.refused_model_types:
            raise DocumentError(
                f"{where}.model_type: {model_type!r} is not supported: "
                f"{fam.refused_model_types[model_type]}"
            )
    supported = ", ".join(t for f in REGISTRY.values() for t in f.model_types)
    raise DocumentError(
        f"{where}.model_type: {model_type!r} is not supported; supported: {supported}"
    )


def refusal(model_type: Any) -> str | None:
    """Why a recognised but refused ``model_type`` (a multimodal wrapper) is not trained."""
    for fam in REGISTRY.values():
        if model_type in fam.refused_model_types:
            return f"model_type {model_type!r}: {fam.refused_model_types[model_type]}"
    return None


def autoep_presets() -> dict[str, str]:
    """family -> DeepSpeed AutoEP preset name, for the families that have one."""
    return {f.name: f.autoep_preset for f in REGISTRY.values() if f.autoep_preset}


def presets() -> dict[str, tuple[FamilySpec, dict[str, Any]]]:
    """Every preset name -> (its family, its HF config dict, not copied)."""
    out: dict[str, tuple[FamilySpec, dict[str, Any]]] = {}
    for fam in REGISTRY.values():
        for name, cfg in fam.presets.items():
            if name in out:
                raise RuntimeError(f"preset {name!r} is defined by two families")
            out[name] = (fam, cfg)
    return out
