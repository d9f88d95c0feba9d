"""Qwen3.5-MoE text backbone (``model_type: qwen3_5_moe_text``): every layer MoE (softmax top-k
router, one shared expert behind a sigmoid gate); most layers use gated-delta-net linear
attention, every ``full_attention_interval``-th layer gated full attention (``layer_types``).

AutoEP preset ``qwen3_5_moe``, which replaces the text backbone's blocks: the multimodal wrapper
``qwen3_5_moe`` (vision tower + text) is refused; train its text backbone.
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

_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def layer_types(cfg: dict[str, Any], where: str, layers: int) -> list[str]:
    """``layer_types`` as transformers 5.17.0 derives it (legacy names mapped)."""
    given = layer_list(cfg, "layer_types", where, layers)
    if given is None:
        every = opt(cfg, "full_attention_interval", where, 4)
        return [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ]
    types = [_LEGACY.get(t, t) for t in given]
    bad = sorted(set(types) - {"full_attention", "linear_attention"})
    if bad:
        raise DocumentError(f"{where}.layer_types: unknown layer type(s) {bad}")
    return types


def linear_attention_tensors(cfg: dict[str, Any], where: str, h: int) -> tuple[int, ...]:
    """Gated delta net: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log,
    norm, out_proj."""
    nk = opt(cfg, "linear_num_key_heads", where, 16)
    nv = opt(cfg, "linear_num_value_heads", where, 32)
    dk = opt(cfg, "linear_key_head_dim", where, 128)
    dv = opt(cfg, "linear_value_head_dim", where, 128)
    kernel = opt(cfg, "linear_conv_kernel_dim", where, 4)
    key, value = nk * dk, nv * dv
    conv = 2 * key + value
    return (h * conv, h * value, h * nv, h * nv, conv * kernel, nv, nv, dv, value * h)


def parse(cfg: dict[str, Any], where: str) -> MoEModelSpec:
    c = common_fields(cfg, where, "qwen3_5_moe")
    h, layers = c["hidden_size"], c["num_layers"]
    head_dim = opt(cfg, "head_dim", where, h // c["num_attention_heads"])
    full = (*gqa_tensors(c, head_dim, q_mult=2), head_dim, head_dim)  # gated q; q_norm, k_norm
    if cfg.get("attention_bias"):
        q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_kv_heads"] * head_dim
        full = (*full, 2 * q_out, kv_out, kv_out, h)
    types = layer_types(cfg, where, layers)
    spec = MoEModelSpec(
        expert_intermediate_size=req(cfg, "moe_intermediate_size", where),
        dense_intermediate_size=0,
        shared_expert_size=opt(cfg, "shared_expert_intermediate_size", where, 0),
        shared_expert_gate=bool(opt(cfg, "shared_expert_intermediate_size", where, 0)),
        moe_layer_ids=tuple(range(layers)),
        num_experts=req_any(cfg, ("num_experts", "num_local_experts"), where),
        head_dim=head_dim,
        attention_tensors=full,
        alt_attention_layer_ids=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        alt_attention_tensors=linear_attention_tensors(cfg, where, h),
        **c,
    )
    return check_spec(spec, where)


# What every Qwen3.5-MoE model here shares.
_QWEN3_5: dict[str, Any] = dict(
    model_type="qwen3_5_moe_text",
    num_key_value_heads=2,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    # transformers 5.17.0's Qwen3_5MoeTextConfig defaults (its docstring names the checkpoint
    # Qwen/Qwen3.5-35B-A3B; the text backbone only)
    "qwen3.5-35b-a3b-text": dict(
        _QWEN3_5,
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        head_dim=256,
        max_position_embeddings=32768,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
        full_attention_interval=4,
        router_aux_loss_coef=0.001,
    ),
    "tiny-qwen3.5-moe": dict(
        _QWEN3_5,
        **TINY,
        num_hidden_layers=4,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        full_attention_interval=2,
        router_aux_loss_coef=0.01,
    ),
}

FAMILY = FamilySpec(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    architecture="Qwen3_5MoeForCausalLM",
    parse=parse,
    autoep_preset="qwen3_5_moe",
    decoder_layer_class="Qwen3_5MoeDecoderLayer",
    presets=PRESETS,
    refused_model_types={
        "qwen3_5_moe": text_backbone_only(
            "Qwen3.5-MoE", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
        )
    },
)
