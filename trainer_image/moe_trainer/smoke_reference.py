"""The smoke run's numeric reference: the first optimizer step in plain PyTorch, no DeepSpeed.

The trainer's first step under ZeRO-3 + AutoEP (gradient accumulation, data- and
expert-data-parallel reduction, clipping, AdamW, the LR warmup) must move every parameter the way
the same math does on one process: the model built from the plan (same seed, same placement
permutation), every rank's micro-batches of step 0, loss = LM cross-entropy + coef x the per-layer
balancing loss (the trainer's own `routing.balance_loss` on the Hugging Face routers), the mean
over ranks and micro-steps, gradient clipping, and one step of the trainer's optimizer.

Compared per parameter *group* (router, experts, shared_experts, attention, embeddings, norms,
dense_mlp), on each rank's own view (AutoEP: the rank's local experts): the gradient at the
accumulation boundary (before clipping) and the update. A group whose update is zero ("does not
move"), has the wrong size or points elsewhere ("moves wrongly") fails and is named.

Why gradients as well as updates: Adam's first update is g / (|g| + eps), close to sign(g), so it
cannot see a gradient that is, say, twice too large (a wrong expert-data-parallel average).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUPS = ("router", "experts", "shared_experts", "attention", "embeddings", "norms", "dense_mlp")

# Tolerances: relative size |a|/|b| - 1 and cosine 1 - cos(a, b), per group.
# fp32 (CPU): reduction order only. bf16/fp16 (GPU): 16-bit activations flip near-tied top-k
# choices of a few tokens (each expert sees ~16 tokens here) and the sign of tiny gradients, whose
# Adam update is then +-lr instead of -+lr; still far from what a broken group gives (size 0 or
# x2, cosine near 0).
TOLERANCE = {
    "fp32": {"grad_ratio": 1e-3, "grad_cos": 1e-5, "update_ratio": 1e-3, "update_cos": 1e-4},
    "half": {"grad_ratio": 0.2, "grad_cos": 0.1, "update_ratio": 0.25, "update_cos": 0.3},
}


def group_of(name: str) -> str:
    """Parameter name (HF or AutoEP layout) -> group."""
    if ".mlp.router." in name or re.search(r"\.mlp\.gate\.", name):
        return "router"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.experts." in name:
        return "experts"
    if "self_attn." in name and "norm" not in name:
        return "attention"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings"
    if "norm" in name:
        return "norms"
    if ".mlp." in name:
        return "dense_mlp"
    raise ValueError(f"parameter {name!r} belongs to no group")


@dataclass(frozen=True)
class ExpertSlice:
    """Where an AutoEP expert tensor's rows come from in the HF layout."""

    ep_rank: int
    n_local: int
    ffn: int


def hf_view(
    name: str, ref: dict[str, torch.Tensor], experts: dict[str, ExpertSlice]
) -> torch.Tensor:
    """The reference tensor matching the engine's parameter ``name`` (this rank's view).

    AutoEP renames `mlp.gate` -> `mlp.router.gate` and repacks `experts.gate_up_proj[E, 2F, H]`
    into `w1` (gate) and `w3` (up) `[E_local, F, H]`, `down_proj[E, H, F]` into `w2`, local experts
    = slots ep_rank * E_local ... (DeepSpeed places slots contiguously)."""
    if ".mlp.router.gate." in name:
        return ref[name.replace(".mlp.router.gate.", ".mlp.gate.")]
    m = re.match(r"(.*\.mlp\.experts)\.(w1|w2|w3)$", name)
    if m:
        s = experts[m.group(1)]
        rows = slice(s.ep_rank * s.n_local, (s.ep_rank + 1) * s.n_local)
        if m.group(2) == "w2":
            return ref[f"{m.group(1)}.down_proj"][rows]
        gate_up = ref[f"{m.group(1)}.gate_up_proj"][rows]
        return gate_up[:, : s.ffn] if m.group(2) == "w1" else gate_up[:, s.ffn :]
    return ref[name]


def reference_step(
    model,
    batches: list[torch.Tensor],
    *,
    num_experts: int,
    balance_mode: str,
    balance_coef: float,
    grad_clip: float,
    make_optimizer,
    make_scheduler,
):
    """One optimizer step of ``model`` (HF blocks, placement applied) on ``batches`` (every rank's
    micro-batches of step 0, each [micro, seq + 1]). Returns (grads, updates), name -> tensor."""
    from moe_trainer import models, routing

    model.train()
    blocks = [r.block for r in models.find_moe_layers(model)]
    probe = routing.RouterProbe(blocks)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    for batch in batches:
        probe.clear()
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        aux = routing.balance_loss(probe, num_experts, balance_mode)
        if aux is not None and balance_coef:
            loss = loss + balance_coef * aux
        (loss / len(batches)).backward()
    probe.remove()
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in params.items()
    }
    if grad_clip and grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(
            [p for p in params.values() if p.grad is not None], grad_clip
        )
    opt = make_optimizer([p for p in params.values() if p.requires_grad])
    sched = make_scheduler(opt)
    opt.step()
    sched.step()
    updates = {n: params[n].detach() - before[n] for n in params}
    return grads, updates


def _compare(ours: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(|ours| / |want|, cos(ours, want)) of two flat float64 vectors."""
    a, b = ours.double(), want.double()
    na, nb = float(a.norm()), float(b.norm())
    ratio = na / nb if nb > 0 else (math.inf if na > 0 else 1.0)
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb == 0 else 0.0)
    return ratio, cos


def compare_groups(
    ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: dict[str, float], what: str
) -> tuple[list[dict], list[str]]:
    """Per group: size ratio and cosine of ``ours`` vs ``want`` (same names, same shapes).
    Returns (rows, problems); a problem names the group and what is wrong with it."""
    by_group: dict[str, tuple[list, list]] = {}
    for name, w in want.items():
        o = ours[name]
        if tuple(o.shape) != tuple(w.shape):
            raise ValueError(f"{name}: engine shape {tuple(o.shape)} != reference {tuple(w.shape)}")
        g = by_group.setdefault(group_of(name), ([], []))
        g[0].append(o.float().flatten().cpu())
        g[1].append(w.float().flatten().cpu())
    rows, problems = [], []
    for group in GROUPS:
        if group not in by_group:
            continue
        o, w = torch.cat(by_group[group][0]), torch.cat(by_group[group][1])
        ratio, cos = _compare(o, w)
        rows.append({"group": group, "ratio": ratio, "cos": cos, "norm": float(w.norm())})
        if float(w.norm()) == 0:
            continue
        if float(o.norm()) == 0:
            problems.append(
                f"{group}: {what} is zero (the reference's norm is {float(w.norm()):.3g}): "
                "the group does not move"
            )
        elif abs(ratio - 1) > tol[f"{what}_ratio"] or 1 - cos > tol[f"{what}_cos"]:
            problems.append(
                f"{group}: {what} differs from the reference: size x{ratio:.4g}, cosine {cos:.6f} "
                f"(tolerance: size within {tol[f'{what}_ratio']:g}, cosine >= "
                f"{1 - tol[f'{what}_cos']:g})"
            )
    return rows, problems
