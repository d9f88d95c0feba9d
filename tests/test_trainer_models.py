"""Placement applied to HF MoE models: permuting experts + router rows preserves the function."""

import pytest
import torch

from moe_trainer.model import models


@pytest.mark.parametrize("preset", sorted(models.TINY_HF_CONFIGS))
def test_permutation_preserves_function_and_moves_experts(preset):
    model = models.build_model(models.TINY_HF_CONFIGS[preset], seed=3).eval()
    layers = models.find_moe_layers(model)
    E = models.num_experts_of(model)
    assert len(layers) == 2 and E == 4
    with torch.no_grad():
        for ref in layers:  # make the router decisive and DeepSeek's correction bias non-trivial
            ref.gate.weight.mul_(20.0)
            if getattr(ref.gate, "e_score_correction_bias", None) is not None:
                ref.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    originals = models.original_expert_tensors(model)
    routers = [ref.gate.weight.detach().clone() for ref in layers]
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=x).logits
    perm = [[2, 0, 3, 1], [3, 2, 1, 0]]
    models.permute_experts(model, perm)
    with torch.no_grad():
        after = model(input_ids=x).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    for ref, row, orig, router in zip(
        models.find_moe_layers(model), perm, originals, routers, strict=True
    ):
        for slot, e in enumerate(row):
            assert torch.equal(ref.gate.weight[slot], router[e])
            assert torch.equal(ref.experts.gate_up_proj[slot], orig["gate_up_proj"][e])
            assert torch.equal(ref.experts.down_proj[slot], orig["down_proj"][e])


def test_permuting_experts_alone_changes_the_function():
    """The check above is not vacuous: moving experts without their router rows changes outputs."""
    model = models.build_model(models.TINY_HF_CONFIGS["tiny-mixtral"], seed=3).eval()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=x).logits
        for ref in models.find_moe_layers(model):
            ref.experts.down_proj.copy_(ref.experts.down_proj[[1, 0, 3, 2]])
        after = model(input_ids=x).logits
    assert (after - before).abs().max() > 1e-4


def test_permutation_shape_errors():
    model = models.build_model(models.TINY_HF_CONFIGS["tiny-mixtral"], seed=0)
    with pytest.raises(models.ModelError, match=r"1 rows, the model has 2 MoE layers"):
        models.permute_experts(model, [[0, 1, 2, 3]])
    with pytest.raises(models.ModelError, match=r"permutation\[1\]: not a permutation of 0..3"):
        models.permute_experts(model, [[0, 1, 2, 3], [0, 1, 2, 2]])


def test_swap_seam_replaces_every_block():
    model = models.build_model(models.TINY_HF_CONFIGS["tiny-mixtral"], seed=0)

    class Wrapped(torch.nn.Module):
        def __init__(self, block, config):
            super().__init__()
            self.inner, self.gate, self.experts = block, block.gate, block.experts

        def forward(self, h):
            return self.inner(h)

    assert models.swap_moe_blocks(model, Wrapped) == 2
    assert all(isinstance(r.block, Wrapped) for r in models.find_moe_layers(model))
    with pytest.raises(
        models.ModelError, match=r"training.moeImpl: 'fast' is not 'hf' or 'grouped'"
    ):
        models.apply_moe_impl(model, "fast")


def test_local_path_required_offline(tmp_path):
    with pytest.raises(models.ModelError, match=r"is not a local directory"):
        models.build_model(path=str(tmp_path / "missing"))
