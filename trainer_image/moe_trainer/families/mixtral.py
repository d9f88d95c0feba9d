"""Mixtral: ``model.layers.<i>.mlp`` = ``MixtralSparseMoeBlock`` (router ``gate``, experts
``experts.gate_up_proj``/``down_proj``). Checkpoints (hub and ``save_pretrained``) name the block
``block_sparse_moe`` and each expert's projections ``w1`` (gate), ``w3`` (up), ``w2`` (down).
AutoEP preset ``mixtral``."""

from . import TINY, Family

FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    causal_lm_class="MixtralForCausalLM",
    moe_block_class="MixtralSparseMoeBlock",
    autoep_preset="mixtral",
    grouped_block=True,
    per_expert=("w1", "w3", "w2"),
    renames=((".block_sparse_moe.", ".mlp."),),
    tiny_name="tiny-mixtral",
    tiny_config={
        "model_type": "mixtral",
        **TINY,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.0,
        "rope_theta": 10000.0,
    },
)
