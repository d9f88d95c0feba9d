"""The smoke checks' comparisons, pure: per-group size and direction, the experts' zero shares
(only where the tokens agree), clipping named, near-ties, the tolerance tables, the dispatcher's
byte explanation."""

from __future__ import annotations

import pytest
import torch

from moe_trainer.gate import compare as C
from moe_trainer.gate import dispatch as D

NAMES = ("model.layers.0.mlp.experts.w1", "model.layers.0.mlp.router.gate.weight")


def test_groups_name_what_is_wrong():
    want = {NAMES[0]: torch.ones(2, 3, 4), NAMES[1]: torch.ones(4, 8)}
    tol = C.tolerances("cpu-fp32")
    _, problems, dev = C.compare_groups(dict(want), want, tol, "grad")
    assert not problems and dev == pytest.approx({"gradSize": 0.0, "gradCos": 0.0}, abs=1e-12)
    ours = {NAMES[0]: torch.zeros(2, 3, 4), NAMES[1]: 2 * torch.ones(4, 8)}
    _, problems, _ = C.compare_groups(ours, want, tol, "grad")
    assert problems[0].startswith("router: gradient differs from the reference: size x2")
    assert problems[1].startswith("experts: gradient is zero") and "does not move" in problems[1]


def test_zero_shares_compare_only_experts_with_the_same_tokens():
    g = torch.ones(2, 3, 4)
    g[1] = 0  # local expert 1 got no gradient
    want = {NAMES[0]: torch.ones(2, 3, 4)}
    layers = {"model.layers.0.mlp.experts": (0, 2)}  # layer 0, local expert 0 is slot 2
    same = torch.ones(1, 4, dtype=torch.bool)
    tokens = torch.full((1, 4), 7.0)
    worst, problems = C.compare_zero_fractions({NAMES[0]: g}, want, 1e-3, layers, same, tokens)
    assert (
        worst == 1.0
        and "local expert 1 (slot 3, 7 tokens): 100% of its gradient is zero" in problems[0]
    )
    same[0, 3] = False  # a near-tie routed its tokens elsewhere: not compared
    assert C.compare_zero_fractions({NAMES[0]: g}, want, 1e-3, layers, same, tokens) == (0.0, [])


def test_clipping_is_named():
    text = C.clipping_diagnosis(2.0, 0.5, 4.0)
    assert "exceeds gradient_clipping 0.5" in text and "the gradients were not clipped" in text
    assert "clipped by another factor" in C.clipping_diagnosis(2.0, 0.5, 2.0)
    assert "should not act" in C.clipping_diagnosis(0.2, 0.5, 1.5)


def test_tolerance_tables():
    assert C.table_key("cpu", {}) == "cpu-fp32"
    assert C.table_key("cuda", {"bf16": {"enabled": True}}) == "cuda-bf16"
    base, tie = C.tolerances("cpu-fp32"), C.tolerances("cpu-fp32", near_tie=True)
    assert tie["gradSize"] > base["gradSize"] and tie["lr"] == base["lr"]
    with pytest.raises(C.ToleranceError, match="no tolerances for cuda-fp32"):
        C.tolerances("cuda-fp32")


def test_routing_mismatch_reports_the_widest_margin_among_differences():
    ours = [[torch.tensor([[0, 1], [2, 3]])]]
    ref = [[torch.tensor([[1, 0], [2, 4]])]]  # token 0 the same set, token 1 differs
    margins = [[torch.tensor([0.5, 2e-4])]]
    assert D.routing_mismatch(ours, ref, margins) == (0.5, pytest.approx(2e-4))
    assert D.routing_mismatch(ours, ours, margins) == (0.0, 0.0)


def test_dispatch_explains_a_dispatcher_that_does_not_deduplicate():
    # 2 ranks, one group: each token of rank 0 picks both experts of rank 1 (slots 2, 3)
    tokens = [[[torch.tensor([[2, 3], [2, 3]])]], [[torch.tensor([[0, 1], [0, 1]])]]]
    pred = D.predict(
        tokens,
        num_experts=4,
        ep_size=2,
        rank_group=[0, 0],
        rank_node=[0, 0],
        row_bytes=8,
        forward_passes=1,
    )
    assert pred["autoep"]["intraGroup"] > pred["dedup"]["intraGroup"] > 0
    measured = {t: round(pred["autoep"][t]) for t in D.TIERS}
    sb = D.StepBytes(measured, dict.fromkeys(D.TIERS, 0), pred)
    why = D.explain(3, "dedup", sb)
    assert why.startswith("step 3:") and "the dispatcher does not de-duplicate" in why
    assert (
        D.explain(
            3, "dedup", D.StepBytes({t: round(v) for t, v in pred["dedup"].items()}, {}, pred)
        )
        is None
    )


def test_arch_list_deepspeed_can_parse():
    """GPU images set arch-specific entries (9.0a) that DeepSpeed 0.19's JIT builder cannot parse
    (int("0a"): the H200 smoke run failed at fused_adam on it)."""
    from moe_trainer.distenv import deepspeed_arch_list

    assert deepspeed_arch_list("9.0a") == "9.0"
    assert deepspeed_arch_list("8.0;9.0a;10.0f+PTX") == "8.0;9.0;10.0+PTX"
    assert deepspeed_arch_list("9.0 9.0a") == "9.0"
    assert deepspeed_arch_list("8.6+PTX") == "8.6+PTX"
    assert deepspeed_arch_list(None) is None and deepspeed_arch_list("") == ""


def test_the_reference_takes_every_ranks_expert_rows_back_exactly():
    """hf_pieces inverts hf_view: the engine's tensors of two EP ranks written into a reference
    reproduce it exactly (router renamed, gate/up halves, down rows), so each step is compared
    from the engine's own weights."""
    from moe_trainer.gate.reference import ExpertSlice, ReferenceRun, hf_pieces, hf_view

    E, F_, H = 4, 3, 5
    pre = "model.layers.0.mlp.experts"
    ref_params = {
        f"{pre}.gate_up_proj": torch.randn(E, 2 * F_, H),
        f"{pre}.down_proj": torch.randn(E, H, F_),
        "model.layers.0.mlp.gate.weight": torch.randn(E, H),
        "model.norm.weight": torch.randn(H),
    }
    engine_names = [f"{pre}.w1", f"{pre}.w2", f"{pre}.w3", "model.layers.0.mlp.router.gate.weight"]
    pieces = []
    for ep_rank in range(2):
        experts = {pre: ExpertSlice(ep_rank, E // 2, F_)}
        pieces.extend(
            hf_pieces(n, hf_view(n, ref_params, experts).clone(), experts)
            for n in [*engine_names, "model.norm.weight"]
        )
    target = ReferenceRun.__new__(ReferenceRun)
    target.params = {k: torch.zeros_like(v) for k, v in ref_params.items()}
    target.sync_weights(pieces)
    for k, v in ref_params.items():
        assert torch.equal(target.params[k], v), k
