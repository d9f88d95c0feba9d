"""benchmarks/replica_bench.py ``exact_sets_optimum``: the fewest cross-group rows any placement
with a given number of experts per NVLink group can send equals exhaustive search on small
cases, and the routine refuses what it does not model."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
_env = dict(os.environ)
from replica_bench import exact_sets_optimum  # noqa: E402 (it pins BLAS threads in os.environ)

os.environ.clear()
os.environ.update(_env)  # not for the rest of the session's tests


def _brute(te: np.ndarray, P: int, per_group: int, E: int) -> int:
    """Every pair of expert sets of ``per_group`` experts covering all ``E``: fewest rows."""
    L, T, _ = te.shape
    g_of = (np.arange(T) % P) // (P // 2)
    total = 0
    for layer in range(L):
        best = T
        for a in itertools.combinations(range(E), per_group):
            for b in itertools.combinations(range(E), per_group):
                if set(a) | set(b) != set(range(E)):
                    continue
                held = [np.isin(te[layer], s).all(1) for s in (a, b)]
                whole = np.where(g_of == 0, held[0], held[1])
                best = min(best, int(T - whole.sum()))
        total += best
    return total


@pytest.mark.parametrize(("k", "per_group", "seed"), [(2, 5, 0), (2, 6, 1), (3, 5, 2)])
def test_the_optimum_is_the_exhaustive_minimum(k, per_group, seed):
    E, P = 8, 4
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(E, 0.5))  # skewed popularity
    te = np.stack(
        [np.stack([rng.choice(E, size=k, replace=False, p=p) for _ in range(60)]) for _ in range(2)]
    )
    got = exact_sets_optimum(te, P, 2, per_group, time_limit=60, num_experts=E)
    want = _brute(te, P, per_group, E)
    assert got["proven"] and got["lowerRows"] == got["bestRows"] == want


def test_only_two_groups():
    te = np.zeros((1, 4, 2), dtype=np.int64)
    with pytest.raises(ValueError, match="2 groups"):
        exact_sets_optimum(te, 8, 2, 4, time_limit=1)
