"""DeepSeek-V3 (``model_type: deepseek_v3``): MLA, sigmoid router with a score-correction bias
and group-limited routing (``n_group`` contiguous expert blocks, ``topk_group`` of them per
token), shared experts, the first ``first_k_dense_replace`` layers dense. The multi-token
prediction module is not part of the HF model and is not counted (the published 671B excludes
it too).

AutoEP preset ``deepseek_v3``. Router groups: a placement keeps each group whole
(``core.router_groups``).
"""

from __future__ import annotations

from typing import Any

from ..model_spec import MoEModelSpec, opt
from . import TINY, FamilySpec, _deepseek


def parse(cfg: dict[str, Any], where: str) -> MoEModelSpec:
    return _deepseek.parse(cfg, where, "deepseek_v3", opt(cfg, "n_group", where, 1))


# What every DeepSeek-V3 model here shares, the smoke model included.
_V3: dict[str, Any] = dict(
    model_type="deepseek_v3", n_shared_experts=1, norm_topk_prob=True, rms_norm_eps=1e-6
)
# The small shape of the tiny and the smoke model.
_SMALL: dict[str, Any] = dict(
    _V3,
    intermediate_size=128,
    num_key_value_heads=4,
    routed_scaling_factor=1.0,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    v_head_dim=16,
    topk_group=1,
    num_experts_per_tok=2,
)

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(
        _V3,
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        max_position_embeddings=163840,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    ),
    "tiny-deepseek-v3": dict(
        _SMALL,
        **TINY,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        n_routed_experts=8,
        qk_nope_head_dim=16,
        n_group=2,
        first_k_dense_replace=1,
    ),
}

FAMILY = FamilySpec(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    architecture="DeepseekV3ForCausalLM",
    parse=parse,
    autoep_preset="deepseek_v3",
    decoder_layer_class="DeepseekV3DecoderLayer",
    presets=PRESETS,
    published_totals={"deepseek-v3": 671e9},
    published_active={"deepseek-v3": 37e9},
    # n_group 1: the smoke run's round-robin placement would cross router groups
    smoke_config=dict(
        _SMALL,
        architectures=["DeepseekV3ForCausalLM"],
        moe_intermediate_size=32,
        n_routed_experts=16,
        qk_nope_head_dim=8,
        n_group=1,
        first_k_dense_replace=0,
        rope_scaling=None,
    ),
)
