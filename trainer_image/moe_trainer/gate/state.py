"""What a DeepSpeed engine holds, gathered into this rank's view, for the smoke checks.

Every function here is collective under ZeRO-3 (partitioned tensors are gathered): all ranks call
them in the same order. "This rank's view" is the whole model except for AutoEP's experts, of
which the rank holds its local ones.
"""

from __future__ import annotations

import contextlib

import torch


class StateError(RuntimeError):
    """The engine does not expose a piece of state the checks need."""


def weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter as the model holds it (16-bit on GPU), gathered, float32 on CPU."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().float().cpu().clone() for n, p in params}


def _shape(p) -> torch.Size:
    return getattr(p, "ds_shape", p.shape)


def master_weights(engine) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 master copy of every parameter. With bf16 the model's own copy cannot
    show a small update (a norm weight of 1.0 moves by less than one bf16 step)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        w = safe_get_full_fp32_param(p)
        if w is None:
            raise StateError(f"no fp32 master weight for {n}")
        out[n] = w.detach().float().cpu().reshape(_shape(p)).clone()
    return out


def moments(engine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Adam's (exp_avg, exp_avg_sq) of every parameter."""
    from deepspeed.utils import safe_get_full_optimizer_state

    out: tuple[dict, dict] = ({}, {})
    for n, p in engine.module.named_parameters():
        for i, key in enumerate(("exp_avg", "exp_avg_sq")):
            t = safe_get_full_optimizer_state(p, key)
            if t is None:
                raise StateError(f"the optimizer holds no {key} for {n}")
            out[i][n] = t.detach().float().cpu().reshape(_shape(p)).clone()
    return out


def optimizer_step_count(engine) -> int:
    """The optimizer's own step count (torch AdamW's ``state['step']``), 0 before the first."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = [int(s["step"]) for s in opt.state.values() if isinstance(s, dict) and "step" in s]
    return max(steps, default=0)


def learning_rate(engine) -> float:
    """The learning rate the next optimizer step uses."""
    return float(engine.get_lr()[0])


@contextlib.contextmanager
def boundary_grads(engine, out: dict[str, torch.Tensor | None]):
    """Inside it, the first optimizer step at a gradient-accumulation boundary fills ``out`` with
    every parameter's full gradient (before clipping), float32 on CPU."""
    from deepspeed.utils import safe_get_full_grad

    inner = engine.step

    def step(*args, **kwargs):
        if not out and engine.is_gradient_accumulation_boundary():
            for n, q in engine.module.named_parameters():
                g = safe_get_full_grad(q)
                out[n] = g.detach().float().cpu().reshape(_shape(q)) if g is not None else None
        return inner(*args, **kwargs)

    engine.step = step
    try:
        yield out
    finally:
        del engine.step
