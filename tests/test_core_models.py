"""Model presets and HF config parsing: counts against published totals and real HF modules."""

import json

import pytest

from moejob_operator.core import families, models
from moejob_operator.core.errors import DocumentError

PUBLISHED_ACTIVE = models.PUBLISHED_ACTIVE
TINY = sorted(n for n in models.preset_names() if n.startswith("tiny-"))


@pytest.mark.parametrize("name", sorted(models.PUBLISHED_TOTALS))
def test_preset_totals_match_published(name):
    counts = models.resolve_model(name).spec.counts()
    published = models.PUBLISHED_TOTALS[name]
    assert abs(counts.total - published) / published < 0.02, (name, counts.total)
    if name in PUBLISHED_ACTIVE:
        active = PUBLISHED_ACTIVE[name]
        assert abs(counts.active - active) / active < 0.03, counts
    assert counts.expert + counts.dense == counts.total
    assert counts.active < counts.total


def test_deepseek_v3_layout():
    spec = models.resolve_model("deepseek-v3").spec
    assert spec.moe_layer_ids == tuple(range(3, 61))
    assert spec.num_dense_layers == 3
    assert spec.shared_expert_size == 2048
    assert spec.mla is not None and spec.mla.kv_lora_rank == 512
    assert (spec.num_experts, spec.top_k) == (256, 8)


@pytest.mark.parametrize("name", models.preset_names())
def test_presets_are_accepted_by_transformers(name):
    transformers = pytest.importorskip("transformers")
    cfg = models.preset_hf_config(name)
    fam = families.for_model_type(cfg["model_type"])
    assert cfg["architectures"] == [fam.architecture]
    hf = transformers.AutoConfig.for_model(**cfg)
    assert hf.model_type == cfg["model_type"]
    # transformers' own dict (attribute_map renames some fields) parses to the same spec
    assert models.spec_from_hf_config(hf.to_dict()) == models.spec_from_hf_config(cfg)


def test_every_family_has_a_tiny_preset():
    tiny_families = {models.resolve_model(n).spec.family for n in TINY}
    assert tiny_families == set(families.NAMES)


@pytest.mark.parametrize("name", TINY)
def test_tiny_counts_equal_instantiated_hf_model(name):
    transformers = pytest.importorskip("transformers")
    cfg = models.preset_hf_config(name)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    real = sum(p.numel() for p in model.parameters())
    assert models.spec_from_hf_config(cfg).counts().total == real
    assert (
        cfg["vocab_size"] == 320
        and cfg["pad_token_id"] == 258
        and models.spec_from_hf_config(cfg).num_experts == 8
    )
    # the router groups the placement keeps whole are the ones the HF router uses
    spec = models.spec_from_hf_config(cfg)
    n_group = getattr(model.config, "n_group", None) or 1
    grouped = cfg["model_type"] == "deepseek_v3" or cfg.get("topk_method") == "group_limited_greedy"
    assert spec.router_groups == (n_group if grouped else 1)


def test_preset_config_is_a_fresh_copy():
    a = models.preset_hf_config("tiny-mixtral")
    a["hidden_size"] = 1
    assert models.preset_hf_config("tiny-mixtral")["hidden_size"] == 64


def test_unknown_preset_lists_known_ones():
    with pytest.raises(DocumentError, match=r"unknown preset 'mixtral-9x9b'.*tiny-mixtral"):
        models.preset_hf_config("mixtral-9x9b")
    with pytest.raises(DocumentError, match=r"neither a known preset.*deepseek-v3"):
        models.resolve_model("no-such-model")


def test_qwen3_sparse_step_and_mlp_only_layers():
    cfg = models.preset_hf_config("tiny-qwen3-moe")
    cfg.update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    spec = models.spec_from_hf_config(cfg)
    assert spec.moe_layer_ids == (1, 5)  # (i+1) % 2 == 0, minus layer 3
    assert spec.layer_params(0) == spec.attention_params() + spec.dense_mlp_params()


def test_bad_configs_name_the_field():
    cfg = models.preset_hf_config("tiny-mixtral")
    del cfg["hidden_size"]
    with pytest.raises(DocumentError, match=r"hfConfig\.hidden_size: missing"):
        models.spec_from_hf_config(cfg)
    with pytest.raises(DocumentError, match=r"model_type: 'llama' is not supported"):
        models.spec_from_hf_config({"model_type": "llama"})
    cfg = models.preset_hf_config("tiny-mixtral") | {"num_experts_per_tok": 9}
    with pytest.raises(DocumentError, match=r"num_experts_per_tok: 9 exceeds"):
        models.spec_from_hf_config(cfg)
    cfg = models.preset_hf_config("tiny-mixtral") | {"num_local_experts": "8"}
    with pytest.raises(DocumentError, match=r"num_local_experts: '8' is not a positive integer"):
        models.spec_from_hf_config(cfg)


def test_resolve_model_from_config_file(tmp_path):
    cfg = models.preset_hf_config("tiny-deepseek-v3")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # a config alone: the plan carries hfConfig, no path (the trainer initialises from it)
    for ref in (tmp_path / "config.json", tmp_path):
        resolved = models.resolve_model(str(ref))
        assert resolved.preset is None and resolved.path is None and resolved.hf_config == cfg
        assert resolved.spec == models.resolve_model("tiny-deepseek-v3").spec
    # a folder with weights: the trainer loads it (from_pretrained takes the folder)
    (tmp_path / "model.safetensors").write_bytes(b"")
    for ref in (tmp_path / "config.json", tmp_path):
        assert models.resolve_model(str(ref)).path == str(tmp_path)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(DocumentError, match=r"cannot read .*bad.json"):
        models.resolve_model(str(tmp_path / "bad.json"))
