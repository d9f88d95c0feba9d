"""core.placement.replicas: the copies solver's invariants, and its bytes on a case worked by hand
(docs/placement.md, "Replicated experts")."""

from __future__ import annotations

import numpy as np
import pytest

from moe_contracts.dispatch import tier_bytes
from moejob_operator.core.placement import replicas as rep
from moejob_operator.core.routing import synthetic_trace

# 4 EP ranks in 2 NVLink groups, one expert per rank (expert e at home on rank e)
GROUPS = np.array([0, 0, 1, 1])
HOME = np.arange(4)
# token t starts on EP rank t: t0 {0,2}, t1 {2,3}, t2 {0,1}, t3 {2,3}
TOKENS = np.array([[0, 2], [2, 3], [0, 1], [2, 3]])
SRC = np.arange(4)
H = 100  # hidden bytes per row
# one dedup row over a link, forward + backward, top-2: (2H + 2 x (id 4 + weight 4)) + (2H + 2 x 4)
ROW = (2 * H + 2 * 8) + (2 * H + 2 * 4)


def _cross(serve: np.ndarray) -> float:
    """The byte model's dedup cross-group bytes for the hand case under ``serve[P, E]``."""
    got = tier_bytes(serve[None], TOKENS[None], SRC, GROUPS, GROUPS, 4, hidden_bytes=H)
    return got["dedup"]["crossGroup"]


def test_single_copy_bytes_by_hand():
    # t0 needs group 1 (expert 2), t1 group 1, t2 group 0, t3 nothing remote: 3 rows
    serve = rep.single_copy(HOME, 4)
    assert _cross(serve) == 3 * ROW
    assert rep.cross_rows(serve, TOKENS, SRC, GROUPS) == 3


def test_one_copy_worked_by_hand():
    """Group 0's tokens score expert 2 highest (t0 misses only it: 1, t1 misses 2 and 3: 1/4
    each, so 1.25); on rank 0 the heaviest rank would carry 4 assignments, on rank 1 three, so
    the copy goes to rank 1 and both ranks of group 0 are served by it. t0 is then all at home,
    t1 still needs expert 3 from group 1, t2 needs group 0: 2 rows."""
    layer = rep.solve_layer(HOME, GROUPS, TOKENS, SRC, slots=1, total=1, load_limit=np.inf)
    assert layer.holders == ((0,), (1,), (2, 1), (3,))
    want = rep.single_copy(HOME, 4)
    want[0, 2] = want[1, 2] = 1
    np.testing.assert_array_equal(layer.serve, want)
    assert _cross(layer.serve) == 2 * ROW
    np.testing.assert_array_equal(layer.load, [2, 3, 1, 2])


def test_full_budget_by_hand_puts_every_token_at_home_and_balances_load():
    """Then expert 3 to rank 0 (t1's last remote expert), expert 0 to rank 2 (t2's two remote
    experts tie at 1/4: the lower id; ranks 2 and 3 tie on load: the lower rank), expert 1 to
    rank 3: no token leaves its group and every rank computes 2 assignments."""
    layer = rep.solve_layer(HOME, GROUPS, TOKENS, SRC, slots=1, load_limit=np.inf)
    assert layer.holders == ((0, 2), (1, 3), (2, 1), (3, 0))
    assert layer.serve.tolist() == [[0, 1, 1, 0], [0, 1, 1, 0], [2, 3, 2, 3], [2, 3, 2, 3]]
    assert _cross(layer.serve) == 0
    np.testing.assert_array_equal(layer.load, [2, 2, 2, 2])


def test_load_limit_skips_a_copy_that_overloads_a_rank():
    # the single-copy max is 3 of a mean 2; a limit of 1.0 x mean allows no rank above 3
    layer = rep.solve_layer(HOME, GROUPS, TOKENS, SRC, slots=1, total=1, load_limit=1.0)
    assert layer.load.max() <= 3
    assert _cross(layer.serve) <= 3 * ROW


def _trace(top_k: int, seed: int = 3):
    return synthetic_trace(2, 16, top_k, 600, num_clusters=4, cluster_affinity=0.6, seed=seed)


@pytest.mark.parametrize("groups", [[0, 0, 1, 1], [0, 1, 2, 3], [0, 0, 0, 0]])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("slots", [0, 1, 2])
def test_invariants(groups, top_k, slots):
    """Holders start at the home and are distinct, every serve entry holds a copy, a rank is
    served by itself when it holds one, the budget holds, bytes never rise above one copy on the
    samples it was fitted on, and the same input gives the same answer."""
    trace = _trace(top_k)
    te = trace.token_experts
    P, E = 4, 16
    rng = np.random.default_rng(top_k)
    perm = np.stack([rng.permutation(E) for _ in range(2)])
    src = np.arange(te.shape[1]) % P
    groups = np.array(groups)
    layers = rep.solve(perm, groups, te, src, slots=slots)
    again = rep.solve(perm, groups, te, src, slots=slots)
    for layer, (c, d) in enumerate(zip(layers, again, strict=True)):
        assert c.holders == d.holders and np.array_equal(c.serve, d.serve)
        home = np.empty(E, dtype=int)
        home[perm[layer]] = np.arange(E) // (E // P)
        per_rank = np.zeros(P, dtype=int)
        for e, h in enumerate(c.holders):
            assert h[0] == home[e] and len(set(h)) == len(h)
            per_rank[list(h[1:])] += 1
            for p in range(P):
                assert c.serve[p, e] in h
                if p in h:
                    assert c.serve[p, e] == p
        assert per_rank.max() <= slots and c.extra_copies <= slots * P
        single = rep.single_copy(home, P)
        assert rep.cross_rows(c.serve, te[layer], src, groups) <= rep.cross_rows(
            single, te[layer], src, groups
        )
        if slots == 0 or len(set(groups.tolist())) == 1:
            assert c.extra_copies == 0 and np.array_equal(c.serve, single)


def test_zero_budget_is_the_single_copy_bytes_exactly():
    te = _trace(2).token_experts
    P, E = 4, 16
    perm = np.tile(np.arange(E), (2, 1))
    src = np.arange(te.shape[1]) % P
    layers = rep.solve(perm, GROUPS, te, src, slots=0)
    single = np.tile(np.arange(E) // 4, (2, 1))
    kw = dict(hidden_bytes=64)
    ours = tier_bytes(rep.serve_table(layers), te, src, GROUPS, GROUPS, P, **kw)
    assert ours == tier_bytes(single, te, src, GROUPS, GROUPS, P, **kw)


def test_copies_cut_bytes_on_clustered_routing_and_respect_a_total():
    te = _trace(2).token_experts
    P, E = 4, 16
    perm = np.tile(np.arange(E), (2, 1))
    src = np.arange(te.shape[1]) % P
    some = rep.solve(perm, GROUPS, te, src, slots=2, total=3)
    more = rep.solve(perm, GROUPS, te, src, slots=2)
    assert all(c.extra_copies <= 3 for c in some)
    kw = dict(hidden_bytes=64)
    single = tier_bytes(np.tile(np.arange(E) // 4, (2, 1)), te, src, GROUPS, GROUPS, P, **kw)
    a = tier_bytes(rep.serve_table(some), te, src, GROUPS, GROUPS, P, **kw)
    b = tier_bytes(rep.serve_table(more), te, src, GROUPS, GROUPS, P, **kw)
    assert b["dedup"]["crossGroup"] <= a["dedup"]["crossGroup"] < single["dedup"]["crossGroup"]


def test_copy_slots_floor():
    assert [rep.copy_slots(16, p) for p in (0, 6, 12, 25, 50)] == [0, 0, 1, 4, 8]
