"""The shapes of an MoE model the planner works with, and the checked readers its families share.

The planner needs a model's shapes, never its weights: the memory model, the bucket sizes of the
DeepSpeed config and the placement's ``[num_layers, num_experts]`` arrays all derive from
:class:`MoEModelSpec`. Each model family (``core/families/``) parses its Hugging Face
``config.json`` into one with the readers here, so every family refuses a bad field the same way
(the field path and the value, :class:`DocumentError`).

Parameter counts follow the transformers 5.17.0 modules: bias-free projections, RMSNorm weights,
stacked experts ``gate_up_proj[E, 2F, H]`` + ``down_proj[E, H, F]``, router ``weight[E, H]``.
Attention differs by family (MLA, q/k norms, linear attention, an attention-block indexer), so a
family states the element counts of one layer's attention tensors (``attention_tensors``, and
``alt_attention_tensors`` for the layers of a second kind) instead of a formula living here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import DocumentError


@dataclass(frozen=True)
class MLADims:
    """DeepSeek multi-head latent attention dimensions (``q_lora_rank`` None: plain q_proj)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoEModelSpec:
    """Shapes of a decoder-only MoE transformer, parsed once from a HF config.

    ``family`` is the registry name (``core.families``). ``expert_intermediate_size`` is one
    routed expert's FFN width; ``dense_intermediate_size`` the FFN width of the dense (non-MoE)
    layers; ``shared_expert_size`` the summed width of the shared experts every token passes
    through (DeepSeek: ``n_shared_experts * moe_intermediate_size``), ``shared_expert_gate`` a
    ``[1, H]`` sigmoid gate on them (Qwen3.5). ``moe_layer_ids`` lists the decoder layers with an
    MoE block, in order. ``attention_tensors`` are the element counts of one attention block's
    tensors (projections and their norms, not the two layer norms); the layers in
    ``alt_attention_layer_ids`` have ``alt_attention_tensors`` instead.
    """

    family: str
    hidden_size: int
    expert_intermediate_size: int
    dense_intermediate_size: int
    shared_expert_size: int
    num_layers: int
    moe_layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_tensors: tuple[int, ...]
    mla: MLADims | None = None
    shared_expert_gate: bool = False
    alt_attention_layer_ids: tuple[int, ...] = ()
    alt_attention_tensors: tuple[int, ...] = ()
    router_groups: int = 1  # contiguous blocks of expert ids the router picks among first

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    # ---- parameter counts (elements) ------------------------------------------------------
    def attention_layer_tensors(self, layer: int | None = None) -> tuple[int, ...]:
        """Element counts of the attention tensors of decoder layer ``layer`` (None: the common
        kind), without the layer norms."""
        if layer is not None and layer in self.alt_attention_layer_ids:
            return self.alt_attention_tensors
        return self.attention_tensors

    def attention_params(self, layer: int | None = None) -> int:
        """One decoder layer's attention block, including its input/post-attention norms."""
        return sum(self.attention_layer_tensors(layer)) + 2 * self.hidden_size

    def expert_params(self) -> int:
        """One routed expert (gate, up, down projections)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    def moe_layer_expert_params(self) -> int:
        """All routed experts of one MoE layer: what AutoEP splits over the EP group."""
        return self.num_experts * self.expert_params()

    def moe_layer_dense_params(self) -> int:
        """The non-expert part of one MoE layer's MLP: router and shared experts (+ their gate)."""
        h = self.hidden_size
        gate = h if self.shared_expert_gate else 0
        return self.num_experts * h + 3 * h * self.shared_expert_size + gate

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate_size

    def embedding_params(self) -> int:
        """Input embedding, final norm and (untied) LM head."""
        emb = self.vocab_size * self.hidden_size
        return emb + self.hidden_size + (0 if self.tie_word_embeddings else emb)

    def layer_params(self, layer: int) -> int:
        """All parameters of decoder layer ``layer`` (what ZeRO-3 gathers for it without EP)."""
        if layer in self.moe_layer_ids:
            return (
                self.attention_params(layer)
                + self.moe_layer_dense_params()
                + self.moe_layer_expert_params()
            )
        return self.attention_params(layer) + self.dense_mlp_params()

    def counts(self) -> ParamCounts:
        expert = self.num_moe_layers * self.moe_layer_expert_params()
        total = self.embedding_params() + sum(self.layer_params(i) for i in range(self.num_layers))
        active_experts = self.num_moe_layers * self.top_k * self.expert_params()
        input_emb = self.vocab_size * self.hidden_size
        return ParamCounts(
            total=total,
            expert=expert,
            dense=total - expert,
            active=total - expert + active_experts,
            active_no_embedding=total - expert + active_experts - input_emb,
        )


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts in elements. ``dense`` = everything but routed experts; ``active`` = what
    one token touches (dense + top_k experts per MoE layer), with the input embedding counted
    whole, as the model cards do."""

    total: int
    expert: int
    dense: int
    active: int
    active_no_embedding: int


# ---- checked readers -------------------------------------------------------------------------
# Upper bounds of the dimensions the planner accepts (docs/crd.md "Model limits"): the
# placement works on [num_layers, num_experts] arrays per rank and the memory model multiplies
# these, so they bound the operator's work per plan. The largest published MoE models sit well
# inside (DeepSeek-V3: 256 experts, 61 layers, hidden 7168, vocab 129280).
MAX_EXPERTS = 1024
MAX_EXPERT_LAYER_CELLS = 16_384  # num_moe_layers * num_experts
MODEL_LIMITS = {
    "hidden_size": 65_536,
    "num_hidden_layers": 512,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "num_experts_per_tok": 64,
    "num_local_experts": MAX_EXPERTS,
    "num_experts": MAX_EXPERTS,
    "n_routed_experts": MAX_EXPERTS,
    "n_shared_experts": 64,
    "vocab_size": 1_048_576,
    "max_position_embeddings": 4_194_304,
    "intermediate_size": 1_048_576,
    "moe_intermediate_size": 262_144,
    "shared_expert_intermediate_size": 1_048_576,
    "shared_intermediate_size": 1_048_576,
    "dense_intermediate_size": 1_048_576,
    "head_dim": 4096,
    "kv_lora_rank": 65_536,
    "q_lora_rank": 65_536,
    "qk_nope_head_dim": 4096,
    "qk_rope_head_dim": 4096,
    "v_head_dim": 4096,
    "decoder_sparse_step": 512,
    "first_k_dense_replace": 512,
    "n_group": MAX_EXPERTS,
    "topk_group": MAX_EXPERTS,
    "linear_num_key_heads": 1024,
    "linear_num_value_heads": 1024,
    "linear_key_head_dim": 4096,
    "linear_value_head_dim": 4096,
    "linear_conv_kernel_dim": 64,
    "index_n_heads": 1024,
    "index_head_dim": 4096,
}


def int_in_bounds(value: Any, key: str, where: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise DocumentError(f"{where}.{key}: {value!r} is not {what}")
    limit = MODEL_LIMITS.get(key)
    if limit is not None and value > limit:
        raise DocumentError(f"{where}.{key}: {value} exceeds the planner's limit {limit}")
    return value


def req(cfg: dict[str, Any], key: str, where: str) -> int:
    """A required positive integer field."""
    if key not in cfg or cfg[key] is None:
        raise DocumentError(f"{where}.{key}: missing (needed for a {cfg.get('model_type')} model)")
    return int_in_bounds(cfg[key], key, where)


def opt(cfg: dict[str, Any], key: str, where: str, default: Any, *, minimum: int = 1) -> Any:
    """An optional integer field (absent, null or 0 -> ``default``)."""
    value = cfg.get(key)
    if value is None or (value == 0 and not isinstance(value, bool)):
        return default
    return int_in_bounds(value, key, where, minimum=minimum)


def req_any(cfg: dict[str, Any], keys: tuple[str, ...], where: str) -> int:
    """The first of ``keys`` present: HF configs spell some fields two ways (``attribute_map``;
    ``to_dict()`` writes the mapped name, hub files the original)."""
    for key in keys:
        if cfg.get(key) is not None:
            return req(cfg, key, where)
    return req(cfg, keys[0], where)


def layer_list(cfg: dict[str, Any], key: str, where: str, layers: int) -> list[str] | None:
    """A per-layer list of type names (``layer_types``, ``mlp_layer_types``); None when absent."""
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise DocumentError(f"{where}.{key}: {value!r} is not a list of layer type names")
    if len(value) != layers:
        raise DocumentError(
            f"{where}.{key}: has {len(value)} entries, num_hidden_layers is {layers}"
        )
    return value


def common_fields(cfg: dict[str, Any], where: str, family: str) -> dict[str, Any]:
    """The fields every family reads the same way."""
    heads = req(cfg, "num_attention_heads", where)
    return dict(
        family=family,
        hidden_size=req(cfg, "hidden_size", where),
        num_layers=req(cfg, "num_hidden_layers", where),
        top_k=req(cfg, "num_experts_per_tok", where),
        num_attention_heads=heads,
        num_kv_heads=opt(cfg, "num_key_value_heads", where, heads),
        vocab_size=req(cfg, "vocab_size", where),
        max_position_embeddings=req(cfg, "max_position_embeddings", where),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def gqa_tensors(c: dict[str, Any], head_dim: int, *, q_mult: int = 1) -> tuple[int, ...]:
    """q/k/v/o projections of grouped-query attention (``q_mult`` 2: a gated query, Qwen3.5)."""
    h = c["hidden_size"]
    q_out = c["num_attention_heads"] * head_dim
    kv_out = c["num_kv_heads"] * head_dim
    return (h * q_out * q_mult, h * kv_out, h * kv_out, q_out * h)


def check_spec(spec: MoEModelSpec, where: str) -> MoEModelSpec:
    """What every family's spec must satisfy for the planner."""
    if spec.top_k > spec.num_experts:
        raise DocumentError(
            f"{where}.num_experts_per_tok: {spec.top_k} exceeds the number of experts "
            f"({spec.num_experts})"
        )
    if not spec.moe_layer_ids:
        raise DocumentError(f"{where}: the model has no MoE layer")
    if spec.num_moe_layers * spec.num_experts > MAX_EXPERT_LAYER_CELLS:
        raise DocumentError(
            f"{where}: {spec.num_moe_layers} MoE layers x {spec.num_experts} experts "
            f"exceeds the planner's limit of {MAX_EXPERT_LAYER_CELLS} (layer, expert) pairs"
        )
    if spec.router_groups > 1 and spec.num_experts % spec.router_groups:
        raise DocumentError(
            f"{where}.n_group: {spec.router_groups} does not divide the number of experts "
            f"({spec.num_experts})"
        )
    return spec
