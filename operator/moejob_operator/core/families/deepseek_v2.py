"""DeepSeek-V2 (``model_type: deepseek_v2``): MLA (V2-Lite: no q LoRA), softmax router, shared
experts, the first ``first_k_dense_replace`` layers dense. With ``topk_method:
group_limited_greedy`` the router picks ``topk_group`` of ``n_group`` contiguous expert blocks
first (router groups); with ``greedy`` (V2-Lite) it does not.

AutoEP preset ``deepseek_v2``.
"""

from __future__ import annotations

from typing import Any

from ..model_spec import MoEModelSpec, opt
from . import TINY, FamilySpec, _deepseek


def parse(cfg: dict[str, Any], where: str) -> MoEModelSpec:
    grouped = cfg.get("topk_method") == "group_limited_greedy"
    groups = opt(cfg, "n_group", where, 1) if grouped else 1
    return _deepseek.parse(cfg, where, "deepseek_v2", groups)


# What every DeepSeek-V2 model here shares.
_V2: dict[str, Any] = dict(
    model_type="deepseek_v2",
    first_k_dense_replace=1,
    norm_topk_prob=False,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# Published dims of the released checkpoints' config.json (Hugging Face hub).
_HUB: dict[str, Any] = dict(
    _V2,
    vocab_size=102400,
    max_position_embeddings=163840,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    kv_lora_rank=512,
    n_shared_experts=2,
    num_experts_per_tok=6,
    bos_token_id=100000,
    eos_token_id=100001,
)

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": dict(
        _HUB,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=64,
        q_lora_rank=None,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
    ),
    "deepseek-v2": dict(
        _HUB,
        hidden_size=5120,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=60,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=160,
        q_lora_rank=1536,
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        routed_scaling_factor=16.0,
    ),
    "tiny-deepseek-v2": dict(
        _V2,
        **TINY,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
    ),
}

FAMILY = FamilySpec(
    name="deepseek_v2",
    model_types=("deepseek_v2",),
    architecture="DeepseekV2ForCausalLM",
    parse=parse,
    autoep_preset="deepseek_v2",
    decoder_layer_class="DeepseekV2DecoderLayer",
    presets=PRESETS,
    published_totals={"deepseek-v2-lite": 15.7e9, "deepseek-v2": 236e9},
    # V2-Lite's card states 2.4B active without the input embedding (our count: 2.45B without,
    # 2.66B with it), so only V2's figure is comparable
    published_active={"deepseek-v2": 21e9},
)
