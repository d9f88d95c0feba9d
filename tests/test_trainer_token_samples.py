"""The trainer's token sample: the bottom-k keys of everything routed, across micro steps, resumes
and ranks (merged over gloo), reported in original expert ids; too-large documents publish a cut.
The window's own sample: the bottom-k keys of the tokens routed since the previous publish."""

import json
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_contracts.routing import (
    configmap_text,
    decode_configmap,
    parse_routing_stats,
    routing_stats_doc,
    window_stats,
)
from moe_contracts.routing import encode_configmap as encode
from moe_trainer.telemetry.routing import RoutingWindow
from moe_trainer.telemetry.token_samples import TokenSampler, to_original_ids

L, K, E = 3, 2, 8


def _topk(step, micro, rank, T=50):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return [torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K] for _ in range(L)]


def _feed(sampler, rank, steps=6, micros=2, first=1):
    for step in range(first, steps + 1):
        for micro in range(micros):
            sampler.add(_topk(step, micro, rank), step, micro)


def _all_tokens(ranks, steps=6, micros=2, first=1):
    """keys, experts[N, L, k], steps of every routed token, drawn like TokenSampler draws them."""
    keys, ex, st = [], [], []
    for rank in ranks:
        for step in range(first, steps + 1):
            for micro in range(micros):
                s = TokenSampler(L, K, 1, 7, rank, 1)
                g = torch.Generator().manual_seed(
                    hash((s.seed, rank, step, micro)) & 0x7FFF_FFFF_FFFF_FFFF
                )
                tk = _topk(step, micro, rank)
                keys.append(torch.rand(tk[0].shape[0], generator=g, dtype=torch.float64))
                ex.append(torch.stack(tk, 1))
                st.append(torch.full((tk[0].shape[0],), step))
    return torch.cat(keys), torch.cat(ex), torch.cat(st)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (host copy without a sync)")
def test_cuda_expert_ids_reach_the_sample_without_a_host_sync():
    """On CUDA the ids go to pinned memory behind an event and are folded in later: same sample."""
    cpu, gpu = TokenSampler(L, K, 64, 7, 0, 1), TokenSampler(L, K, 64, 7, 0, 1)
    for step in range(1, 7):
        for micro in range(2):
            tk = _topk(step, micro, 0)
            cpu.add(tk, step, micro)
            on_gpu = [t.cuda() for t in tk]
            torch.cuda.set_sync_debug_mode("error")  # any synchronising call in add() raises
            try:
                gpu.add(on_gpu, step, micro)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    a, b = cpu.merge("cpu"), gpu.merge("cuda")
    assert all(torch.equal(a[key], b[key]) for key in ("keys", "experts", "steps"))
    assert len(gpu) == 64


def test_a_full_pool_holds_at_most_twice_its_capacity_and_stays_exact():
    """Candidates wait beside the holding until they are as many as it, then one selection folds
    them in: the holding never exceeds twice the capacity, and every read is the exact bottom-k
    (a step's tokens all go to a window pool just emptied)."""
    s = TokenSampler(L, K, 64, 7, 0, 1)
    seen = []
    for step in range(1, 7):
        for micro in range(2):
            s.add(_topk(step, micro, 0), step, micro)
            for pool in (s, s.window):
                assert pool is not None and len(pool.keys) + pool._chunked <= 2 * 64
            seen.append(s._thr)
        if step == 3:
            s.take_window("cpu")
    assert seen[-1] <= seen[len(seen) // 2] < float("inf")  # the bound only falls
    keys, _, _ = _all_tokens([0])
    assert torch.equal(s.merge("cpu")["keys"], torch.sort(keys).values[:64])


def test_single_rank_keeps_the_smallest_keys_and_survives_resume():
    s = TokenSampler(L, K, 64, 7, 0, 1)
    _feed(s, 0)
    keys, ex, steps = _all_tokens([0])
    order = torch.argsort(keys)[:64]
    merged = s.merge("cpu")
    assert torch.equal(merged["keys"], keys[order])
    assert torch.equal(merged["experts"].long(), ex[order]) and torch.equal(
        merged["steps"].long(), steps[order]
    )
    # resume half way from the saved state: the same final sample
    r = TokenSampler(L, K, 64, 7, 0, 1)
    for step in range(1, 4):
        for micro in range(2):
            r.add(_topk(step, micro, 0), step, micro)
    resumed = TokenSampler(L, K, 64, 7, 0, 1)
    resumed.load_state_dict(r.state_dict(r.merge("cpu")))
    for step in range(4, 7):
        for micro in range(2):
            resumed.add(_topk(step, micro, 0), step, micro)
    assert torch.equal(resumed.merge("cpu")["keys"], merged["keys"])


def test_original_ids_and_document():
    ex = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=torch.int16)  # [S=2, L=2, k=2]
    perm = [[7, 6, 5, 4, 3, 2, 1, 0], list(range(8))]
    assert to_original_ids(ex, perm) == [[[6, 7], [2, 3]], [[2, 3], [6, 7]]]
    load = np.array([[1, 1, 0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0]] * 1)
    co = np.zeros((2, 8, 8), dtype=np.int64)
    for layer, toks in enumerate(([[6, 7], [0, 1]], [[4, 5], [2, 3]])):
        for a, b in toks:
            co[layer, a, b] = co[layer, b, a] = 1
    doc = routing_stats_doc(load, co, 2, 1, 2, "m", samples=[[[6, 7], [0, 1]], [[4, 5], [2, 3]]])
    parse_routing_stats(doc)
    assert doc["version"] == 2 and doc["tokenSamples"]["experts"][0] == [[6, 7], [0, 1]]
    assert "steps" not in doc["tokenSamples"]
    doc = routing_stats_doc(
        load, co, 2, 1, 2, "m", samples=[[[6, 7], [0, 1]], [[4, 5], [2, 3]]], sample_steps=[5, 3]
    )
    assert parse_routing_stats(doc).token_steps.tolist() == [5, 3]


def test_trainer_document_carries_the_step_of_each_sampled_token():
    """``Trainer.routing_doc`` on a merged sample: ``tokenSamples.steps[s]`` is the step token s
    was routed at, in the order of ``tokenSamples.experts[l]`` (whole tokens are sampled, so
    one order serves every layer)."""
    from types import SimpleNamespace

    from moe_trainer.trainer import Trainer

    s = TokenSampler(L, K, 64, 7, 0, 1)
    _feed(s, 0)
    merged = s.merge("cpu")
    keys, ex, steps = _all_tokens([0])
    acc = SimpleNamespace(load=torch.zeros(L, E), coact=torch.zeros(L, E, E), tokens=0, steps=6)
    fake = SimpleNamespace(acc=acc, permutation=[list(range(E))] * L, top_k=K, model_name="m")
    fake.window = RoutingWindow()
    doc = Trainer.routing_doc(fake, merged, s.take_window("cpu"))
    order = torch.argsort(keys)[:64]
    assert doc["tokenSamples"]["steps"] == steps[order].tolist()
    for layer in range(L):
        want = torch.sort(ex[order][:, layer], dim=-1).values.tolist()
        assert doc["tokenSamples"]["experts"][layer] == want
    # the first window is the whole run: its own sample is the same bottom-k
    assert doc["window"]["tokenSamples"] == doc["tokenSamples"]
    assert Trainer.routing_doc(fake, merged)["window"].get("tokenSamples") is None


def test_the_window_keeps_its_own_bottom_k_since_the_last_publish():
    """After a publish at step 3, the window pool is the bottom-``capacity`` keys of the tokens of
    steps 4..6 exactly (the whole-run pool keeps its own); a window with fewer tokens than the
    capacity keeps them all; publishing empties it."""
    s = TokenSampler(L, K, 64, 7, 0, 1)
    _feed(s, 0, steps=3)
    first = s.take_window("cpu")
    keys, ex, steps = _all_tokens([0], steps=3)
    assert torch.equal(first["keys"], keys[torch.argsort(keys)[:64]])
    _feed(s, 0, steps=6, first=4)
    keys, ex, steps = _all_tokens([0], steps=6, first=4)
    order = torch.argsort(keys)[:64]
    got = s.take_window("cpu")
    assert torch.equal(got["keys"], keys[order]) and torch.equal(got["steps"].long(), steps[order])
    assert torch.equal(got["experts"].long(), ex[order])
    whole_keys, _, _ = _all_tokens([0])
    assert torch.equal(s.merge("cpu")["keys"], whole_keys[torch.argsort(whole_keys)[:64]])
    assert len(s.take_window("cpu")["keys"]) == 0  # nothing routed since
    big = TokenSampler(L, K, 150, 7, 0, 1)
    _feed(big, 0, steps=5)
    big.take_window("cpu")
    _feed(big, 0, steps=6, first=6)  # 100 tokens < capacity
    got = big.take_window("cpu")
    assert len(got["keys"]) == 100 and set(got["steps"].tolist()) == {6}


def test_a_late_window_is_a_full_uniform_sample():
    """Late in a long run the window still holds ``capacity`` tokens, spread evenly over its steps
    (keys are seeded: the counts are the same on every run), where the tokens of the whole-run
    sample routed in the window are about ``capacity x window / run``."""
    s = TokenSampler(L, K, 200, 7, 0, 1)
    _feed(s, 0, steps=30)
    s.take_window("cpu")
    _feed(s, 0, steps=40, first=31)  # 10 steps x 100 tokens
    whole = s.merge("cpu")
    window = s.take_window("cpu")
    per_step = torch.bincount(window["steps"].long() - 31, minlength=10)
    assert len(window["keys"]) == 200 and set(window["steps"].tolist()) <= set(range(31, 41))
    assert per_step.min() >= 5 and per_step.max() <= 45, per_step  # 20 expected per step
    assert int((whole["steps"] > 30).sum()) < 80  # about 50


def test_relabel_and_resume_keep_the_window():
    """A re-placement relabels the window pool too; a resume from a checkpoint (a publish just
    happened, the window pool is empty) continues with the same window sample as a straight run."""
    s, moved = TokenSampler(L, K, 64, 7, 0, 1), TokenSampler(L, K, 64, 7, 0, 1)
    _feed(s, 0, steps=3)
    _feed(moved, 0, steps=3)
    new_slot_of = [[(x + layer + 1) % E for x in range(E)] for layer in range(L)]
    moved.relabel(new_slot_of)
    a, b = s.take_window("cpu"), moved.take_window("cpu")
    m = torch.as_tensor(new_slot_of)
    want = torch.stack([m[layer][a["experts"][:, layer].long()] for layer in range(L)], 1)
    assert len(a["keys"]) == 64 and torch.equal(b["experts"].long(), want)
    state = s.state_dict(s.merge("cpu"))
    _feed(s, 0, steps=6, first=4)
    resumed = TokenSampler(L, K, 64, 7, 0, 1)
    resumed.load_state_dict(state)
    _feed(resumed, 0, steps=6, first=4)
    x, y = s.take_window("cpu"), resumed.take_window("cpu")
    assert all(torch.equal(x[key], y[key]) for key in ("keys", "experts", "steps"))


def _worker(rank, world, port, out):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    s = TokenSampler(L, K, 40, 7, rank, world)
    _feed(s, rank, steps=3)
    first_window = s.take_window("cpu")
    _feed(s, rank, steps=6, first=4)
    merged = s.merge("cpu")
    again = s.merge("cpu")  # holdings after a merge are disjoint shares: same result
    window = s.take_window("cpu")
    if rank == 0:
        torch.save({"first": merged, "again": again, "windows": [first_window, window]}, out)
    dist.destroy_process_group()


def test_merge_over_two_gloo_ranks_is_the_global_bottom_k(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "merged.pt"
    mp.spawn(_worker, args=(2, port, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    keys, ex, _ = _all_tokens([0, 1])
    order = torch.argsort(keys)[:40]
    for m in (got["first"], got["again"]):
        assert torch.equal(m["keys"], keys[order]) and torch.equal(m["experts"].long(), ex[order])
    for window, first in zip(got["windows"], (1, 4), strict=True):  # steps 1..3, then 4..6
        keys, ex, st = _all_tokens([0, 1], steps=first + 2, first=first)
        order = torch.argsort(keys)[:40]
        assert torch.equal(window["keys"], keys[order])
        assert torch.equal(window["experts"].long(), ex[order])
        assert torch.equal(window["steps"].long(), st[order])


def test_too_large_document_publishes_a_cut_sample():
    rng = np.random.default_rng(0)
    te = np.sort(np.stack([rng.choice(E, K, replace=False) for _ in range(2000)]), 1)
    load = np.stack([np.bincount(te.ravel(), minlength=E)] * 1)
    co = np.zeros((1, E, E), dtype=np.int64)
    for a, b in te:
        co[0, a, b] += 1
        co[0, b, a] += 1
    steps = (np.arange(2000) * 7919 % 300 + 1).tolist()  # the key order mixes the steps
    doc = routing_stats_doc(load, co, 2000, 1, K, "m", samples=[te.tolist()], sample_steps=steps)
    full = encode(doc, limit=10**9)
    assert full.samples == 2000
    enc = encode(doc, limit=2000)
    assert enc.key is not None and 0 < enc.samples < 2000
    sent = decode_configmap(enc.body)
    assert sent.token_experts[0].tolist() == te.tolist()[: enc.samples]
    assert sent.token_steps.tolist() == steps[: enc.samples]  # cut with the experts: aligned


def test_too_large_document_cuts_both_samples_and_still_decodes():
    """The whole run's and the window's samples are both cut (the larger first), each a prefix
    with its steps aligned; the window reads its own cut sample."""
    rng = np.random.default_rng(0)
    te = np.sort(np.stack([rng.choice(E, K, replace=False) for _ in range(2000)]), 1)
    load = np.stack([np.bincount(te.ravel(), minlength=E)])
    co = np.zeros((1, E, E), dtype=np.int64)
    for a, b in te:
        co[0, a, b] += 1
        co[0, b, a] += 1
    steps = (np.arange(2000) * 7919 % 300 + 1).tolist()
    wte, wsteps = te[::-2][:1000].tolist(), steps[::-2][:1000]  # another order, another sample
    window = RoutingWindow().doc(load, co, 2000, 300, {"experts": [wte], "steps": wsteps})
    doc = routing_stats_doc(
        load, co, 2000, 300, K, "m", samples=[te.tolist()], sample_steps=steps, window=window
    )
    full = encode(doc, limit=10**9)
    assert (full.samples, full.window_samples) == (2000, 1000)
    enc = encode(doc, limit=3000)
    assert enc.key is not None and 0 < enc.samples < 2000 and 0 < enc.window_samples < 1000
    assert max(enc.samples, enc.window_samples) <= 2 * min(enc.samples, enc.window_samples)
    sent = decode_configmap(enc.body)
    assert sent.token_experts[0].tolist() == te.tolist()[: enc.samples]
    assert sent.token_steps.tolist() == steps[: enc.samples]
    win = window_stats(json.loads(configmap_text(enc.body) or ""))
    assert win is not None and win.token_experts[0].tolist() == wte[: enc.window_samples]
    assert win.token_steps.tolist() == wsteps[: enc.window_samples]
