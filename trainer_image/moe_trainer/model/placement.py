"""Check, after `deepspeed.initialize`, that every rank holds the experts the plan put there.

Enabled with MOE_VERIFY_PLACEMENT=1 (it gathers each layer's expert weights once, so it is meant
for tests and first runs of a new placement, not for every start of a large model).

AutoEP layers keep `experts.w1/w3/w2[E_local, ...]` (gate, up, down) for EP rank `ep_rank`;
local expert j must equal original expert `permutation[l][ep_rank * E_local + j]` of the model
as built from the plan, before the permutation: HF `gate_up_proj[e] = [gate; up]`, `down_proj[e]`.
Without AutoEP, ZeRO-3 keeps all experts (sharded as ordinary parameters): slot s must hold
original expert permutation[l][s].
"""

from __future__ import annotations

import torch


def _same(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    """Compare in the dtype the engine holds (bf16 on GPUs): the original is cast the same way."""
    return torch.allclose(a.float(), b.to(a.dtype).float(), atol=atol, rtol=0)


def verify_placement(
    blocks, permutation, originals: list[dict[str, torch.Tensor]], rank: int, atol: float = 0.0
) -> dict:
    """blocks: the MoE blocks after initialize; originals[l][name][E, ...] from before the
    permutation.
    Returns {"rank", "ok", "layers": [{"layer", "epRank", "experts", "ok"}]}."""
    import deepspeed

    layers = []
    for layer, block in enumerate(blocks):
        experts = block.experts
        params = list(experts.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            orig = originals[layer]
            if hasattr(experts, "w1") and hasattr(block, "ep_rank"):  # AutoEP GroupedExperts
                ep_rank = int(block.ep_rank)
                n_local = experts.w1.shape[0]
                want = list(permutation[layer][ep_rank * n_local : (ep_rank + 1) * n_local])
                ffn = experts.w1.shape[1]
                ok = all(
                    _same(experts.w1[j], orig["gate_up_proj"][e][:ffn], atol)
                    and _same(experts.w3[j], orig["gate_up_proj"][e][ffn:], atol)
                    and _same(experts.w2[j], orig["down_proj"][e], atol)
                    for j, e in enumerate(want)
                )
            else:  # HF experts, all slots
                ep_rank = 0
                want = list(permutation[layer])
                ok = all(
                    _same(getattr(experts, name)[s], orig[name][e], atol)
                    for name in orig
                    for s, e in enumerate(want)
                )
        layers.append(
            {"layer": layer, "epRank": ep_rank, "experts": [int(e) for e in want], "ok": bool(ok)}
        )
    return {"rank": rank, "ok": all(x["ok"] for x in layers), "layers": layers}


def check_placement(blocks, permutation, originals, rank: int, ckpt_dir: str | None) -> None:
    """MOE_VERIFY_PLACEMENT=1: verify, write ``placement_check_rank<r>.json``, fail on a
    mismatch."""
    import logging
    from pathlib import Path

    from moe_trainer.telemetry.progress import write_json_atomic

    report = verify_placement(blocks, permutation, originals, rank)
    if ckpt_dir:
        write_json_atomic(Path(ckpt_dir) / f"placement_check_rank{rank}.json", report)
    if not report["ok"]:
        raise RuntimeError(f"rank {rank} does not hold the experts the plan says: {report}")
    logging.getLogger("moe_trainer").info(
        "rank %d placement verified: %s",
        rank,
        [(x["layer"], x["experts"]) for x in report["layers"]],
    )
