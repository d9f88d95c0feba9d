"""Qwen3.5-MoE text backbone (``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``): every
``model.layers.<i>.mlp`` is a ``Qwen3_5MoeSparseMoeBlock`` (router ``gate``, experts
``experts``, plus ``shared_expert`` and ``shared_expert_gate``, which are not per expert and are
not permuted). Checkpoints store one projection per expert; the hub's multimodal checkpoints
prefix the text backbone with ``model.language_model.`` (read, not written). AutoEP preset
``qwen3_5_moe``."""

from . import TINY, Family

FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    causal_lm_class="Qwen3_5MoeForCausalLM",
    moe_block_class="Qwen3_5MoeSparseMoeBlock",
    autoep_preset="qwen3_5_moe",
    load_prefixes=(("model.language_model.", "model."),),
    shared_modules=("shared_expert", "shared_expert_gate"),
    tiny_name="tiny-qwen3.5-moe",
    tiny_config={
        "model_type": "qwen3_5_moe_text",
        **TINY,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "router_aux_loss_coef": 0.0,
    },
)
