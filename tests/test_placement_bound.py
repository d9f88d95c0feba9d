"""benchmarks/placement_bound.py: the LP bound is never below what the best placement achieves, and
the search's best placement is a real one (never below the optimum) that finds the optimum on small
instances."""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from placement_bound import best_found, connectivity, together_bound


def _partitions(E, m):
    """Every assignment of E experts to groups of m (group labels), up to relabelling."""

    def rec(left, label, grp):
        if not left:
            yield grp.copy()
            return
        first = left[0]
        for rest in itertools.combinations(left[1:], m - 1):
            for e in (first, *rest):
                grp[e] = label
            yield from rec([e for e in left if e != first and e not in rest], label + 1, grp)

    yield from rec(list(range(E)), 0, np.zeros(E, dtype=np.int64))


@pytest.mark.parametrize(("top_k", "m", "seed"), [(2, 2, 0), (2, 4, 1), (3, 4, 2), (4, 4, 3)])
def test_bound_holds_against_every_placement(top_k, m, seed):
    E, G = 8, 8 // m
    rng = np.random.default_rng(seed)
    popularity = rng.gamma(0.7, size=E)
    te = np.array(
        [
            np.sort(rng.choice(E, top_k, replace=False, p=popularity / popularity.sum()))
            for _ in range(300)
        ]
    )
    best_lam = min(connectivity(te, grp).sum() for grp in _partitions(E, m))
    r = together_bound(te, E, m, G)
    assert r["converged"] and r["tokens"] == 300
    assert 2 * 300 - r["together"] <= best_lam + 1e-6  # a lower bound on sum(lam)
    assert 2 * 300 - r["together"] >= 300  # and not a vacuous one


def test_bound_is_tight_when_blocks_fit_the_groups():
    rng = np.random.default_rng(0)
    blocks = [np.array([0, 2, 5, 7]), np.array([1, 3, 4, 6])]
    te = np.array([np.sort(rng.choice(blocks[t % 2], 3, replace=False)) for t in range(200)])
    r = together_bound(te, 8, 4, 2)
    assert r["together"] == pytest.approx(200)


def test_bound_refuses_what_it_cannot_bound():
    with pytest.raises(ValueError, match="top-2 or 2 groups"):
        together_bound(np.array([[0, 1, 2]]), 8, 2, 4)


@pytest.mark.parametrize(("top_k", "m", "seed"), [(2, 4, 1), (3, 4, 2), (4, 4, 3), (3, 2, 4)])
def test_best_found_is_a_placement_and_finds_the_optimum_of_small_instances(top_k, m, seed):
    E = 8
    rng = np.random.default_rng(seed)
    popularity = rng.gamma(0.7, size=E)
    te = np.array(
        [rng.choice(E, top_k, replace=False, p=popularity / popularity.sum()) for _ in range(300)]
    )
    best_lam = min(connectivity(te, grp).sum() for grp in _partitions(E, m))
    r = best_found(te, E, m, starts=8)
    assert r["bestLambda"] == best_lam
    assert 1 <= r["startsReachingBest"] <= 8
