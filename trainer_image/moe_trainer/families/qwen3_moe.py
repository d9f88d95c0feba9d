"""Qwen3-MoE: ``model.layers.<i>.mlp`` = ``Qwen3MoeSparseMoeBlock`` (router ``gate``, experts
``experts``); checkpoints store one ``gate_proj``/``up_proj``/``down_proj`` per expert.
AutoEP preset ``qwen3_moe``."""

from . import TINY, Family

FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    causal_lm_class="Qwen3MoeForCausalLM",
    moe_block_class="Qwen3MoeSparseMoeBlock",
    autoep_preset="qwen3_moe",
    grouped_block=True,
    tiny_name="tiny-qwen3-moe",
    tiny_config={
        "model_type": "qwen3_moe",
        **TINY,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.0,
    },
)
