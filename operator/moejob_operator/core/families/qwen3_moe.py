"""Qwen3-MoE (``model_type: qwen3_moe``): softmax top-k router, q/k RMSNorm over the head dim,
MoE every ``decoder_sparse_step`` layers except ``mlp_only_layers``.

AutoEP preset ``qwen3_moe``; the trainer's grouped block reproduces its MoE block.
"""

from __future__ import annotations

from typing import Any

from ..errors import DocumentError
from ..model_spec import MoEModelSpec, check_spec, common_fields, gqa_tensors, opt, req, req_any
from . import TINY, FamilySpec


def moe_layers(cfg: dict[str, Any], where: str, layers: int) -> tuple[int, ...]:
    """Qwen's rule: layer i is MoE when (i + 1) % decoder_sparse_step == 0, unless listed in
    ``mlp_only_layers``."""
    step = opt(cfg, "decoder_sparse_step", where, 1)
    mlp_only_raw = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only_raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in mlp_only_raw
    ):
        raise DocumentError(
            f"{where}.mlp_only_layers: {mlp_only_raw!r} is not a list of layer indices"
        )
    mlp_only = set(mlp_only_raw)
    return tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)


def parse(cfg: dict[str, Any], where: str) -> MoEModelSpec:
    c = common_fields(cfg, where, "qwen3_moe")
    head_dim = opt(cfg, "head_dim", where, c["hidden_size"] // c["num_attention_heads"])
    spec = MoEModelSpec(
        expert_intermediate_size=req(cfg, "moe_intermediate_size", where),
        dense_intermediate_size=opt(cfg, "intermediate_size", where, 0),
        shared_expert_size=0,
        moe_layer_ids=moe_layers(cfg, where, c["num_layers"]),
        num_experts=req_any(cfg, ("num_experts", "num_local_experts"), where),
        head_dim=head_dim,
        attention_tensors=(*gqa_tensors(c, head_dim), head_dim, head_dim),  # + q_norm, k_norm
        **c,
    )
    return check_spec(spec, where)


# What every Qwen3-MoE model here shares, the smoke model included (``mlp_only_layers`` is given
# per model: a list each of its own).
_QWEN3: dict[str, Any] = dict(
    model_type="qwen3_moe", decoder_sparse_step=1, norm_topk_prob=True, rms_norm_eps=1e-6
)
# Published dims of the released checkpoints' config.json (Hugging Face hub).
_HUB: dict[str, Any] = dict(
    _QWEN3,
    vocab_size=151936,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    num_experts=128,
    num_experts_per_tok=8,
    rope_theta=1e6,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.001,
    bos_token_id=151643,
    eos_token_id=151645,
)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        _HUB,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        mlp_only_layers=[],
    ),
    "qwen3-235b-a22b": dict(
        _HUB,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        mlp_only_layers=[],
    ),
    "tiny-qwen3-moe": dict(
        _QWEN3,
        **TINY,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[],
        rope_theta=10000.0,
        router_aux_loss_coef=0.01,
    ),
}

FAMILY = FamilySpec(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architecture="Qwen3MoeForCausalLM",
    parse=parse,
    autoep_preset="qwen3_moe",
    decoder_layer_class="Qwen3MoeDecoderLayer",
    grouped_block=True,
    presets=PRESETS,
    published_totals={"qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9},
    published_active={"qwen3-30b-a3b": 3.3e9, "qwen3-235b-a22b": 22e9},
    smoke_config=dict(
        _QWEN3,
        architectures=["Qwen3MoeForCausalLM"],
        intermediate_size=128,
        moe_intermediate_size=64,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=2,
        mlp_only_layers=[],
        rope_theta=10000.0,
        router_aux_loss_coef=0.0,
    ),
)
