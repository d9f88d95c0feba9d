"""Per-layer balancing loss and routing statistics (RoutingStats v1 invariants, original ids)."""

import numpy as np
import pytest
import torch

from moe_contracts.errors import DocumentError
from moe_contracts.routing import parse_routing_stats, routing_stats_doc
from moe_trainer.telemetry import routing


class FakeProbe:
    def __init__(self, logits, topk):
        self.logits, self.topk = logits, topk


def onehot_logits(choices, E, scale=10.0):
    """logits[T, E] that put most probability on the given experts (top-2 by construction)."""
    lg = torch.zeros(len(choices), E)
    for t, cs in enumerate(choices):
        for rank, e in enumerate(cs):
            lg[t, e] = scale - rank
    return lg


def test_switch_loss_is_one_when_uniform_and_higher_when_skewed():
    E = 4
    uniform = torch.zeros(8, E)
    topk = torch.tensor([[i % E, (i + 1) % E] for i in range(8)])
    assert routing.switch_aux_loss(uniform, topk, E).item() == pytest.approx(1.0)
    skew_topk = torch.tensor([[0, 1]] * 8)
    skew = onehot_logits([[0, 1]] * 8, E)
    assert routing.switch_aux_loss(skew, skew_topk, E).item() > 1.9


def test_per_layer_loss_sees_imbalance_the_global_loss_hides():
    """Layer 0 sends everything to experts {0,1}, layer 1 to {2,3}: the concatenation looks
    balanced, each layer is not. This is the transformers router-loss blind spot."""
    E = 4
    l0 = [[0, 1]] * 16
    l1 = [[2, 3]] * 16
    probe = FakeProbe(
        [onehot_logits(l0, E), onehot_logits(l1, E)], [torch.tensor(l0), torch.tensor(l1)]
    )
    per_layer = routing.balance_loss(probe, E, "per_layer_aux").item()
    glob = routing.balance_loss(probe, E, "global_aux").item()
    assert glob == pytest.approx(1.0, abs=0.02)
    assert per_layer > 1.9
    assert routing.balance_loss(probe, E, "none") is None


def test_per_layer_loss_gradient_lowers_the_overloaded_expert():
    E = 4
    logits = torch.randn(32, E, generator=torch.Generator().manual_seed(0))
    logits[:, 0] += 3
    logits.requires_grad_(True)
    topk = logits.detach().topk(2, dim=-1).indices
    routing.balance_loss(FakeProbe([logits], [topk]), E, "per_layer_aux").backward()
    # descent direction = -grad: expert 0's logit goes down relative to the others
    assert logits.grad[:, 0].sum() > logits.grad[:, 1:].sum(dim=0).max()


def test_counts_invariants_and_original_ids():
    E, K = 4, 2
    rng = np.random.default_rng(0)
    topk = [
        torch.tensor(np.stack([rng.choice(E, K, replace=False) for _ in range(50)]))
        for _ in range(2)
    ]
    probe = FakeProbe([torch.randn(50, E), torch.randn(50, E)], topk)
    load, coact, maxlog = routing.step_counts(probe, E)
    assert load.shape == (2, E) and coact.shape == (2, E, E) and maxlog.shape == (2,)
    perm = [[2, 0, 3, 1], [1, 3, 0, 2]]
    oload, ocoact = routing.to_original_ids(load.numpy(), coact.numpy(), perm)
    for layer in range(2):
        for s, e in enumerate(perm[layer]):
            assert oload[layer, e] == load[layer, s]
            for s2, e2 in enumerate(perm[layer]):
                assert ocoact[layer, e, e2] == coact[layer, s, s2]
    np.testing.assert_array_equal(routing.load_to_original_ids(load.numpy(), perm), oload)
    doc = routing_stats_doc(oload, ocoact, tokens=50, steps=1, top_k=K, model="t")
    parse_routing_stats(doc)  # sums, symmetry, zero diagonal, row sums
    doc["coactivation"][0][0][1] += 1
    with pytest.raises(DocumentError, match=r"coactivation\[0\]\[0\]\[1\]: .* \(not symmetric\)"):
        parse_routing_stats(doc)
    doc = routing_stats_doc(oload, ocoact, tokens=51, steps=1, top_k=K, model="t")
    with pytest.raises(DocumentError, match=r"load\[0\]: sums to 100, expected tokens\*topK = 102"):
        parse_routing_stats(doc)


def test_max_mean_per_layer():
    assert routing.max_mean_per_layer([[1, 1, 1, 1], [4, 0, 0, 0], [0, 0, 0, 0]]) == [1.0, 4.0, 0.0]
