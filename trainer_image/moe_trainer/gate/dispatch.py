"""The smoke run's ``dispatch`` check: the bytes the expert all-to-alls really sent, per tier,
against the plan's byte model for the tokens those steps routed.

A dispatcher that silently stops de-duplicating (or falls back to AutoEP's all-to-all) computes
the same numbers and passes every numeric check; only its bytes change. So each compared step
records what every all-to-all sent (the trainer's ``CommTimer``, per tier of the receiver; the
dedup dispatcher's own counters besides) and which experts every token chose (:class:`TokenLog`),
and :func:`moe_contracts.dispatch.tier_bytes` (the model ``core.dispatch`` predicts a plan's
``placement.quality.dispatch`` with) says what the plan's dispatcher must send for exactly those
tokens, one forward per micro-step and one more where activation checkpointing recomputes it:
equal, byte for byte, summed over ranks.

The tokens' experts (slot ids) are also compared with the plain model's routing under the plan's
permutation: a placement that was not applied routes the same tokens to other slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_contracts.dispatch import DISPATCHERS, TIERS, tier_bytes


class TokenLog:
    """The experts each micro-step's tokens chose, per MoE layer (slot ids ``[T, K]``), as the
    trainer's own router probe saw them: read where ``Trainer.train_step`` hands them to its token
    sampler, once per micro-step, before backward. (No hooks of its own: a hook added after
    ``torch.compile`` would recompile the decoder layers.)"""

    def __init__(self, trainer):
        self.trainer, self.events = trainer, []
        self.inner = trainer.samples.add
        trainer.samples.add = self.add

    def add(self, topk, step, micro):
        self.events.append([t.detach().to("cpu", torch.long).clone() for t in topk])
        return self.inner(topk, step, micro)

    def take(self) -> list[list[torch.Tensor]]:
        out, self.events = self.events, []
        return out

    def remove(self) -> None:
        self.trainer.samples.add = self.inner


@dataclass
class StepBytes:
    """One step: bytes sent (summed over ranks) by tier, as the wire counter saw them
    (``measured``), as the dedup dispatcher counted them (``dedup_counted``) and as the byte
    model predicts for each dispatcher (``predicted[dispatcher][tier]``)."""

    measured: dict[str, int]
    dedup_counted: dict[str, int]
    predicted: dict[str, dict[str, float]]


def predict(
    tokens: list[list[list[torch.Tensor]]],
    *,
    num_experts: int,
    ep_size: int,
    rank_group: list[int],
    rank_node: list[int],
    row_bytes: int,
    forward_passes: int,
    serve: list | None = None,
) -> dict[str, dict[str, float]]:
    """``tokens[R][M][L]``: experts (slot ids) of rank R's tokens per micro-step and layer. AutoEP
    keeps slot ``s`` on EP rank ``s // (E / P)``; each micro-step's forward is one dispatch per
    layer (its count exchange included). ``serve[L][P][E]``: with replicated experts, the rank
    serving each slot to each EP rank's tokens (`dedup_replicas.serve_table`)."""
    n_local = num_experts // ep_size
    out = {d: dict.fromkeys(TIERS, 0.0) for d in DISPATCHERS}
    micro = len(tokens[0])
    for m in range(micro):
        per_layer = [
            torch.cat([tokens[r][m][layer] for r in range(len(tokens))])
            for layer in range(len(tokens[0][m]))
        ]
        if not per_layer:
            continue
        te = torch.stack(per_layer).numpy()  # [L, T, K]
        src = np.concatenate([np.full(len(tokens[r][m][0]), r) for r in range(len(tokens))])
        expert2rank = (
            np.asarray(serve)
            if serve is not None
            else np.tile(np.arange(num_experts) // n_local, (te.shape[0], 1))
        )
        got = tier_bytes(
            expert2rank,
            te,
            src,
            rank_group,
            rank_node,
            ep_size,
            hidden_bytes=row_bytes,
            forward_passes=forward_passes,
        )
        for d in DISPATCHERS:
            for t in TIERS:
                out[d][t] += got[d][t]
    return out


def routing_mismatch(ours, ref, margins) -> tuple[float, float]:
    """(share of (token, layer) whose expert sets differ, the largest reference margin among
    them: 0 when none differ); ``[M][L] -> [T, K]`` each, ``margins[M][L] -> [T]``."""
    bad = total = 0
    widest = 0.0
    for om, rm, mm in zip(ours, ref, margins, strict=True):
        for o, r, m in zip(om, rm, mm, strict=True):
            a, b = o.sort(dim=1).values, r.cpu().long().sort(dim=1).values
            diff = (a != b).any(dim=1)
            bad += int(diff.sum())
            total += a.shape[0]
            if bool(diff.any()):
                widest = max(widest, float(m[diff].max()))
    return bad / max(total, 1), widest


def explain(step: int, dispatcher: str, sb: StepBytes) -> str | None:
    """None when the measured bytes are the plan dispatcher's prediction, else why not."""
    want = {t: round(v) for t, v in sb.predicted[dispatcher].items()}
    if sb.measured == want:
        return None
    other = next(d for d in DISPATCHERS if d != dispatcher)
    alt = {t: round(v) for t, v in sb.predicted[other].items()}
    why = ""
    if sb.measured == alt:
        why = f": that is what {other} sends for these tokens" + (
            " (one row per token and expert: the dispatcher does not de-duplicate)"
            if other == "autoep"
            else ""
        )
    elif dispatcher == "dedup" and sb.dedup_counted != want:
        why = f"; the dedup dispatcher counted {sb.dedup_counted}"
    return (
        f"step {step}: the all-to-alls sent {sb.measured} bytes (summed over ranks, by tier), "
        f"the plan's byte model predicts {want} for dispatcher {dispatcher} on these tokens{why}"
    )
