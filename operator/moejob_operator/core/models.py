"""MoE model dimensions: presets, Hugging Face ``config.json`` parsing, parameter counts.

The planner needs a model's shapes, never its weights: the memory model, the bucket sizes of the
DeepSpeed config and the placement's ``[num_layers, num_experts]`` arrays all derive from
:class:`MoEModelSpec`. The trainer gets the full Hugging Face config dict through the plan
(``model.hfConfig``) and builds the model from it, so the presets here return complete HF config
dicts that ``transformers.AutoConfig.for_model(**cfg)`` (5.17.0) accepts.

Parameter counts follow the transformers 5.17.0 modules (bias-free projections, RMSNorm weights,
stacked experts ``gate_up_proj[E, 2F, H]`` + ``down_proj[E, H, F]``, router ``weight[E, H]``);
DeepSeek-V3's multi-token-prediction module is not part of the HF model and is not counted
(the published 671B excludes it too).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DocumentError

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")

_ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


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

    ``expert_intermediate_size`` is one routed expert's FFN width; ``dense_intermediate_size`` the
    FFN width of the dense (non-MoE) layers; ``shared_expert_size`` the summed width of the shared
    experts every token passes through (DeepSeek: ``n_shared_experts * moe_intermediate_size``).
    ``moe_layer_ids`` lists the decoder layers with an MoE block, in order.
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
    mla: MLADims | None = None

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    # ---- parameter counts (elements) ------------------------------------------------------
    def attention_params(self) -> int:
        """One decoder layer's attention block, including its input/post-attention norms."""
        h = self.hidden_size
        if self.mla is not None:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank is None:
                q = h * self.num_attention_heads * qk
            else:
                q = (
                    h * m.q_lora_rank
                    + m.q_lora_rank
                    + m.q_lora_rank * self.num_attention_heads * qk
                )
            kv = (
                h * (m.kv_lora_rank + m.qk_rope_head_dim)
                + m.kv_lora_rank
                + m.kv_lora_rank * self.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
            )
            o = self.num_attention_heads * m.v_head_dim * h
            attn = q + kv + o
        else:
            q_out = self.num_attention_heads * self.head_dim
            kv_out = self.num_kv_heads * self.head_dim
            attn = h * q_out + 2 * h * kv_out + q_out * h
            if self.family == "qwen3_moe":
                attn += 2 * self.head_dim  # q_norm, k_norm over the head dim
        return attn + 2 * h  # input_layernorm + post_attention_layernorm

    def expert_params(self) -> int:
        """One routed expert (gate, up, down projections)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    def moe_layer_expert_params(self) -> int:
        """All routed experts of one MoE layer: what AutoEP splits over the EP group."""
        return self.num_experts * self.expert_params()

    def moe_layer_dense_params(self) -> int:
        """The non-expert part of one MoE layer's MLP: router and shared experts."""
        return self.num_experts * self.hidden_size + 3 * self.hidden_size * self.shared_expert_size

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
                self.attention_params()
                + self.moe_layer_dense_params()
                + self.moe_layer_expert_params()
            )
        return self.attention_params() + self.dense_mlp_params()

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


@dataclass(frozen=True)
class ResolvedModel:
    """A model the plan can name: its spec, its full HF config and where it came from."""

    spec: MoEModelSpec
    hf_config: dict[str, Any]
    preset: str | None
    path: str | None


# ---- presets -------------------------------------------------------------------------------
# Published dims of the released checkpoints' config.json (Hugging Face hub), plus tiny debug
# models sized for CPU tests (byte tokenizer: vocab 256).
# Files that make a folder a loadable checkpoint (transformers' from_pretrained).
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")

_PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        router_aux_loss_coef=0.02,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "mixtral-8x22b": dict(
        model_type="mixtral",
        vocab_size=32768,
        hidden_size=6144,
        intermediate_size=16384,
        num_hidden_layers=56,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=65536,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        router_aux_loss_coef=0.001,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    ),
    # Tiny debug models (CPU tests). Byte tokenizer: 256 bytes + BOS 256 / EOS 257 / PAD 258,
    # vocab padded to 320 (a multiple of 64). 8 experts top-2 like the benchmark model.
    "tiny-mixtral": dict(
        model_type="mixtral",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        router_aux_loss_coef=0.01,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    ),
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    ),
    "tiny-deepseek-v3": dict(
        model_type="deepseek_v3",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=1.0,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    ),
    # The trainer benchmark's shape: hidden 1024, 4 layers, 8 experts top-2 (seq 1024,
    # micro-batch 16, bf16), expert width 3.5h like
    # Mixtral (8 x 3 x 1024 x 3584 x 4 = 352M expert parameters), vocabulary 32000 and 4 KV heads as
    # in
    # the measured run (benchmarks/trainer_bench.py): 430M parameters.
    "bench-mixtral": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        router_aux_loss_coef=0.01,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    ),
    # The 3.4B shape of the MFU benchmark (benchmarks/mfu_bench.py, issue 17): hidden 2048, expert
    # FFN 4096, 16 experts top-2, 8 layers, 16 heads / 8 KV heads, vocabulary 32000.
    "bench-mixtral-3b": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        num_local_experts=16,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        router_aux_loss_coef=0.01,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    ),
}

# Published totals the tests check the counts against (parameters, model cards).
PUBLISHED_TOTALS = {
    "mixtral-8x7b": 46.7e9,
    "mixtral-8x22b": 141e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235e9,
    "deepseek-v3": 671e9,
}


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def preset_hf_config(name: str) -> dict[str, Any]:
    """A complete HF config dict for preset ``name`` (a fresh copy; safe to mutate)."""
    try:
        cfg = copy.deepcopy(_PRESETS[name])
    except KeyError:
        raise DocumentError(
            f"model: unknown preset {name!r}; known presets: {', '.join(_PRESETS)}"
        ) from None
    cfg["architectures"] = [_ARCHITECTURES[cfg["model_type"]]]
    if cfg["model_type"] != "deepseek_v3":
        cfg.setdefault(
            "rope_parameters", {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        )
    cfg.setdefault("torch_dtype", "bfloat16")
    return cfg


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
    "head_dim": 4096,
    "kv_lora_rank": 65_536,
    "q_lora_rank": 65_536,
    "qk_nope_head_dim": 4096,
    "qk_rope_head_dim": 4096,
    "v_head_dim": 4096,
    "decoder_sparse_step": 512,
    "first_k_dense_replace": 512,
}


def _int_in_bounds(value: Any, key: str, where: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise DocumentError(f"{where}.{key}: {value!r} is not {what}")
    limit = MODEL_LIMITS.get(key)
    if limit is not None and value > limit:
        raise DocumentError(f"{where}.{key}: {value} exceeds the planner's limit {limit}")
    return value


def _req(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise DocumentError(f"{where}.{key}: missing (needed for a {cfg.get('model_type')} model)")
    return _int_in_bounds(cfg[key], key, where)


def _opt(
    cfg: dict[str, Any], key: str, where: str, default: int | None, *, minimum: int = 1
) -> Any:
    """An optional integer field (absent, null or 0 -> ``default``)."""
    value = cfg.get(key)
    if value is None or (value == 0 and not isinstance(value, bool)):
        return default
    return _int_in_bounds(value, key, where, minimum=minimum)


def _req_any(cfg: dict[str, Any], keys: tuple[str, ...], where: str) -> Any:
    """The first of ``keys`` present: HF configs spell some fields two ways (``attribute_map``;
    ``to_dict()`` writes the mapped name, hub files the original)."""
    for key in keys:
        if cfg.get(key) is not None:
            return _req(cfg, key, where)
    return _req(cfg, keys[0], where)


def spec_from_hf_config(cfg: dict[str, Any], where: str = "hfConfig") -> MoEModelSpec:
    """Parse a HF ``config.json`` dict of a supported family into a :class:`MoEModelSpec`."""
    if not isinstance(cfg, dict):
        raise DocumentError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise DocumentError(
            f"{where}.model_type: {family!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    h = _req(cfg, "hidden_size", where)
    layers = _req(cfg, "num_hidden_layers", where)
    heads = _req(cfg, "num_attention_heads", where)
    kv_heads = _opt(cfg, "num_key_value_heads", where, heads)
    top_k = _req(cfg, "num_experts_per_tok", where)
    common = dict(
        family=family,
        hidden_size=h,
        num_layers=layers,
        top_k=top_k,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=_req(cfg, "vocab_size", where),
        max_position_embeddings=_req(cfg, "max_position_embeddings", where),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    mla = None
    if family == "mixtral":
        experts = _req_any(cfg, ("num_local_experts", "num_experts"), where)
        moe_ids = tuple(range(layers))
        spec = MoEModelSpec(
            expert_intermediate_size=_req(cfg, "intermediate_size", where),
            dense_intermediate_size=0,
            shared_expert_size=0,
            moe_layer_ids=moe_ids,
            num_experts=experts,
            head_dim=_opt(cfg, "head_dim", where, h // heads),
            **common,
        )
    elif family == "qwen3_moe":
        experts = _req_any(cfg, ("num_experts", "num_local_experts"), where)
        step = _opt(cfg, "decoder_sparse_step", where, 1)
        mlp_only_raw = cfg.get("mlp_only_layers") or []
        if not isinstance(mlp_only_raw, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in mlp_only_raw
        ):
            raise DocumentError(
                f"{where}.mlp_only_layers: {mlp_only_raw!r} is not a list of layer indices"
            )
        mlp_only = set(mlp_only_raw)
        moe_ids = tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
        spec = MoEModelSpec(
            expert_intermediate_size=_req(cfg, "moe_intermediate_size", where),
            dense_intermediate_size=_opt(cfg, "intermediate_size", where, 0),
            shared_expert_size=0,
            moe_layer_ids=moe_ids,
            num_experts=experts,
            head_dim=_opt(cfg, "head_dim", where, h // heads),
            **common,
        )
    else:
        experts = _req_any(cfg, ("n_routed_experts", "num_local_experts"), where)
        first_dense = _opt(cfg, "first_k_dense_replace", where, 0)
        moe_inter = _req(cfg, "moe_intermediate_size", where)
        mla = MLADims(
            q_lora_rank=_opt(cfg, "q_lora_rank", where, None),
            kv_lora_rank=_req(cfg, "kv_lora_rank", where),
            qk_nope_head_dim=_req(cfg, "qk_nope_head_dim", where),
            qk_rope_head_dim=_req(cfg, "qk_rope_head_dim", where),
            v_head_dim=_req(cfg, "v_head_dim", where),
        )
        spec = MoEModelSpec(
            expert_intermediate_size=moe_inter,
            dense_intermediate_size=_req(cfg, "intermediate_size", where),
            shared_expert_size=_opt(cfg, "n_shared_experts", where, 0) * moe_inter,
            moe_layer_ids=tuple(range(first_dense, layers)),
            num_experts=experts,
            head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            mla=mla,
            **common,
        )
    if spec.top_k > spec.num_experts:
        raise DocumentError(
            f"{where}.num_experts_per_tok: {top_k} exceeds the number of experts "
            f"({spec.num_experts})"
        )
    if not spec.moe_layer_ids:
        raise DocumentError(f"{where}: the model has no MoE layer")
    if spec.num_moe_layers * spec.num_experts > MAX_EXPERT_LAYER_CELLS:
        raise DocumentError(
            f"{where}: {spec.num_moe_layers} MoE layers x {spec.num_experts} experts "
            f"exceeds the planner's limit of {MAX_EXPERT_LAYER_CELLS} (layer, expert) pairs"
        )
    return spec


def resolve_model(ref: str) -> ResolvedModel:
    """``ref`` is a preset name or the path of a HF ``config.json`` (or a folder holding one)."""
    if ref in _PRESETS:
        cfg = preset_hf_config(ref)
        return ResolvedModel(
            spec=spec_from_hf_config(cfg, f"preset {ref}"), hf_config=cfg, preset=ref, path=None
        )
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise DocumentError(
            f"model: {ref!r} is neither a known preset ({', '.join(_PRESETS)}) "
            "nor a config.json file"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DocumentError(f"model: cannot read {path}: {exc}") from None
    # The trainer loads weights from a folder (from_pretrained); a config alone means a fresh,
    # seeded initialisation from the hfConfig the plan carries (a plan naming the bare config
    # file failed in the trainer: "model.path ... is not a local directory").
    weights = any(next(path.parent.glob(pattern), None) for pattern in WEIGHT_FILES)
    return ResolvedModel(
        spec=spec_from_hf_config(cfg, str(path)),
        hf_config=cfg,
        preset=None,
        path=str(path.parent) if weights else None,
    )
