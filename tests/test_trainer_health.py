"""Health checks: dead experts, stragglers, non-finite loss, router logits, fragmentation."""

import math

import numpy as np

from moe_trainer.telemetry.health import SIGNIFICANCE, HealthMonitor, significantly_low

ARGS = dict(
    dead_steps=20,
    dead_fraction=0.1,
    router_logit_limit=30.0,
    straggler_factor=2.0,
    straggler_steps=2,
    fragmentation_limit=0.3,
)


def monitor(**kw):
    return HealthMonitor(2, 4, 3, **{**ARGS, **kw})


def routed_load(rng, layers, experts, tokens, top_k=2, starve=()):
    """load[layers, experts] of one step: every token picks ``top_k`` distinct experts uniformly
    at random, except that the (layer, expert) pairs in ``starve`` are never picked."""
    load = np.zeros((layers, experts), dtype=np.int64)
    for layer in range(layers):
        scores = rng.random((tokens, experts))
        for lay, e in starve:
            if lay == layer:
                scores[:, e] = 2.0  # sorts last: never in the top k
        picks = np.argsort(scores, axis=1)[:, :top_k]
        load[layer] = np.bincount(picks.ravel(), minlength=experts)
    return load


def test_uniform_random_routing_gives_no_dead_expert():
    """A healthy router on random tokens, at few and at many tokens per step, for many windows:
    no finding (the per-step rule flagged experts here)."""
    rng = np.random.default_rng(0)
    for tokens in (2, 16, 4096):
        m = monitor(dead_steps=4, dead_fraction=0.5)  # a strict fraction: more chances to err
        m2 = HealthMonitor(4, 8, 3, **{**ARGS, "dead_steps": 20})
        for _ in range(120):
            load = routed_load(rng, 4, 8, tokens)
            assert m.update_dead(load[:2, :4]) == [] and m2.update_dead(load) == [], tokens


def test_few_tokens_are_no_evidence_even_for_an_idle_expert():
    """An expert that got nothing is not called dead while its fair share is a handful of
    tokens: a short run, or a tiny batch."""
    rng = np.random.default_rng(1)
    m = HealthMonitor(4, 8, 3, **ARGS)
    for _ in range(40):
        assert m.update_dead(routed_load(rng, 4, 8, 2, starve=[(1, 3)])) == []
    assert m.dead_experts() == []


def test_starved_expert_is_found_within_three_windows_and_reported_once():
    rng = np.random.default_rng(2)
    m = HealthMonitor(4, 8, 3, **ARGS)  # dead_steps 20: windows of 10 steps
    start, w = 7, m.window
    seen = []
    for step in range(1, 61):
        starve = [(1, 3)] if step > start else []
        found = m.update_dead(routed_load(rng, 4, 8, 64, starve=starve))
        seen.append((step, [f.message.split(":")[0] for f in found]))
    first = next(step for step, f in seen if f)
    assert start < first <= start + 3 * w - 1, seen
    # from then on the same one finding, for the same expert
    assert all(f == ["layer 1 expert 3"] for step, f in seen if step >= first), seen
    assert m.dead_experts() == [[1, 3]]
    for _ in range(w):  # a healthy window: it recovered
        m.update_dead(routed_load(rng, 4, 8, 64))
    assert m.dead_experts() == []


def test_significance_needs_more_tokens_for_more_experts():
    """The rule's threshold: an idle expert is significant once its expected share reaches about
    ln(L*E/alpha) tokens, not before."""
    need = math.log(4 * 8 / SIGNIFICANCE)
    for expected, want in ((0.8 * need, False), (1.2 * need, True)):
        load = np.full((4, 8), expected)
        load[2, 5] = 0
        low = significantly_low(load, 0.1, SIGNIFICANCE)
        assert low[2, 5] == want and low.sum() == int(want), expected


def test_straggler_needs_consecutive_slow_steps():
    m = monitor()
    assert m.update_stragglers([1.0, 1.0, 3.0]) == []
    found = m.update_stragglers([1.0, 1.1, 2.5])
    assert len(found) == 1 and found[0].message.startswith("rank 2:")
    assert m.update_stragglers([1.0, 1.0, 1.0]) == []


def test_loss_logits_fragmentation():
    m = monitor()
    assert m.check_loss(2.5) == []
    assert m.check_loss(math.nan)[0].type == "NonFiniteLoss"
    assert m.check_loss(math.inf)[0].severity == "Error"
    found = m.check_router_logits([12.0, 45.0])
    assert [f.message.split(":")[0] for f in found] == ["layer 1"]
    assert m.check_router_logits([math.nan, 1.0])[0].type == "RouterLogitsOutOfRange"
    assert m.check_fragmentation(None) == [] and m.check_fragmentation(0.1) == []
    assert m.check_fragmentation(0.5)[0].type == "Fragmentation"


def test_state_roundtrip():
    m = monitor(dead_steps=2)
    for _ in range(3):
        m.update_dead([[0, 100, 100, 100], [100] * 4])
    m2 = monitor(dead_steps=2)
    m2.load_state_dict(m.state_dict())
    assert (m2.low_windows == m.low_windows).all() and m2.window_steps == m.window_steps == 0
    assert (m2.window_load == m.window_load).all()
    m.update_dead([[0, 100, 100, 100], [100] * 4])
    m2.update_dead([[0, 100, 100, 100], [100] * 4])
    assert m.dead_experts() == m2.dead_experts() == [[0, 0]]
