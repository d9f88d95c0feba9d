"""OLMoE: ``model.layers.<i>.mlp`` = ``OlmoeSparseMoeBlock`` (router ``gate``, experts
``experts``); one projection per expert on disk. DeepSpeed 0.19.8's AutoEP has no preset for it:
the trainer's grouped block (``moe_trainer.model.grouped_moe``, ``training.moeImpl: grouped``) or
the HF block runs it, experts being ordinary ZeRO-3 parameters (no expert parallelism)."""

from . import TINY, Family

FAMILY = Family(
    name="olmoe",
    model_types=("olmoe",),
    causal_lm_class="OlmoeForCausalLM",
    moe_block_class="OlmoeSparseMoeBlock",
    autoep_preset=None,
    grouped_block=True,
    tiny_name="tiny-olmoe",
    tiny_config={
        "model_type": "olmoe",
        **TINY,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.0,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
    },
)
