"""From a ModelReport (what the inspection pod read from ``spec.model.path``) to the model the
planner plans from, or the reason the operator cannot train it.

The inspection program states facts (``moe_contracts.model``); this module decides: an MoE family
the planner knows, weights it can read (safetensors, no shard missing or cut short), dtypes the
trainer trains (``TRAINABLE_DTYPES``), a tokenizer whose ids fit the model's vocabulary. The
accepted model is a :class:`~.models.ResolvedModel` built from the report's ``config`` exactly as
from ``spec.model.hfConfig``: the memory estimate, the placement and the router groups cannot
tell the two apart.
"""

from __future__ import annotations

from moe_contracts.model import TRAINABLE_DTYPES, ModelReport

from . import families
from .errors import DocumentError, FieldError
from .models import FAMILIES, ResolvedModel, spec_from_hf_config

FIELD = "spec.model.path"

# condition reasons of a refused model (docs/operator.md)
MODEL_NOT_FOUND = "ModelNotFound"
MODEL_CONFIG_MISSING = "ModelConfigMissing"
INVALID_MODEL_CONFIG = "InvalidModelConfig"
MODEL_NOT_MOE = "ModelNotMoE"
UNSUPPORTED_ARCHITECTURE = "UnsupportedArchitecture"
MODEL_SHARDS_INVALID = "ModelShardsInvalid"
UNSUPPORTED_DTYPE = "UnsupportedDtype"
TOKENIZER_VOCAB_MISMATCH = "TokenizerVocabMismatch"
REASONS = (
    MODEL_NOT_FOUND,
    MODEL_CONFIG_MISSING,
    INVALID_MODEL_CONFIG,
    MODEL_NOT_MOE,
    UNSUPPORTED_ARCHITECTURE,
    MODEL_SHARDS_INVALID,
    UNSUPPORTED_DTYPE,
    TOKENIZER_VOCAB_MISMATCH,
)

# config.json keys that only MoE models have (any family, transformers 5.x spellings)
EXPERT_KEYS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_ERROR_REASON = {
    "NotFound": MODEL_NOT_FOUND,
    "NoConfig": MODEL_CONFIG_MISSING,
    "BadConfig": INVALID_MODEL_CONFIG,
    "NoWeights": MODEL_SHARDS_INVALID,
    "BadIndex": MODEL_SHARDS_INVALID,
    "MissingShard": MODEL_SHARDS_INVALID,
    "TruncatedShard": MODEL_SHARDS_INVALID,
    "BadShard": MODEL_SHARDS_INVALID,
    "MissingTensor": MODEL_SHARDS_INVALID,
    "BadTokenizer": INVALID_MODEL_CONFIG,
}
_CONFIG_CODES = ("NotFound", "NoConfig", "BadConfig")


class ModelRefused(FieldError):
    """The model at ``spec.model.path`` cannot be trained; ``reason`` is the condition reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(FIELD, detail)
        self.reason = reason


def is_moe_config(cfg: dict[str, object]) -> bool:
    """Does a config.json describe a Mixture-of-Experts model (of any family)?"""
    for key in EXPERT_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return True
    return False


def _arch(report: ModelReport) -> str:
    archs = ", ".join(report.architectures)
    return f"model_type {report.model_type!r}" + (f" ({archs})" if archs else "")


def resolve_report(report: ModelReport, path: str) -> ResolvedModel:
    """The model to plan (``path``: where the workers see the directory), or
    :class:`ModelRefused` naming the reason."""
    where = f"{report.path}"
    for e in report.errors:
        if e.code in _CONFIG_CODES:  # NotFound / NoConfig messages name the directory already
            text = e.message if e.code != "BadConfig" else f"{where}/{e.message}"
            raise ModelRefused(_ERROR_REASON[e.code], text)
    cfg = report.config
    if cfg is None:
        raise ModelRefused(MODEL_CONFIG_MISSING, f"{where} has no readable config.json")
    family = cfg.get("model_type")
    if family not in FAMILIES:
        refused = families.refusal(family)
        if refused is not None:
            raise ModelRefused(UNSUPPORTED_ARCHITECTURE, f"{where}: {refused}")
        if is_moe_config(cfg):
            raise ModelRefused(
                UNSUPPORTED_ARCHITECTURE,
                f"{where}: {_arch(report)} is a Mixture-of-Experts family the operator does not "
                f"train; supported model_type values: {', '.join(FAMILIES)}",
            )
        raise ModelRefused(
            MODEL_NOT_MOE,
            f"{where}: {_arch(report)} is not a Mixture-of-Experts model (config.json names no "
            f"experts: none of {', '.join(EXPERT_KEYS)}); the operator trains MoE models of "
            f"the families {', '.join(FAMILIES)}",
        )
    try:
        spec = spec_from_hf_config(cfg, f"{where}/config.json")
    except DocumentError as exc:
        raise ModelRefused(INVALID_MODEL_CONFIG, str(exc)) from None
    for e in report.errors:
        raise ModelRefused(_ERROR_REASON.get(e.code, MODEL_SHARDS_INVALID), f"{where}: {e.message}")
    bad = sorted(d for d in report.dtypes if d not in TRAINABLE_DTYPES)
    if bad:
        what = ", ".join(
            f"{d} ({report.dtypes[d]} elements, e.g. {report.dtype_examples.get(d, '?')})"
            for d in bad
        )
        raise ModelRefused(
            UNSUPPORTED_DTYPE,
            f"{where}: tensors stored as {what}; the trainer trains {', '.join(TRAINABLE_DTYPES)} "
            "weights (a quantized checkpoint must be de-quantized first)",
        )
    vocab = report.tokenizer.vocab_size
    if vocab is not None and vocab > spec.vocab_size:
        raise ModelRefused(
            TOKENIZER_VOCAB_MISMATCH,
            f"{where}: the tokenizer has {vocab} token ids, config.json vocab_size is "
            f"{spec.vocab_size}: ids >= {spec.vocab_size} have no embedding row",
        )
    return ResolvedModel(spec=spec, hf_config=dict(cfg), preset=None, path=path)
