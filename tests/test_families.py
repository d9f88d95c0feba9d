"""The model-family registries: every family exists on both sides and they agree; its tiny model
builds; the operator's parse of its config matches the model transformers builds; the AutoEP
presets named exist in the installed DeepSpeed; unsupported model types are refused by name."""

from __future__ import annotations

import pytest

from moe_trainer import families as trainer_families
from moe_trainer.model import models

core_families = pytest.importorskip("moejob_operator.core.families")
core_models = pytest.importorskip("moejob_operator.core.models")

NAMES = trainer_families.NAMES


def test_both_sides_register_the_same_families():
    assert set(trainer_families.NAMES) == set(core_families.NAMES)
    for name in NAMES:
        op, tr = core_families.get(name), trainer_families.get(name)
        assert op.model_types == tr.model_types, name
        assert op.autoep_preset == tr.autoep_preset, name
        assert op.grouped_block == tr.grouped_block, name
        assert op.architecture == tr.causal_lm_class, name


def test_every_autoep_preset_deepspeed_has_is_covered_and_one_family_uses_our_layer():
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    presets = {f.autoep_preset for f in trainer_families.REGISTRY.values()}
    assert set(PRESET_MODELS) <= presets  # every DeepSpeed 0.19.8 preset has a family
    assert None in presets  # and at least one family trains through the trainer's own block
    for fam in trainer_families.REGISTRY.values():
        if fam.autoep_preset is None:
            assert fam.grouped_block, fam.name
        else:  # the preset reads this family's model type
            hf_types = PRESET_MODELS[fam.autoep_preset].hf_model_types
            assert set(fam.model_types) <= set(hf_types), (fam.name, hf_types)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_builds_and_both_sides_read_it_alike(name):
    fam = trainer_families.get(name)
    cfg = fam.tiny_config
    model = models.build_model(cfg, seed=0)
    assert type(model).__name__ == fam.causal_lm_class
    layers = models.find_moe_layers(model)
    assert layers and all(type(r.block).__name__ == fam.moe_block_class for r in layers)
    spec = core_models.spec_from_hf_config(dict(cfg))
    assert spec.family == name
    assert spec.moe_layer_ids == tuple(r.decoder_layer for r in layers)
    assert spec.num_experts == models.num_experts_of(model)
    assert spec.counts().total == sum(p.numel() for p in model.parameters())
    for ref in layers:  # the tensors the family says a block has
        assert ref.block.get_submodule(fam.router).weight.shape[0] == spec.num_experts
        experts = ref.block.get_submodule(fam.experts)
        assert experts.gate_up_proj.shape[0] == experts.down_proj.shape[0] == spec.num_experts
        for buf in fam.router_buffers:
            assert getattr(ref.block.get_submodule(fam.router), buf).shape == (spec.num_experts,)
        for sub in fam.shared_modules:
            ref.block.get_submodule(sub)


@pytest.mark.parametrize("name", NAMES)
def test_permuting_experts_keeps_the_function(name):
    import torch

    fam = trainer_families.get(name)
    model = models.build_model(fam.tiny_config, seed=1).eval()
    with torch.no_grad():  # nonzero router buffers, so moving them wrongly would show
        for n, b in model.named_buffers():
            if n.rsplit(".", 1)[-1] in fam.router_buffers:
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        before = model(input_ids=ids).logits
        E = models.num_experts_of(model)
        L = len(models.find_moe_layers(model))
        models.permute_experts(model, [list(range(E))[::-1]] * L)
        after = model(input_ids=ids).logits
    assert torch.allclose(before, after, atol=1e-5, rtol=1e-5)


def test_unsupported_and_wrapper_model_types_are_refused_by_name():
    from moejob_operator.core.errors import DocumentError

    with pytest.raises(DocumentError, match=r"'gpt_oss' is not supported; supported: mixtral"):
        core_models.spec_from_hf_config({"model_type": "gpt_oss"})
    with pytest.raises(DocumentError, match=r"'qwen3_5_moe' is not supported: the multimodal"):
        core_models.spec_from_hf_config({"model_type": "qwen3_5_moe"})
    with pytest.raises(DocumentError, match=r"'minimax_m3_vl' is not supported: the multimodal"):
        core_models.spec_from_hf_config({"model_type": "minimax_m3_vl"})
    with pytest.raises(trainer_families.FamilyError, match=r"'gpt_oss' is not a model type"):
        trainer_families.for_model_type("gpt_oss")
    with pytest.raises(trainer_families.FamilyError, match=r"'mixtral' differs from model.family"):
        trainer_families.for_plan("olmoe", {"model_type": "mixtral"})


@pytest.mark.parametrize("name", NAMES)
def test_the_planner_plans_each_family(name):
    """A CPU plan for 2 ranks from the family's tiny preset: AutoEP with its preset where it has
    one, ZeRO-3 with experts as ordinary parameters (EP 1) otherwise; check_plan accepts it."""
    from moejob_operator.core import plan as core_plan

    preset = next(
        n
        for n in core_models.preset_names()
        if n.startswith("tiny-") and core_models.resolve_model(n).spec.family == name
    )
    result = core_plan.build_plan(
        core_plan.PlanRequest(
            "t",
            "default",
            core_models.resolve_model(preset),
            None,
            device="cpu",
            nodes=["node-a"],
            procs_per_node=2,
            cpu_memory_bytes=4 << 30,
            global_batch=4,
            seq_len=32,
        )
    )
    doc = result.document
    core_plan.check_plan(doc)
    ep = doc["deepspeed"].get("expert_parallel") or {}
    fam = core_families.get(name)
    assert doc["model"]["family"] == name
    if fam.autoep_preset:
        assert ep.get("preset_model") == fam.autoep_preset and doc["epSize"] == 2
    else:
        assert not ep.get("enabled") and doc["epSize"] == 1
