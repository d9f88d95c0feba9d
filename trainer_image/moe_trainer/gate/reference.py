"""The smoke run's numeric reference: the trainer's optimizer steps in plain PyTorch, no DeepSpeed.

The trainer's steps under ZeRO-3 + AutoEP (gradient accumulation, data- and expert-data-parallel
reduction, clipping, AdamW, the LR warmup and decay) must move every parameter the way the same
math does on one process: the model built from the plan (same seed, same placement permutation),
every rank's micro-batches of each step, loss = LM cross-entropy + coef x the per-layer balancing
loss (the trainer's own `routing.balance_loss` on the Hugging Face routers), the mean over ranks
and micro-steps, gradient clipping, one step of the trainer's optimizer and scheduler.
:class:`ReferenceRun` keeps its optimizer across steps, so a fault that starts at a later step
(or one whose effect only shows once Adam's moments mix steps, like clipping) is compared too.
Before each step after the first, the reference takes the engine's fp32 master weights
(:meth:`ReferenceRun.sync_weights`): every step is compared from the same weights. Left to run on
its own, a 16-bit run's trajectory leaves the reference's once a near-tie routing choice flips,
and the gap compounds over the steps (on an H200, bf16: 0.8% of choices flipped at step 1, 13% at
step 3) until a correct image fails. Adam's moments stay the reference's own, so a lost or
corrupted optimizer state still shows.

Parameter *groups* (router, experts, shared_experts, attention, embeddings, norms, dense_mlp) are
compared on each rank's own view (AutoEP: the rank's local experts): :func:`hf_view` maps the
engine's parameter names and shapes to this model's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

GROUPS = ("router", "experts", "shared_experts", "attention", "embeddings", "norms", "dense_mlp")


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


def hf_pieces(
    name: str, w: torch.Tensor, experts: dict[str, ExpertSlice]
) -> tuple[str, tuple[int, int] | None, tuple[int, int] | None, torch.Tensor]:
    """The inverse of :func:`hf_view`: where the engine's tensor ``w`` of ``name`` goes in the
    reference, as (HF name, rows or None, columns or None, tensor)."""
    if ".mlp.router.gate." in name:
        return name.replace(".mlp.router.gate.", ".mlp.gate."), None, None, w
    m = re.match(r"(.*\.mlp\.experts)\.(w1|w2|w3)$", name)
    if not m:
        return name, None, None, w
    s = experts[m.group(1)]
    rows = (s.ep_rank * s.n_local, (s.ep_rank + 1) * s.n_local)
    if m.group(2) == "w2":
        return f"{m.group(1)}.down_proj", rows, None, w
    cols = (0, s.ffn) if m.group(2) == "w1" else (s.ffn, 2 * s.ffn)
    return f"{m.group(1)}.gate_up_proj", rows, cols, w


@dataclass
class StepRecord:
    """One optimizer step, as both sides record it (name -> tensor in the HF or engine layout).

    ``lm[R]`` / ``balance[R]``: each rank's mean LM / balancing loss over its micro-steps;
    ``grad_norm``: the global gradient norm before clipping; ``lr``: the learning rate this step
    used; ``grads`` at the accumulation boundary (before clipping), ``updates`` (weights after -
    before), ``exp_avg`` / ``exp_avg_sq`` (Adam's moments after the step), ``opt_step`` (the
    optimizer's step count after it); ``topk[R][M][L]``: the experts each token chose (slot ids),
    per rank, micro-step and layer (the reference's; the engine records its own routing apart),
    ``margin[R][M][L]``: per token, the gap between its k-th and (k+1)-th router logit over the
    largest |logit| (a near-tie, where arithmetic noise may pick the other expert, has a tiny
    one)."""

    lm: list[float]
    balance: list[float]
    grad_norm: float
    lr: float
    grads: dict[str, torch.Tensor]
    updates: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    opt_step: int
    topk: list[list[list[torch.Tensor]]] = field(default_factory=list)
    margin: list[list[list[torch.Tensor]]] = field(default_factory=list)


class ReferenceRun:
    """The trainer's optimizer steps on ``model`` (HF blocks, placement applied) in one process.

    ``make_optimizer(params)`` / ``make_scheduler(optimizer)``: the trainer's AdamW and LR
    schedule; ``grad_clip``: the clipping threshold (0: none)."""

    def __init__(
        self,
        model,
        *,
        num_experts: int,
        balance_mode: str,
        balance_coef: float,
        grad_clip: float,
        make_optimizer,
        make_scheduler,
    ):
        from moe_trainer.model import models
        from moe_trainer.telemetry import routing

        self.model = model.train()
        self.num_experts, self.balance_mode, self.balance_coef = (
            num_experts,
            balance_mode,
            balance_coef,
        )
        self.grad_clip = grad_clip
        self.params = dict(model.named_parameters())
        self.opt = make_optimizer([p for p in self.params.values() if p.requires_grad])
        self.sched = make_scheduler(self.opt)
        self.probe = routing.RouterProbe([r.block for r in models.find_moe_layers(model)])

    def step(self, batches: list[list[torch.Tensor]]) -> StepRecord:
        """One optimizer step on ``batches[R][M]`` (every rank's micro-batches of the step, each
        ``[micro, seq + 1]``)."""
        from moe_trainer.telemetry import routing

        params, n = self.params, sum(len(b) for b in batches)
        lr = float(self.opt.param_groups[0]["lr"])
        before = {k: p.detach().clone() for k, p in params.items()}
        self.opt.zero_grad(set_to_none=True)
        lm, balance, topk, margin = [], [], [], []
        for rank_batches in batches:
            r_lm, r_aux, r_topk, r_margin = 0.0, 0.0, [], []
            for batch in rank_batches:
                self.probe.clear()
                logits = self.model(input_ids=batch[:, :-1]).logits
                loss = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
                )
                r_lm += float(loss) / len(rank_batches)
                r_topk.append([t.detach().clone() for t in self.probe.topk])
                r_margin.append(
                    [
                        _margin(lg, t)
                        for lg, t in zip(self.probe.logits, self.probe.topk, strict=True)
                    ]
                )
                aux = routing.balance_loss(self.probe, self.num_experts, self.balance_mode)
                if aux is not None:
                    r_aux += float(aux) / len(rank_batches)
                    if self.balance_coef:
                        loss = loss + self.balance_coef * aux
                (loss / n).backward()
            lm.append(r_lm)
            balance.append(r_aux)
            topk.append(r_topk)
            margin.append(r_margin)
        grads = {
            k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for k, p in params.items()
        }
        with_grad = [p for p in params.values() if p.grad is not None]
        if self.grad_clip and self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(with_grad, self.grad_clip)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in with_grad])
            )
        self.opt.step()
        self.sched.step()
        state = {k: self.opt.state.get(p, {}) for k, p in params.items()}
        zeros = {k: torch.zeros_like(p) for k, p in params.items()}
        return StepRecord(
            lm=lm,
            balance=balance,
            grad_norm=float(norm),
            lr=lr,
            grads=grads,
            updates={k: params[k].detach() - before[k] for k in params},
            exp_avg={k: state[k].get("exp_avg", zeros[k]).detach().clone() for k in params},
            exp_avg_sq={k: state[k].get("exp_avg_sq", zeros[k]).detach().clone() for k in params},
            opt_step=max((int(s["step"]) for s in state.values() if "step" in s), default=0),
            topk=topk,
            margin=margin,
        )

    def sync_weights(self, pieces) -> None:
        """Set parameters from :func:`hf_pieces` tuples (every rank's, for the experts)."""
        with torch.no_grad():
            for name, rows, cols, w in pieces:
                target = self.params[name]
                if rows is not None:
                    target = target[rows[0] : rows[1]]
                if cols is not None:
                    target = target[:, cols[0] : cols[1]]
                target.copy_(w.to(device=target.device, dtype=target.dtype))

    def close(self) -> None:
        self.probe.remove()


def _margin(logits: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """``[T]``: (k-th - (k+1)-th largest router logit) / max |logit| of each token."""
    k = topk.shape[-1]
    s = torch.sort(logits.detach().float(), dim=-1, descending=True).values
    if s.shape[-1] <= k:
        return torch.ones(s.shape[0])
    scale = s.abs().max().clamp(min=1e-30)
    return ((s[:, k - 1] - s[:, k]) / scale).cpu()
