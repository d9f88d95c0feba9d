"""DeepSeek-V3: ``model.layers.<i>.mlp`` = ``DeepseekV3MoE`` from layer ``first_k_dense_replace``
on (router ``gate`` with the per-expert buffer ``e_score_correction_bias[E]``, permuted with the
router rows; experts ``experts``; ``shared_experts`` not permuted); one projection per expert on
disk. Router groups (``n_group``) are contiguous expert-id blocks: the plan's permutation keeps
them whole. AutoEP preset ``deepseek_v3``."""

from . import TINY, Family

FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    causal_lm_class="DeepseekV3ForCausalLM",
    moe_block_class="DeepseekV3MoE",
    autoep_preset="deepseek_v3",
    router_buffers=("e_score_correction_bias",),
    shared_modules=("shared_experts",),
    tiny_name="tiny-deepseek-v3",
    tiny_config={
        "model_type": "deepseek_v3",
        **TINY,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "rope_scaling": None,
    },
)
