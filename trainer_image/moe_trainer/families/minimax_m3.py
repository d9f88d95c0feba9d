"""MiniMax-M3 text backbone (``minimax_m3_vl_text``, ``MiniMaxM3VLForCausalLM``):
``model.layers.<i>.mlp`` = ``MiniMaxM3VLSparseMoeBlock`` where ``mlp_layer_types`` says
``sparse`` (router ``gate`` with ``e_score_correction_bias[E]``; experts ``experts`` with the
clamped SwiGLU; ``shared_experts`` not permuted). ``save_pretrained`` writes the stacked expert
tensors as they are (no per-expert split). AutoEP preset ``minimax_m3``."""

from . import TINY, Family

FAMILY = Family(
    name="minimax_m3",
    model_types=("minimax_m3_vl_text",),
    causal_lm_class="MiniMaxM3VLForCausalLM",
    moe_block_class="MiniMaxM3VLSparseMoeBlock",
    autoep_preset="minimax_m3",
    router_buffers=("e_score_correction_bias",),
    per_expert=None,
    shared_modules=("shared_experts",),
    tiny_name="tiny-minimax-m3",
    tiny_config={
        "model_type": "minimax_m3_vl_text",
        **TINY,
        "intermediate_size": 32,
        "dense_intermediate_size": 128,
        "shared_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rotary_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "router_aux_loss_coef": 0.0,
        "bos_token_id": 256,
        "eos_token_id": 257,
    },
)
