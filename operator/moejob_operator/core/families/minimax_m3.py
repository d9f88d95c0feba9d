"""MiniMax-M3 text backbone (``model_type: minimax_m3_vl_text``): sigmoid router with a
score-correction bias, one shared expert, clamped SwiGLU (GPT-OSS form) experts; per-layer MoE or
dense MLP (``mlp_layer_types``) and full or block-sparse attention (``layer_types``; the sparse
layers carry a small "lightning indexer").

AutoEP preset ``minimax_m3``, which replaces the text backbone's blocks: the multimodal wrapper
``minimax_m3_vl`` is refused; train its text backbone.
"""

from __future__ import annotations

from typing import Any

from ..errors import DocumentError
from ..model_spec import (
    MoEModelSpec,
    check_spec,
    common_fields,
    gqa_tensors,
    layer_list,
    opt,
    req,
    req_any,
)
from . import TINY, FamilySpec, text_backbone_only

SPARSE_ATTENTION = "minimax_m3_sparse"


def _types(
    cfg: dict[str, Any], key: str, where: str, layers: int, legacy: tuple[str, str, str, str]
) -> list[str]:
    """``key`` as transformers 5.17.0 derives it: the list itself, else the hub files' 0/1 list
    (``moe_layer_freq``, ``sparse_attention_config.sparse_attention_freq``), else ``default``."""
    given = layer_list(cfg, key, where, layers)
    if given is not None:
        return given
    legacy_key, on, off, default = legacy
    holder = cfg.get("sparse_attention_config") if "." in legacy_key else cfg
    freq = holder.get(legacy_key.rsplit(".", 1)[-1]) if isinstance(holder, dict) else None
    if freq is None:
        return [default] * layers
    if not isinstance(freq, list) or len(freq) != layers:
        raise DocumentError(f"{where}.{legacy_key}: {freq!r} is not a 0/1 list of {layers} layers")
    return [on if f else off for f in freq]


def parse(cfg: dict[str, Any], where: str) -> MoEModelSpec:
    c = common_fields(cfg, where, "minimax_m3")
    h, layers = c["hidden_size"], c["num_layers"]
    head_dim = opt(cfg, "head_dim", where, h // c["num_attention_heads"])
    mlp_types = _types(
        cfg, "mlp_layer_types", where, layers, ("moe_layer_freq", "sparse", "dense", "sparse")
    )
    attn_types = _types(
        cfg,
        "layer_types",
        where,
        layers,
        (
            "sparse_attention_config.sparse_attention_freq",
            SPARSE_ATTENTION,
            "full_attention",
            "full_attention",
        ),
    )
    bad = sorted(set(mlp_types) - {"sparse", "dense"}) + sorted(
        set(attn_types) - {"full_attention", SPARSE_ATTENTION}
    )
    if bad:
        raise DocumentError(f"{where}: unknown layer type(s) {bad}")
    full = (*gqa_tensors(c, head_dim), head_dim, head_dim)  # + q_norm, k_norm
    idx_heads = opt(cfg, "index_n_heads", where, 4)
    idx_dim = opt(cfg, "index_head_dim", where, 128)
    indexer = (h * idx_heads * idx_dim, h * idx_dim, idx_dim, idx_dim)
    spec = MoEModelSpec(
        expert_intermediate_size=req(cfg, "intermediate_size", where),
        dense_intermediate_size=opt(cfg, "dense_intermediate_size", where, 12288),
        shared_expert_size=opt(cfg, "shared_intermediate_size", where, 3072),
        moe_layer_ids=tuple(i for i, t in enumerate(mlp_types) if t == "sparse"),
        num_experts=req_any(cfg, ("num_local_experts", "num_experts"), where),
        head_dim=head_dim,
        attention_tensors=full,
        alt_attention_layer_ids=tuple(i for i, t in enumerate(attn_types) if t == SPARSE_ATTENTION),
        alt_attention_tensors=(*full, *indexer),
        **c,
    )
    return check_spec(spec, where)


PRESETS: dict[str, dict[str, Any]] = {
    "tiny-minimax-m3": dict(
        **TINY,
        model_type="minimax_m3_vl_text",
        intermediate_size=32,
        dense_intermediate_size=128,
        shared_intermediate_size=32,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["full_attention", "full_attention", "full_attention"],
        routed_scaling_factor=2.0,
        rms_norm_eps=1e-6,
        router_aux_loss_coef=0.01,
    ),
}

FAMILY = FamilySpec(
    name="minimax_m3",
    model_types=("minimax_m3_vl_text",),
    architecture="MiniMaxM3VLForCausalLM",
    parse=parse,
    autoep_preset="minimax_m3",
    decoder_layer_class="MiniMaxM3VLDecoderLayer",
    presets=PRESETS,
    refused_model_types={
        "minimax_m3_vl": text_backbone_only(
            "MiniMax-M3", "minimax_m3_vl_text", "MiniMaxM3VLForCausalLM"
        )
    },
)
