"""One rank of the DedupEP exactness check (tests/test_dedup_ep.py starts P of these).

Builds a tiny Mixtral MoE block, replaces it with AutoEP (EP = world size) on every rank with
the expert weights permuted by a random ``perm`` (slot s holds expert perm[s]; the router is
not permuted, so the layout table, not ``e // E_local``, says where expert e lives), swaps it to
the dedup dispatcher, runs forward + backward on this rank's tokens and compares with one
AutoEP layer at EP = 1 holding all experts that runs every rank's tokens in one process:
outputs, input gradients, router gradients (summed over ranks) and each local expert's
gradients. Writes [{"maxErr": {...}, "scale", "bytes": {...}}, ...] (one per case) to
$OUT/rank<r>.json.

env: CASES = JSON list of {experts, topk, scoreApply, groups (EP rank -> group id), deadRanks
(EP ranks whose experts are never chosen), tokens, seed, checkpoint (run the layer under
non-reentrant activation checkpointing), copies ([[expert, EP rank], ...]: extra copies of
router experts, a home rank or a repeat ignored; tokens go to a copy on their own rank, else in
their group, else the last holder)}. Each result also has the rank's router choices
(``selected``), the layout's ``holders``/``serve`` and the replica weight-sync bytes.
"""

from __future__ import annotations

import copy
import json
import os
import sys


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    results = [run_case(case) for case in json.loads(os.environ["CASES"])]
    with open(os.path.join(os.environ["OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()


def run_case(case: dict) -> dict:
    import deepspeed.comm as dscomm
    import torch.distributed as dist
    import torch.utils.checkpoint
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from transformers import MixtralConfig, MixtralForCausalLM

    from moe_trainer.dispatch import dedup_ep

    rank, P = dist.get_rank(), dist.get_world_size()
    E, K, H = case["experts"], case["topk"], 32
    torch.manual_seed(case["seed"])
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=E,
        num_experts_per_tok=K,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    model = MixtralForCausalLM(cfg).float()
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(case["seed"] + 1))
    ep_cfg = {
        "enabled": True,
        "preset_model": "mixtral",
        "score_apply": case["scoreApply"],
        "use_grouped_mm": False,
    }

    def autoep_layer(src_model, ep_size, ep_rank, permute):
        m = copy.deepcopy(src_model)
        block = m.model.layers[0].mlp
        if permute:
            with torch.no_grad():
                for name in ("gate_up_proj", "down_proj"):
                    getattr(block.experts, name).copy_(getattr(block.experts, name)[perm])
        ae = AutoEP(m, parse_autoep_config({**ep_cfg, "autoep_size": ep_size}))
        ae.replace_moe_layers(ae.ep_parser(), ep_size=ep_size, ep_rank=ep_rank)
        return m.model.layers[0].mlp

    ref = autoep_layer(model, 1, 0, permute=False)
    layer = autoep_layer(model, P, rank, permute=True)
    layer.ep_group = dscomm.new_group(list(range(P)))
    n = E // P
    slot_of = torch.empty(E, dtype=torch.long)
    slot_of[perm] = torch.arange(E)
    groups = case["groups"]
    group_ranks = [tuple(r for r in range(P) if groups[r] == g) for g in sorted(set(groups))]
    layout = dedup_ep.Layout(
        tuple(int(s) // n for s in slot_of),
        tuple(int(s) % n for s in slot_of),
        tuple(group_ranks),
        tuple(groups),
        tuple(groups),
    )
    if case.get("copies"):
        layout = with_copies(layout, case["copies"], groups)
    dedup_ep.install([layer], [layout])
    assert type(layer).__name__ == "DedupEPMoELayer"
    if case["deadRanks"]:
        bias = torch.zeros(E)
        for r in case["deadRanks"]:
            bias[perm[r * n : (r + 1) * n]] = -1e4  # never selected (selection only, not weights)
        layer.expert_bias, ref.expert_bias = bias, bias.clone()

    T = case["tokens"]
    x_all = torch.randn(P, 1, T, H, generator=torch.Generator().manual_seed(case["seed"] + 2))
    x = x_all[rank].clone().requires_grad_(True)
    if case.get("checkpoint"):
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    else:
        out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    g_all = torch.randn(P, 1, T, H, generator=torch.Generator().manual_seed(case["seed"] + 3))
    (out * g_all[rank]).sum().backward()
    moved = dedup_ep.counters.take()
    from moe_trainer.dispatch import dedup_replicas

    synced = dedup_replicas.sync_counters.take()
    with torch.no_grad():
        selected = layer.router(x.detach().reshape(-1, H), layer.expert_bias)[1]

    xr = x_all.reshape(1, P * T, H).clone().requires_grad_(True)
    out_ref = ref(xr)
    out_ref = out_ref[0] if isinstance(out_ref, tuple) else out_ref
    (out_ref * g_all.reshape(1, P * T, H)).sum().backward()

    router_grad = layer.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)
    err = {
        "output": (out - out_ref.reshape(P, 1, T, H)[rank]).abs().max().item(),
        "inputGrad": (x.grad - xr.grad.reshape(P, 1, T, H)[rank]).abs().max().item(),
        "routerGrad": (router_grad - ref.router.gate.weight.grad).abs().max().item(),
    }
    mine = [int(e) for e in perm[rank * n : (rank + 1) * n]]
    for name in ("w1", "w2", "w3"):
        got = getattr(layer.experts, name).grad
        want = getattr(ref.experts, name).grad[mine]
        err[name + "Grad"] = (got - want).abs().max().item()
    scale = {
        "output": out_ref.abs().max().item(),
        "inputGrad": xr.grad.abs().max().item(),
        "routerGrad": ref.router.gate.weight.grad.abs().max().item(),
    }
    for name in ("w1", "w2", "w3"):
        scale[name + "Grad"] = getattr(ref.experts, name).grad.abs().max().item()
    received = int(sum(getattr(layer.experts, w).grad.abs().sum().item() > 0 for w in ("w1",)))
    return {
        "rank": rank,
        "maxErr": err,
        "scale": scale,
        "bytes": moved,
        "syncBytes": synced,
        "expertsUsed": received,
        "selected": selected.tolist(),
        "home": list(layout.expert2rank),
        "holders": [list(h) for h in layout.holders] if layout.holders else None,
        "serve": [list(r) for r in layout.serve] if layout.serve else None,
    }


def with_copies(layout, copies, groups):
    import dataclasses

    E, P = len(layout.expert2rank), len(groups)
    holders = [[r] for r in layout.expert2rank]
    for e, r in copies:
        if r not in holders[e]:
            holders[e].append(r)

    def serve(p, e):
        hs = holders[e]
        same = [r for r in hs if groups[r] == groups[p]]
        return p if p in hs else (same[0] if same else hs[-1])

    return dataclasses.replace(
        layout,
        holders=tuple(tuple(h) for h in holders),
        serve=tuple(tuple(serve(p, e) for e in range(E)) for p in range(P)),
    )


if __name__ == "__main__":
    sys.exit(main())
