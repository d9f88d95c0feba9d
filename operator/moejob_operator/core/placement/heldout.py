"""How much of a fitted placement's in-sample gain survives on the tokens that follow."""

from __future__ import annotations

import math

from .layout import Placement
from .strategies import BY_NAME

# A placement fitted to one window's co-activation keeps less together on the tokens that follow:
# routing keeps moving while the model trains. Scored on the next window of the same run, the
# fitted strategies' cross-group ratio to contiguous came out above their in-sample ratio, by an
# amount that depends on top-k and held from one training run to the next. HELDOUT_OPTIMISM maps
# each recorded top-k to its mean over recordings and EP layouts of the held-out evaluation
# (benchmarks/results/placement-heldout.json, ``meanOptimismByTopK``; each recording predicted
# from the others, ``leaveOneRecordingOut``, in docs/placement.md); other top-k interpolate in
# log2(top-k) and clamp to the ends (``heldout_optimism``). A random split of one recorded
# window's own samples shows no such optimism (a short window's does: core/replan.py); a split in
# time (``tokenSamples.steps``) sees drift but not how much of it reaches the next window
# (benchmarks/results/placement-timesplit.json), so this is a calibration on recorded runs, not a
# per-plan measurement.
HELDOUT_OPTIMISM = {2: 0.051, 4: 0.046, 8: 0.024}


def heldout_optimism(top_k: int, table: dict[int, float] | None = None) -> float:
    """The held-out optimism for ``top_k`` from ``table`` (default ``HELDOUT_OPTIMISM``): the
    measured value where there is one, else linear in log2(top-k) between the nearest measured
    top-k on either side, clamped to the nearest end outside them."""
    table = HELDOUT_OPTIMISM if table is None else table
    if not table:
        raise ValueError("heldout_optimism: empty table")
    ks = sorted(table)
    if top_k <= ks[0]:
        return table[ks[0]]
    if top_k >= ks[-1]:
        return table[ks[-1]]
    hi = next(k for k in ks if k >= top_k)
    lo = max(k for k in ks if k <= top_k)
    if hi == lo:
        return table[lo]
    w = (math.log2(top_k) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return table[lo] + w * (table[hi] - table[lo])


def heldout_estimate(placement: Placement, in_sample_ratio: float, top_k: int) -> float:
    """Expected cross-group ratio to contiguous on tokens after the recorded window: the in-sample
    ratio, raised by ``heldout_optimism(top_k)`` for layouts fitted to the co-activation (capped
    at 1); layouts that ignore it (contiguous, round_robin, balanced, a fallback) keep theirs."""
    row = BY_NAME.get(placement.strategy)
    if placement.fell_back or row is None or not row.fitted:
        return in_sample_ratio
    return min(1.0, in_sample_ratio * (1 + heldout_optimism(top_k)))
