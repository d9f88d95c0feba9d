"""Router groups (DeepSeek-V3 n_group / topk_group): placements keep every group whole, whole
groups lie inside one NVLink group, and (a real HF model) why: a permutation that keeps groups
keeps the model, one that splits them changes it."""

import numpy as np
import pytest

from moejob_operator.core import router_groups
from moejob_operator.core.routing import synthetic_trace
from moejob_operator.core.topology import ClusterTopology


@pytest.mark.parametrize(
    ("E", "n_group", "ep", "gpn", "group"),
    [(16, 4, 4, 4, 2), (32, 16, 4, 4, 2), (16, 2, 4, 2, 2), (64, 8, 8, 4, 4)],
)
@pytest.mark.parametrize("strategy", ["contiguous", "round_robin", "balanced", "topology_aware"])
def test_every_strategy_keeps_router_groups_whole_inside_one_nvlink_group(
    E, n_group, ep, gpn, group, strategy
):
    topo = ClusterTopology.synthetic(nodes=2, gpus_per_node=gpn, group_size=group)
    stats = synthetic_trace(3, E, 4, 600, num_clusters=n_group, seed=5)
    pl = router_groups.solve(
        strategy, topo, stats, ep_size=ep, num_experts=E, num_layers=3, n_group=n_group
    )
    assert router_groups.keeps_groups(pl.permutation, n_group)
    gs = E // n_group
    for layer in range(3):
        e2r = pl.expert2rank(layer)
        for g in range(n_group):
            ranks = np.unique(e2r[g * gs : (g + 1) * gs])
            nvl = np.unique(topo.group_of[pl.rank2gpu[ranks]])
            assert len(nvl) == 1, (strategy, layer, g, ranks)


def test_unconstrained_solver_would_split_groups_and_grouped_one_follows_coactivation():
    from moejob_operator.core import placement

    topo = ClusterTopology.synthetic(nodes=2, gpus_per_node=2, group_size=2)
    stats = synthetic_trace(2, 16, 4, 2000, num_clusters=4, cluster_affinity=0.9, seed=1)
    free = placement.solve("topology_aware", topo, stats, ep_size=4, num_experts=16, num_layers=2)
    assert not router_groups.keeps_groups(free.permutation, 8)  # groups of 2: split freely
    grouped = router_groups.solve(
        "topology_aware", topo, stats, ep_size=4, num_experts=16, num_layers=2, n_group=8
    )
    contiguous = router_groups.solve(
        "contiguous", topo, stats, ep_size=4, num_experts=16, num_layers=2, n_group=8
    )
    from moejob_operator.core import cost

    a = cost.score(grouped, topo, stats, hidden_size=64).cross_group_bytes_per_step
    b = cost.score(contiguous, topo, stats, hidden_size=64).cross_group_bytes_per_step
    assert a < b


def test_keeps_groups_detects_a_split():
    perm = np.array([[2, 3, 0, 1, 6, 7, 4, 5]])
    assert router_groups.keeps_groups(perm, 4)
    assert not router_groups.keeps_groups(np.array([[0, 2, 1, 3, 4, 5, 6, 7]]), 4)
    assert router_groups.keeps_groups(np.array([[1, 0, 2, 3, 4, 5, 6, 7]]), 4) is not False


def test_group_keeping_permutation_keeps_a_deepseek_v3_model_and_a_split_changes_it():
    import torch

    from moe_trainer.model import models

    cfg = dict(
        models.TINY_HF_CONFIGS["tiny-deepseek-v3"],
        n_routed_experts=8,
        n_group=4,
        topk_group=1,
        initializer_range=0.5,
        num_experts_per_tok=2,
    )
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))

    def logits(perm):
        model = models.build_model(cfg, None, seed=3).float()
        with torch.no_grad():  # give the correction bias a pattern to move with
            for ref in models.find_moe_layers(model):
                ref.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.3, 8))
        if perm is not None:
            models.permute_experts(model, [perm] * len(models.find_moe_layers(model)))
        with torch.no_grad():
            return model(input_ids=ids).logits

    base = logits(None)
    kept = [6, 7, 2, 3, 0, 1, 4, 5]  # whole groups (and within-group order) moved
    assert router_groups.keeps_groups(np.array([kept]), 4)
    assert torch.allclose(logits(kept), base, atol=1e-5)
    split = [0, 2, 1, 3, 4, 5, 6, 7]
    assert not router_groups.keeps_groups(np.array([split]), 4)
    assert not torch.allclose(logits(split), base, atol=1e-3)
