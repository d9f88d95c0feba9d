"""OLMoE (``model_type: olmoe``): every layer MoE, softmax top-k router, q/k RMSNorm over the
whole projection, no shared experts.

DeepSpeed 0.19.8's AutoEP has no preset for it: its experts train as ordinary ZeRO-3 parameters
inside the trainer's own grouped MoE block (no expert parallelism; epSize 1).
"""

from __future__ import annotations

from typing import Any

from ..model_spec import MoEModelSpec, check_spec, common_fields, gqa_tensors, opt, req, req_any
from . import TINY, FamilySpec


def parse(cfg: dict[str, Any], where: str) -> MoEModelSpec:
    c = common_fields(cfg, where, "olmoe")
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = opt(cfg, "head_dim", where, h // heads)
    norms = (h, (h // heads) * c["num_kv_heads"])  # q_norm over hidden, k_norm over the KV width
    spec = MoEModelSpec(
        expert_intermediate_size=req(cfg, "intermediate_size", where),
        dense_intermediate_size=0,
        shared_expert_size=0,
        moe_layer_ids=tuple(range(c["num_layers"])),
        num_experts=req_any(cfg, ("num_experts", "num_local_experts"), where),
        head_dim=head_dim,
        attention_tensors=(*gqa_tensors(c, head_dim), *norms),
        **c,
    )
    return check_spec(spec, where)


# What every OLMoE model here shares.
_OLMOE: dict[str, Any] = dict(
    model_type="olmoe",
    norm_topk_prob=False,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.01,
)

PRESETS: dict[str, dict[str, Any]] = {
    # published dims of allenai/OLMoE-1B-7B-0924's config.json
    "olmoe-1b-7b": dict(
        _OLMOE,
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=4096,
        num_experts=64,
        num_experts_per_tok=8,
        bos_token_id=None,
        eos_token_id=50279,
        pad_token_id=1,
    ),
    "tiny-olmoe": dict(
        _OLMOE,
        **TINY,
        intermediate_size=64,
        num_hidden_layers=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
    ),
}

FAMILY = FamilySpec(
    name="olmoe",
    model_types=("olmoe",),
    architecture="OlmoeForCausalLM",
    parse=parse,
    autoep_preset=None,
    decoder_layer_class="OlmoeDecoderLayer",
    grouped_block=True,
    presets=PRESETS,
    published_totals={"olmoe-1b-7b": 6.9e9},
    published_active={"olmoe-1b-7b": 1.3e9},
)
