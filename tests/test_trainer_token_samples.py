"""The trainer's token sample: the bottom-k keys of everything routed, across micro steps, resumes
and ranks (merged over gloo), reported in original expert ids; too-large documents publish a cut."""

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_contracts.routing import decode_configmap, parse_routing_stats, routing_stats_doc
from moe_contracts.routing import encode_configmap as encode
from moe_trainer.telemetry.routing import RoutingWindow
from moe_trainer.telemetry.token_samples import TokenSampler, to_original_ids

L, K, E = 3, 2, 8


def _topk(step, micro, rank, T=50):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return [torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K] for _ in range(L)]


def _feed(sampler, rank, steps=6, micros=2):
    for step in range(1, steps + 1):
        for micro in range(micros):
            sampler.add(_topk(step, micro, rank), step, micro)


def _all_tokens(ranks, steps=6, micros=2):
    """keys, experts[N, L, k], steps of every routed token, drawn like TokenSampler draws them."""
    keys, ex, st = [], [], []
    for rank in ranks:
        for step in range(1, steps + 1):
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
    doc = Trainer.routing_doc(fake, merged)
    order = torch.argsort(keys)[:64]
    assert doc["tokenSamples"]["steps"] == steps[order].tolist()
    for layer in range(L):
        want = torch.sort(ex[order][:, layer], dim=-1).values.tolist()
        assert doc["tokenSamples"]["experts"][layer] == want


def _worker(rank, world, port, out):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    s = TokenSampler(L, K, 40, 7, rank, world)
    _feed(s, rank)
    merged = s.merge("cpu")
    again = s.merge("cpu")  # holdings after a merge are disjoint shares: same result
    if rank == 0:
        torch.save({"first": merged, "again": again}, out)
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
