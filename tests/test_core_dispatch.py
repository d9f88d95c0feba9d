"""core.dispatch: bytes per tier of AutoEP's and the dedup dispatcher, against a per-token
brute-force walk of what each dispatcher sends."""

import numpy as np
import pytest

from moe_contracts.dispatch import copy_sync_bytes
from moejob_operator.core import dispatch, placement
from moejob_operator.core.routing import synthetic_trace
from moejob_operator.core.topology import ClusterTopology

H, P_BYTES = 16, 2


def brute(pl, topo, te, backward=True):
    L, T, K = te.shape
    W, P = pl.world_size, pl.ep_size
    grp = topo.group_of[pl.rank2gpu]
    node = topo.node_of[pl.rank2gpu]
    row = H * P_BYTES
    a_row = 2 * row * (2 if backward else 1)
    d_row = 2 * row + 8 * K + ((2 * row + 4 * K) if backward else 0)
    out = {d: dict.fromkeys(dispatch.TIERS, 0.0) for d in dispatch.DISPATCHERS}

    def charge(d, a, b, n):
        if a == b:
            return
        if grp[a] == grp[b]:
            out[d]["intraGroup"] += n
        else:
            out[d]["crossGroup"] += n
            if node[a] != node[b]:
                out[d]["crossNode"] += n

    for layer in range(L):
        e2r = pl.expert2rank(layer)
        for a in range(W):  # AutoEP count exchange
            for p in range(P):
                charge("autoep", a, a // P * P + p, pl.num_experts // P * 4)
        for t in range(T):
            src = t % W
            base = src // P * P
            groups = dispatch.dispatch_groups(grp[base : base + P])
            where = {r: (g, i) for g, ranks in enumerate(groups) for i, r in enumerate(ranks)}
            dests = [base + int(e2r[e]) for e in te[layer, t]]
            for d in dests:
                charge("autoep", src, d, a_row)
            _, i = where[src - base]
            for g in {where[d - base][0] for d in dests}:
                hub = base + groups[g][i]
                charge("dedup", src, hub, d_row)
                for d in {d for d in dests if where[d - base][0] == g}:
                    charge("dedup", hub, d, d_row)
    return out


@pytest.mark.parametrize(
    ("nodes", "gpn", "group", "ep", "k"),
    [
        (2, 2, 2, 4, 2),
        (2, 2, 2, 4, 8),
        (1, 4, 4, 4, 2),
        (2, 4, 2, 4, 3),
        (2, 2, 1, 4, 2),
        (3, 2, 2, 6, 4),
    ],
)
@pytest.mark.parametrize("strategy", ["contiguous", "balanced", "topology_aware"])
def test_matches_brute_force(nodes, gpn, group, ep, k, strategy):
    topo = ClusterTopology.synthetic(nodes=nodes, gpus_per_node=gpn, group_size=group)
    trace = synthetic_trace(2, 12 if ep == 6 else 16, k, 97, seed=3)
    pl = placement.solve(
        strategy, topo, trace, ep_size=ep, num_experts=trace.num_experts, num_layers=2
    )
    for backward in (True, False):
        got = dispatch.dispatch_bytes(
            pl, topo, trace.token_experts, hidden_size=H, bytes_per_elem=P_BYTES, backward=backward
        )
        want = brute(pl, topo, trace.token_experts, backward)
        assert got == want


def test_one_nvswitch_node_sends_nothing_across_groups_and_dedup_never_sends_more_rows():
    topo = ClusterTopology.synthetic(nodes=1, gpus_per_node=8, group_size=8)
    trace = synthetic_trace(2, 32, 8, 200, seed=1)
    pl = placement.solve("contiguous", topo, trace, ep_size=8, num_experts=32, num_layers=2)
    got = dispatch.dispatch_bytes(pl, topo, trace.token_experts, hidden_size=1024, bytes_per_elem=2)
    assert got["dedup"]["crossGroup"] == got["autoep"]["crossGroup"] == 0
    assert 0 < got["dedup"]["intraGroup"] < got["autoep"]["intraGroup"]


def test_dispatch_groups_fall_back_to_flat_for_unequal_groups():
    assert dispatch.dispatch_groups(np.array([5, 5, 7, 7])) == [[0, 1], [2, 3]]
    assert dispatch.dispatch_groups(np.array([1, 2, 1, 2])) == [[0, 2], [1, 3]]
    assert dispatch.dispatch_groups(np.array([0, 0, 0, 1])) == [[0], [1], [2], [3]]


def test_copy_sync_bytes_charges_weights_there_and_gradients_back_to_the_pair_tier():
    """One copy costs 2 x its bytes (weights home -> holder, gradients back), to the tier
    between the two ranks; crossNode is the part of crossGroup that leaves the node."""
    group, node = np.array([0, 0, 1, 2]), [0, 0, 0, 1]  # ranks 0,1 share a group; 3 is remote
    zero = {"intraGroup": 0, "crossGroup": 0, "crossNode": 0}
    assert copy_sync_bytes(1, 0, group, node, 10) == {**zero, "intraGroup": 20}
    assert copy_sync_bytes(2, 0, group, node, 10) == {**zero, "crossGroup": 20}
    assert copy_sync_bytes(3, 0, group, node, 10) == {**zero, "crossGroup": 20, "crossNode": 20}
    assert copy_sync_bytes(0, 3, group, node, 7) == {**zero, "crossGroup": 14, "crossNode": 14}
