"""DeepSeek-V2: ``model.layers.<i>.mlp`` = ``DeepseekV2Moe`` from layer ``first_k_dense_replace``
on (router ``gate``, experts ``experts``, ``shared_experts`` not permuted); one projection per
expert on disk. AutoEP preset ``deepseek_v2``."""

from . import TINY, Family

FAMILY = Family(
    name="deepseek_v2",
    model_types=("deepseek_v2",),
    causal_lm_class="DeepseekV2ForCausalLM",
    moe_block_class="DeepseekV2Moe",
    autoep_preset="deepseek_v2",
    shared_modules=("shared_experts",),
    tiny_name="tiny-deepseek-v2",
    tiny_config={
        "model_type": "deepseek_v2",
        **TINY,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
)
