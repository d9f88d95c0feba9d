"""Re-placement during a job, the fast parts: slot moves, rank 0's decision on the PlacementUpdate
document (file stand-in and ConfigMap reader, absent / unreadable / invalid / stale / refused),
the trainer's slot-indexed statistics following a switch, and the RoutingStats ``window``."""

from __future__ import annotations

import json
import urllib.error

import numpy as np
import pytest
import torch

from moe_contracts import placement_update as PU
from moe_contracts.errors import DocumentError
from moe_contracts.progress import parse_progress
from moe_contracts.routing import (
    configmap_text,
    encode_configmap,
    parse_routing_stats,
    routing_stats_doc,
    window_stats,
)
from moe_trainer import kubeapi, replace, replan
from moe_trainer.telemetry import routing
from moe_trainer.telemetry.token_samples import TokenSampler
from moe_trainer.telemetry.token_samples import to_original_ids as samples_to_original

OLD = [[2, 0, 3, 1], [1, 3, 0, 2]]
NEW = [[3, 1, 0, 2], [3, 0, 1, 2]]


def test_slot_sources():
    src = replace.slot_sources(OLD, NEW)
    for o, n, s in zip(OLD, NEW, src, strict=True):
        assert [o[x] for x in s] == n  # new slot s holds what old slot src[s] held
    with pytest.raises(replace.ReplaceError, match="not a permutation"):
        replace.slot_sources(OLD, [[0, 0, 1, 2], [0, 1, 2, 3]])
    with pytest.raises(replace.ReplaceError, match="layers"):
        replace.slot_sources(OLD, NEW[:1])


@pytest.fixture
def update_file(tmp_path, monkeypatch):
    path = tmp_path / "placement.json"
    monkeypatch.setenv("MOE_TEST_PLACEMENT_FILE", str(path))
    monkeypatch.delenv("MOE_PLACEMENT_CONFIGMAP", raising=False)
    return path


def test_decide_from_the_file_stand_in(update_file):
    r = replan.Replanner(2, 4, None, router_name="gate")
    assert r.enabled and r.decide() is None and r.message == ""  # no document yet
    update_file.write_text("{not json")
    assert r.decide() is None and "not JSON" in r.message
    update_file.write_text(PU.dumps(PU.PlacementUpdate(generation=1, permutation=[[0, 1, 2]])))
    assert r.decide() is None and "layers" in r.message
    update_file.write_text(PU.dumps(PU.PlacementUpdate(generation=0, permutation=NEW)))
    assert r.decide() is None  # generation 0: the plan's own placement, already running
    update_file.write_text(PU.dumps(PU.PlacementUpdate(generation=3, permutation=NEW)))
    assert r.decide() == (3, NEW, None) and r.message == ""
    r.generation = 3
    assert r.decide() is None  # not newer than the running one
    section = r.section()
    assert section is not None and section["generation"] == 3


def _copies(perm: list[list[int]], P: int = 2) -> list[dict]:
    """Every expert of slot 0 also on the last EP rank; each rank served by its own copy."""
    n = len(perm[0]) // P
    out = []
    for row in perm:
        home = {e: s // n for s, e in enumerate(row)}
        holders = [[home[e]] + ([P - 1] if e == row[0] else []) for e in range(len(row))]
        serve = [[p if p in h else h[0] for h in holders] for p in range(P)]
        out.append({"holders": holders, "serve": serve})
    return out


def test_an_update_with_copies(update_file):
    """Copies come with the update; a job that cannot serve them (not the dedup dispatcher), or
    copies that do not fit the update's permutation, refuse it and say why."""
    from types import SimpleNamespace

    plan = SimpleNamespace(ep_size=2, placement=SimpleNamespace(replicas=None))
    r = replan.Replanner(2, 4, None, router_name="gate", plan=plan)
    update_file.write_text(
        PU.dumps(PU.PlacementUpdate(generation=1, permutation=NEW, replicas=_copies(NEW)))
    )
    got = r.decide()
    assert got is not None and got[:2] == (1, NEW) and r.message == ""
    assert [{"holders": x.holders, "serve": x.serve} for x in got[2]] == [
        {"holders": tuple(map(tuple, c["holders"])), "serve": tuple(map(tuple, c["serve"]))}
        for c in _copies(NEW)
    ]
    assert r.decide(serves_copies=False) is None and "dedup dispatcher" in r.message
    doc = {
        "kind": "TrainerProgress",
        "version": 1,
        "phase": "Training",
        "step": 4,
        "totalSteps": 8,
        "placement": r.section(),
    }
    prog = parse_progress(doc)
    assert prog.placement is not None and prog.placement.generation == 0
    assert "copies" in prog.placement.message
    update_file.write_text(
        PU.dumps(PU.PlacementUpdate(generation=1, permutation=NEW, replicas=_copies(OLD)))
    )
    assert r.decide() is None and "must start with the home rank" in r.message


def test_decide_from_the_configmap(monkeypatch):
    monkeypatch.delenv("MOE_TEST_PLACEMENT_FILE", raising=False)
    monkeypatch.setenv("MOE_PLACEMENT_CONFIGMAP", "job-placement")
    answers: list = [None, {"data": {}}, urllib.error.URLError("refused")]
    doc = PU.dumps(PU.PlacementUpdate(generation=2, permutation=NEW))
    answers.append({"data": {PU.KEY: doc}})

    def read(name):
        assert name == "job-placement"
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(kubeapi, "read_configmap", read)
    r = replan.Replanner(2, 4, None, router_name="gate")
    assert r.decide() is None and r.message == ""  # no ConfigMap (404)
    assert r.decide() is None and r.message == ""  # no key yet
    assert r.decide() is None and "not read" in r.message  # API outage: logged, kept running
    assert r.decide() == (2, NEW, None) and r.message == ""  # the message is the latest read's


def test_disabled_without_the_env(monkeypatch):
    monkeypatch.delenv("MOE_TEST_PLACEMENT_FILE", raising=False)
    monkeypatch.delenv("MOE_PLACEMENT_CONFIGMAP", raising=False)
    r = replan.Replanner(2, 4, None, router_name="gate")
    assert not r.enabled and r.section() is None


def test_read_configmap_404_is_none(monkeypatch, tmp_path):
    for name, text in (("namespace", "ns"), ("token", "t")):
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")

    def not_found(req, context=None, timeout=None):
        raise urllib.error.HTTPError(req.full_url, 404, "Not Found", None, None)  # type: ignore[arg-type]

    monkeypatch.setattr(kubeapi.urllib.request, "urlopen", not_found)
    import ssl

    monkeypatch.setattr(ssl, "create_default_context", lambda cafile: None)
    assert kubeapi.read_configmap("x", sa_dir=tmp_path) is None


def test_statistics_follow_the_switch():
    """Counts and token samples in slot ids, read in original ids, are the same document before
    and after a switch (relabelled with the new permutation)."""
    L, E, K = 2, 4, 2
    g = torch.Generator().manual_seed(3)
    acc = routing.RoutingAccumulator(L, E, "cpu")
    sampler = TokenSampler(L, K, 16, 7, 0, 1)
    for step in range(1, 4):
        topk = [
            torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(8)]) for _ in range(L)
        ]
        probe = type("P", (), {"logits": [torch.zeros(8, E)] * L, "topk": topk})()
        load, coact, _ = routing.step_counts(probe, E)
        acc.add(load, coact, 8)
        sampler.add(topk, step, 0)

    def original(perm):
        lo, co = routing.to_original_ids(acc.load.numpy(), acc.coact.numpy(), perm)
        return lo, co, samples_to_original(sampler.merge("cpu")["experts"], perm)

    before = original(OLD)
    src = replace.slot_sources(OLD, NEW)
    acc.relabel(src)
    sampler.relabel([[s.index(x) for x in range(E)] for s in src])
    after = original(NEW)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert before[2] == after[2]


def _doc(load, coact, tokens, steps, window=None, samples=None, sample_steps=None):
    return routing_stats_doc(
        load,
        coact,
        tokens,
        steps,
        2,
        "m",
        samples=samples,
        sample_steps=sample_steps,
        window=window,
    )


def test_routing_window():
    load1 = np.array([[2, 2, 2, 2]])
    coact1 = np.array([[[0, 1, 1, 0], [1, 0, 0, 1], [1, 0, 0, 1], [0, 1, 1, 0]]])
    w = routing.RoutingWindow()
    first = w.doc(load1, coact1, 4, 2)
    assert first["fromStep"] == 0 and first["tokens"] == 4  # no publish yet: the whole run
    w.advance(load1, coact1, 4, 2)
    load2, coact2 = load1 * 3, coact1 * 3
    window = w.doc(load2, coact2, 12, 6)
    assert window["fromStep"] == 2 and window["toStep"] == 6 and window["steps"] == 4
    assert window["load"] == (load2 - load1).tolist()
    samples = [[[0, 1], [2, 3], [0, 3]]]
    doc = _doc(load2, coact2, 12, 6, window, samples, [1, 3, 6])
    whole, win = parse_routing_stats(doc), window_stats(doc)
    assert whole.tokens == 12 and win is not None and win.tokens == 8 and win.steps == 4
    assert win.token_experts is not None and win.token_experts.tolist() == [[[2, 3], [0, 3]]]
    assert window_stats(_doc(load2, coact2, 12, 6)) is None
    bad = json.loads(json.dumps(doc))
    bad["window"]["tokens"] = 5
    with pytest.raises(Exception, match="window"):
        window_stats(bad)


def test_window_stats_read_the_windows_own_samples():
    """A window with its own ``tokenSamples`` reads them (not the whole run's cut at
    ``fromStep``); their steps must lie in the window; without them the fallback reads on."""
    load1 = np.array([[2, 2, 2, 2]])
    coact1 = np.array([[[0, 1, 1, 0], [1, 0, 0, 1], [1, 0, 0, 1], [0, 1, 1, 0]]])
    w = routing.RoutingWindow()
    w.advance(load1, coact1, 4, 2)
    own = {"experts": [[[1, 2], [0, 3], [0, 1]]], "steps": [5, 3, 6]}
    window = w.doc(load1 * 3, coact1 * 3, 12, 6, own)
    doc = _doc(load1 * 3, coact1 * 3, 12, 6, window, [[[0, 1], [2, 3], [0, 3]]], [1, 3, 6])
    win = window_stats(doc)
    assert win is not None and win.token_experts is not None and win.token_steps is not None
    assert win.token_experts.tolist() == own["experts"] and win.token_steps.tolist() == [5, 3, 6]
    del doc["window"]["tokenSamples"]  # an older trainer: the whole run's, after fromStep
    old = window_stats(doc)
    assert old is not None and old.token_experts.tolist() == [[[2, 3], [0, 3]]]
    bad = json.loads(json.dumps(doc))
    bad["window"]["tokenSamples"] = dict(own, steps=[5, 2, 6])
    with pytest.raises(DocumentError, match=r"window\.tokenSamples\.steps\[1\]: 2 is outside"):
        window_stats(bad)
    bad["window"]["tokenSamples"] = {"experts": [[[1, 1]]], "steps": [5]}
    with pytest.raises(DocumentError, match=r"window\.tokenSamples\.experts.*repeats"):
        window_stats(bad)


def test_the_window_goes_first_when_the_configmap_is_too_small():
    rng = np.random.default_rng(0)
    L, E = 2, 16
    upper = np.triu(rng.integers(0, 10**6, size=(L, E, E)), 1)
    coact = upper + upper.transpose(0, 2, 1)
    coact[1] = coact[0]  # every layer routes the same number of tokens
    load = coact.sum(axis=2)  # top-2: a row sums to (k - 1) * load
    tokens = int(load[0].sum()) // 2
    doc = _doc(load, coact, tokens, 2)
    window = routing.RoutingWindow().doc(load, coact, tokens, 2)
    with_window = _doc(load, coact, tokens, 2, window)
    parse_routing_stats(with_window)
    limit = encode_configmap(doc, limit=10).stored_bytes  # what the whole-run counts take
    enc = encode_configmap(with_window, limit=limit)
    assert enc.body is not None
    stored = json.loads(configmap_text(enc.body) or "")
    assert "window" not in stored and stored["load"] == doc["load"]
    big = encode_configmap(with_window, limit=10**8)
    assert big.body is not None and "window" in json.loads(configmap_text(big.body) or "")


def test_refusal_names_other_zero_stages():
    from types import SimpleNamespace

    def engine(stage):
        return SimpleNamespace(zero_optimization_stage=lambda: stage)

    plain = SimpleNamespace(placement=SimpleNamespace(replicas=None))
    copies = SimpleNamespace(placement=SimpleNamespace(replicas=object()))
    assert replan.refusal(plain, engine(3)) is None
    assert replan.refusal(SimpleNamespace(placement=None), engine(3)) is None
    assert replan.refusal(copies, engine(3)) is None  # copies move with their experts
    assert "stage 2" in (replan.refusal(plain, engine(2)) or "")


def test_an_unexpected_failure_on_rank_0_still_reaches_the_broadcast(update_file, monkeypatch):
    """The other ranks wait in the broadcast: rank 0 must get there whatever reading did."""
    from types import SimpleNamespace

    sent = []
    monkeypatch.setattr(replan.dist, "broadcast_object_list", lambda box, src: sent.append(box))
    r = replan.Replanner(2, 4, None, router_name="gate")

    def boom(serves_copies):
        raise RuntimeError("surprise")

    monkeypatch.setattr(r, "decide", boom)
    assert r.at_checkpoint(SimpleNamespace(is_rank0=True, dispatcher="dedup"), 4) is False
    assert sent == [[None]] and "surprise" in r.message


def test_copies_the_dispatcher_cannot_lay_out_are_refused_before_anything_moves(
    update_file, monkeypatch
):
    """Rank 0 checks the update's layouts before the broadcast: a refusal moves no expert (moving
    them and then failing would fail again at every restart from the checkpoint before)."""
    from types import SimpleNamespace

    from moe_trainer.dispatch import dedup_ep, dedup_replicas

    sent = []
    monkeypatch.setattr(replan.dist, "broadcast_object_list", lambda box, src: sent.append(box))

    def no_apply(*a, **k):
        raise AssertionError("experts moved")

    monkeypatch.setattr(replace, "apply", no_apply)
    seen = []

    def relayouts(blocks, replicas, permutation):
        seen.append((replicas, permutation))
        raise dedup_ep.DispatchError("copies run AutoEP's GroupedExperts, this layer has X")

    monkeypatch.setattr(dedup_replicas, "relayouts", relayouts)
    plan = SimpleNamespace(ep_size=2, placement=SimpleNamespace(replicas=None))
    r = replan.Replanner(2, 4, None, router_name="gate", plan=plan)
    update_file.write_text(
        PU.dumps(PU.PlacementUpdate(generation=1, permutation=NEW, replicas=_copies(NEW)))
    )
    trainer = SimpleNamespace(is_rank0=True, dispatcher="dedup", blocks=[])
    assert r.at_checkpoint(trainer, 4) is False
    assert sent == [[None]] and seen and seen[0][1] == NEW
    assert "generation 1 refused" in r.message and "GroupedExperts" in r.message
    assert r.generation == 0
