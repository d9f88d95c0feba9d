"""The grouped MoE block computes exactly what the HF block computes (outputs and gradients),
is invariant under the placement permutation, and does not sync with the host on its fast path."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from moe_trainer.fast.ops import plan_dispatch, swiglu
from moe_trainer.model.grouped_moe import GroupedMoeBlock, swap_moe_blocks

H, F, E, K = 32, 48, 4, 2


def _mixtral_cfg(**kw):
    return MixtralConfig(
        hidden_size=H,
        intermediate_size=F,
        num_local_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        **kw,
    )


def _init(block, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block


def _run(block, x, grad):
    x = x.detach().clone().requires_grad_()
    y = block(x)
    y.backward(grad)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


@pytest.fixture(autouse=True)
def _seeded():
    """Inputs come from the global generator: seed it so a failure reproduces."""
    torch.manual_seed(0)


def _close(actual, expected, atol, msg=None):
    """Equal up to fp32 summation order: the absolute tolerance scales with the tensor's largest
    entry. The router's weight gradient sums many tokens x experts terms into entries far above 1,
    where another summation order moves an entry by more than an unscaled 1e-5 on some random
    inputs; a wrong gradient is off by the entries' own size."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=atol, msg=msg)


def _assert_same(hf, fast, x, atol):
    grad = torch.randn_like(x)
    y_ref, gx_ref, gp_ref = _run(hf, x, grad)
    y, gx, gp = _run(fast, x, grad)
    assert set(gp) == set(gp_ref)  # same parameter names: checkpoints and the permutation apply
    _close(y, y_ref, atol)
    _close(gx, gx_ref, atol)
    for name in gp_ref:
        _close(gp[name], gp_ref[name], atol, msg=name)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_matches_hf_mixtral_outputs_and_grads(impl):
    hf = _init(MixtralSparseMoeBlock(_mixtral_cfg()), seed=1)
    fast = GroupedMoeBlock.from_hf(copy.deepcopy(hf), impl=impl)
    _assert_same(hf, fast, torch.randn(3, 7, H), atol=1e-5)


def test_matches_hf_with_an_expert_nobody_picks():
    hf = _init(MixtralSparseMoeBlock(_mixtral_cfg()), seed=2)
    with torch.no_grad():
        hf.gate.weight[1] = -5.0  # positive inputs: expert 1's logit is far below every other
    fast = GroupedMoeBlock.from_hf(copy.deepcopy(hf))
    x = torch.randn(2, 9, H).abs()
    fast(x)
    assert fast.last_tokens_per_expert[1].item() == 0  # the empty group really is exercised
    _assert_same(hf, fast, x, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_matches_hf_qwen3_moe(norm_topk_prob):
    cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=F,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=norm_topk_prob,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    hf = _init(Qwen3MoeSparseMoeBlock(cfg), seed=3)
    fast = GroupedMoeBlock.from_hf(copy.deepcopy(hf))
    _assert_same(hf, fast, torch.randn(2, 5, H), atol=1e-5)


def test_bf16_grouped_mm_close_to_hf_in_bf16():
    """Same bf16 weights and inputs: same routing, expert math within bf16 rounding.
    (Against fp32 HF a few tokens flip their top-k under bf16 rounding, so that is no test.)"""
    hf = _init(MixtralSparseMoeBlock(_mixtral_cfg()), seed=4).to(torch.bfloat16)
    fast = GroupedMoeBlock.from_hf(copy.deepcopy(hf), impl="grouped_mm")
    for seed in range(5):
        x = torch.randn(4, 8, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        ref = hf(x).float()
        y = fast(x).float()
        assert ((y - ref).norm() / ref.norm()).item() < 2e-2


def test_expert_permutation_preserves_function():
    """Placement permutes experts and router rows together: the block's function must not change."""
    fast = GroupedMoeBlock.from_hf(_init(MixtralSparseMoeBlock(_mixtral_cfg()), seed=5))
    x = torch.randn(2, 6, H)
    before = fast(x).detach()
    ids_before = fast.last_topk_ids.clone()
    new2old = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        fast.gate.weight.copy_(fast.gate.weight[new2old])
        fast.experts.gate_up_proj.copy_(fast.experts.gate_up_proj[new2old])
        fast.experts.down_proj.copy_(fast.experts.down_proj[new2old])
    after = fast(x).detach()
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    old2new = torch.argsort(new2old)
    assert torch.equal(
        torch.sort(fast.last_topk_ids, -1).values, torch.sort(old2new[ids_before], -1).values
    )


def test_swap_in_model_keeps_logits_state_dict_and_router_logits():
    torch.manual_seed(6)
    model = MixtralForCausalLM(_mixtral_cfg(output_router_logits=True)).eval()
    ids = torch.randint(0, 64, (2, 10))
    ref = model(input_ids=ids, labels=ids)
    keys = set(model.state_dict())
    assert swap_moe_blocks(model) == 2
    assert all(isinstance(layer.mlp, GroupedMoeBlock) for layer in model.model.layers)
    assert set(model.state_dict()) == keys
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        out.aux_loss, ref.aux_loss
    )  # HF's router recorder still sees our router
    assert swap_moe_blocks(model) == 0


def test_statistics_interface():
    fast = GroupedMoeBlock.from_hf(_init(MixtralSparseMoeBlock(_mixtral_cfg()), seed=7))
    seen = []
    fast.route_callbacks.append(lambda blk, logits, ids: seen.append((logits.shape, ids.shape)))
    fast(torch.randn(3, 5, H))
    assert seen == [(torch.Size([15, E]), torch.Size([15, K]))]
    assert fast.last_tokens_per_expert.dtype == torch.int32
    expected = torch.bincount(fast.last_topk_ids.reshape(-1), minlength=E)
    assert torch.equal(fast.last_tokens_per_expert.long(), expected)
    assert not fast.last_router_logits.requires_grad


def test_plan_dispatch_is_a_consistent_permutation():
    ids = torch.randint(0, 5, (37, 3))
    plan = plan_dispatch(ids, 5)
    flat = ids.reshape(-1)
    assert torch.equal(plan.perm[plan.inv], torch.arange(flat.numel()))
    sorted_ids = flat[plan.perm]
    assert torch.all(sorted_ids[1:] >= sorted_ids[:-1])
    assert torch.equal(plan.offsets.long(), torch.cumsum(torch.bincount(flat, minlength=5), 0))
    assert torch.equal(plan.token_idx, plan.perm // 3)


def test_swiglu_backward_matches_autograd():
    gate_up = torch.randn(11, 2 * 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: swiglu(t), (gate_up,))


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# aten ops that need the host to read device data (.item()/.tolist() lower to _local_scalar_dense).
HOST_SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "bincount",
    "masked_select",
    "unique",
    "_unique2",
}


@pytest.mark.parametrize(("which", "syncs"), [("grouped", False), ("hf_eager", True)])
def test_fast_path_has_no_host_sync(which, syncs):
    """Record every aten op of forward + backward; HF's eager block (nonzero) is the positive
    control."""
    block = _init(MixtralSparseMoeBlock(_mixtral_cfg()), seed=8)
    if which == "grouped":
        block = GroupedMoeBlock.from_hf(block, impl="grouped_mm")
    x = torch.randn(2, 6, H, requires_grad=True)
    with _OpRecorder() as rec:
        block(x).sum().backward()
    assert ("_grouped_mm" in rec.ops) is (which == "grouped")
    assert bool(rec.ops & HOST_SYNC_OPS) is syncs, sorted(rec.ops & HOST_SYNC_OPS)


def test_errors_name_the_problem():
    with pytest.raises(TypeError, match="Linear is not one of"):
        GroupedMoeBlock.from_hf(torch.nn.Linear(2, 2))
    hf = MixtralSparseMoeBlock(_mixtral_cfg())
    with pytest.raises(ValueError, match="impl: 'fast' is not one of"):
        GroupedMoeBlock.from_hf(hf, impl="fast")
