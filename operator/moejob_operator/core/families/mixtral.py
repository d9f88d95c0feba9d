"""Mixtral (``model_type: mixtral``): every layer MoE, softmax top-k router, no shared experts.

AutoEP preset ``mixtral``; the trainer's grouped block reproduces its MoE block.
"""

from __future__ import annotations

from typing import Any

from ..model_spec import MoEModelSpec, check_spec, common_fields, gqa_tensors, opt, req, req_any
from . import BYTE_TOKENS, TINY, FamilySpec


def parse(cfg: dict[str, Any], where: str) -> MoEModelSpec:
    c = common_fields(cfg, where, "mixtral")
    head_dim = opt(cfg, "head_dim", where, c["hidden_size"] // c["num_attention_heads"])
    spec = MoEModelSpec(
        expert_intermediate_size=req(cfg, "intermediate_size", where),
        dense_intermediate_size=0,
        shared_expert_size=0,
        moe_layer_ids=tuple(range(c["num_layers"])),
        num_experts=req_any(cfg, ("num_local_experts", "num_experts"), where),
        head_dim=head_dim,
        attention_tensors=gqa_tensors(c, head_dim),
        **c,
    )
    return check_spec(spec, where)


# What every Mixtral model here shares, the smoke model included.
_MIXTRAL: dict[str, Any] = dict(
    model_type="mixtral", num_experts_per_tok=2, rms_norm_eps=1e-5, sliding_window=None
)
# Published dims of the released checkpoints' config.json (Hugging Face hub).
_HUB: dict[str, Any] = dict(
    _MIXTRAL,
    num_key_value_heads=8,
    head_dim=128,
    num_local_experts=8,
    rope_theta=1e6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# The tiny and benchmark models: byte tokenizer (``TINY``), rope theta 1e4, aux loss 0.01.
_BYTE: dict[str, Any] = dict(
    _MIXTRAL,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.01,
    **BYTE_TOKENS,
)

PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(
        _HUB,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=32768,
        router_aux_loss_coef=0.02,
    ),
    "mixtral-8x22b": dict(
        _HUB,
        vocab_size=32768,
        hidden_size=6144,
        intermediate_size=16384,
        num_hidden_layers=56,
        num_attention_heads=48,
        max_position_embeddings=65536,
        router_aux_loss_coef=0.001,
    ),
    # Tiny debug model (CPU tests). 8 experts top-2 like the benchmark model.
    "tiny-mixtral": dict(
        _BYTE,
        **TINY,
        intermediate_size=128,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
    ),
    # The trainer benchmark's shape: hidden 1024, 4 layers, 8 experts top-2 (seq 1024,
    # micro-batch 16, bf16), expert width 3.5h like Mixtral (8 x 3 x 1024 x 3584 x 4 = 352M expert
    # parameters), vocabulary 32000 and 4 KV heads as in the measured run
    # (benchmarks/trainer_bench.py): 430M parameters.
    "bench-mixtral": dict(
        _BYTE,
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        num_local_experts=8,
    ),
    # The 3.4B shape of the MFU benchmark (benchmarks/mfu_bench.py, issue 17): hidden 2048, expert
    # FFN 4096, 16 experts top-2, 8 layers, 16 heads / 8 KV heads, vocabulary 32000.
    "bench-mixtral-3b": dict(
        _BYTE,
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        num_local_experts=16,
    ),
}

FAMILY = FamilySpec(
    name="mixtral",
    model_types=("mixtral",),
    architecture="MixtralForCausalLM",
    parse=parse,
    autoep_preset="mixtral",
    decoder_layer_class="MixtralDecoderLayer",
    grouped_block=True,
    presets=PRESETS,
    published_totals={"mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9},
    published_active={"mixtral-8x7b": 12.9e9, "mixtral-8x22b": 39e9},
    smoke_config=dict(
        _MIXTRAL,
        architectures=["MixtralForCausalLM"],
        intermediate_size=64,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=16,
        rope_theta=10000.0,
        router_aux_loss_coef=0.0,
    ),
)
