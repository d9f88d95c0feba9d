"""Health checks: dead experts, stragglers, non-finite loss, router logits, fragmentation."""

import math

from moe_trainer.health import HealthMonitor


def monitor(**kw):
    args = dict(
        dead_steps=3,
        dead_fraction=0.1,
        router_logit_limit=30.0,
        straggler_factor=2.0,
        straggler_steps=2,
        fragmentation_limit=0.3,
    )
    args.update(kw)
    return HealthMonitor(2, 4, 3, **args)


def test_dead_expert_needs_a_streak_and_recovers():
    m = monitor()
    starved = [[100, 100, 100, 0], [100, 100, 100, 100]]
    assert m.update_dead(starved) == [] and m.update_dead(starved) == []
    found = m.update_dead(starved)
    assert [f.type for f in found] == ["DeadExpert"] and "layer 0 expert 3" in found[0].message
    assert m.dead_experts() == [[0, 3]]
    m.update_dead([[100, 100, 100, 50], [100] * 4])  # recovers: streak resets
    assert m.dead_experts() == []


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
    m = monitor()
    m.update_dead([[0, 100, 100, 100], [100] * 4])
    m2 = monitor()
    m2.load_state_dict(m.state_dict())
    assert (m2.low_streak == m.low_streak).all()
