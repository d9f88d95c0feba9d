"""MoE models the planner can name: presets, Hugging Face ``config.json`` parsing, resolution.

Each supported family lives in one module of ``core/families/`` (its config parser, presets,
AutoEP preset); this module is the entry point that dispatches a config to its family by
``model_type``. The trainer gets the full Hugging Face config dict through the plan
(``model.hfConfig``) and builds the model from it, so presets return complete HF config dicts
that ``transformers.AutoConfig.for_model(**cfg)`` (5.17.0) accepts.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import families
from .errors import DocumentError
from .model_spec import (
    MAX_EXPERT_LAYER_CELLS,
    MAX_EXPERTS,
    MODEL_LIMITS,
    MLADims,
    MoEModelSpec,
    ParamCounts,
)

__all__ = [
    "FAMILIES",
    "MAX_EXPERTS",
    "MAX_EXPERT_LAYER_CELLS",
    "MODEL_LIMITS",
    "PUBLISHED_TOTALS",
    "WEIGHT_FILES",
    "MLADims",
    "MoEModelSpec",
    "ParamCounts",
    "ResolvedModel",
    "preset_hf_config",
    "preset_names",
    "resolve_model",
    "spec_from_hf_config",
]

# the config.json model_type values the planner reads (the family names: families.NAMES)
FAMILIES = families.MODEL_TYPES


@dataclass(frozen=True)
class ResolvedModel:
    """A model the plan can name: its spec, its full HF config and where it came from."""

    spec: MoEModelSpec
    hf_config: dict[str, Any]
    preset: str | None
    path: str | None


# Files that make a folder a loadable checkpoint (transformers' from_pretrained).
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")

_PRESETS = families.presets()
# Published totals the tests check the counts against (parameters, model cards).
PUBLISHED_TOTALS = {
    name: n for fam in families.REGISTRY.values() for name, n in fam.published_totals.items()
}
PUBLISHED_ACTIVE = {
    name: n for fam in families.REGISTRY.values() for name, n in fam.published_active.items()
}


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def preset_hf_config(name: str) -> dict[str, Any]:
    """A complete HF config dict for preset ``name`` (a fresh copy; safe to mutate)."""
    try:
        fam, preset = _PRESETS[name]
    except KeyError:
        raise DocumentError(
            f"model: unknown preset {name!r}; known presets: {', '.join(_PRESETS)}"
        ) from None
    cfg = copy.deepcopy(preset)
    cfg["architectures"] = [fam.architecture]
    if "rope_theta" in cfg:  # transformers 5 reads it from rope_parameters
        cfg.setdefault(
            "rope_parameters", {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        )
    cfg.setdefault("torch_dtype", "bfloat16")
    return cfg


def spec_from_hf_config(cfg: dict[str, Any], where: str = "hfConfig") -> MoEModelSpec:
    """Parse a HF ``config.json`` dict of a supported family into a :class:`MoEModelSpec`."""
    if not isinstance(cfg, dict):
        raise DocumentError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    return families.for_model_type(cfg.get("model_type"), where).parse(cfg, where)


def resolve_model(ref: str) -> ResolvedModel:
    """``ref`` is a preset name or the path of a HF ``config.json`` (or a folder holding one)."""
    if ref in _PRESETS:
        cfg = preset_hf_config(ref)
        return ResolvedModel(
            spec=spec_from_hf_config(cfg, f"preset {ref}"), hf_config=cfg, preset=ref, path=None
        )
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise DocumentError(
            f"model: {ref!r} is neither a known preset ({', '.join(_PRESETS)}) "
            "nor a config.json file"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DocumentError(f"model: cannot read {path}: {exc}") from None
    # The trainer loads weights from a folder (from_pretrained); a config alone means a fresh,
    # seeded initialisation from the hfConfig the plan carries (a plan naming the bare config
    # file failed in the trainer: "model.path ... is not a local directory").
    weights = any(next(path.parent.glob(pattern), None) for pattern in WEIGHT_FILES)
    return ResolvedModel(
        spec=spec_from_hf_config(cfg, str(path)),
        hf_config=cfg,
        preset=None,
        path=str(path.parent) if weights else None,
    )
