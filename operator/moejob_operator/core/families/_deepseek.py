"""What DeepSeek-V2 and -V3 share: multi-head latent attention, shared experts, the first
``first_k_dense_replace`` layers dense."""

from __future__ import annotations

from typing import Any

from ..model_spec import MLADims, MoEModelSpec, check_spec, common_fields, opt, req, req_any


def mla_tensors(h: int, heads: int, m: MLADims) -> tuple[int, ...]:
    """q (plain, or LoRA a/norm/b), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank is None:
        q: tuple[int, ...] = (h * heads * qk,)
    else:
        q = (h * m.q_lora_rank, m.q_lora_rank, m.q_lora_rank * heads * qk)
    kv = (
        h * (m.kv_lora_rank + m.qk_rope_head_dim),
        m.kv_lora_rank,
        m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim),
    )
    return (*q, *kv, heads * m.v_head_dim * h)


def parse(cfg: dict[str, Any], where: str, family: str, router_groups: int) -> MoEModelSpec:
    c = common_fields(cfg, where, family)
    moe_inter = req(cfg, "moe_intermediate_size", where)
    mla = MLADims(
        q_lora_rank=opt(cfg, "q_lora_rank", where, None),
        kv_lora_rank=req(cfg, "kv_lora_rank", where),
        qk_nope_head_dim=req(cfg, "qk_nope_head_dim", where),
        qk_rope_head_dim=req(cfg, "qk_rope_head_dim", where),
        v_head_dim=req(cfg, "v_head_dim", where),
    )
    first_dense = opt(cfg, "first_k_dense_replace", where, 0)
    spec = MoEModelSpec(
        expert_intermediate_size=moe_inter,
        dense_intermediate_size=req(cfg, "intermediate_size", where),
        shared_expert_size=opt(cfg, "n_shared_experts", where, 0) * moe_inter,
        moe_layer_ids=tuple(range(first_dense, c["num_layers"])),
        num_experts=req_any(cfg, ("n_routed_experts", "num_local_experts"), where),
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        attention_tensors=mla_tensors(c["hidden_size"], c["num_attention_heads"], mla),
        mla=mla,
        router_groups=router_groups,
        **c,
    )
    return check_spec(spec, where)
