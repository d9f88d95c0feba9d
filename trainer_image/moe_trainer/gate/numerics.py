"""The smoke run's ``numerics`` check: every optimizer step of the plan against plain PyTorch.

Each step runs the trainer's own ``train_step`` under ZeRO-3 and, alongside, the same step of
:class:`~moe_trainer.gate.reference.ReferenceRun` (one process, every rank's micro-batches, the
optimizer kept across steps). After each step, on this rank's view, it compares the losses, the
global gradient norm ZeRO-3 clips with, the learning rate, the optimizer's step count and, per
parameter group, the gradients (before clipping), the updates of the fp32 master weights and
both Adam moments, and the share of zero gradient entries per expert (:mod:`.compare`;
tolerances per device and dtype). It stops at the first step that differs, naming the step, the
group and the quantity. Comparing the moments as well as the updates matters: Adam's first
update is about sign(g), blind to a gradient scaled by a constant (clipping switched off, a wrong
average), while the first moment carries the scale.

It also records, for the ``dispatch`` check, each step's all-to-all bytes by tier (summed over
ranks) and the experts this rank's tokens chose, and a compact summary per step for the golden
values the gate keeps per plan and GPU model (``golden``: loss, gradient norm and each group's
update norm on rank 0's view).
"""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

from moe_trainer.dispatch.dedup_replicas import serve_table
from moe_trainer.gate import compare as C
from moe_trainer.gate import dispatch as D
from moe_trainer.gate import state as S
from moe_trainer.gate.reference import ExpertSlice, ReferenceRun, hf_pieces, hf_view

GOLDEN_DIGITS = 5


def _reference(run) -> ReferenceRun:
    from moe_trainer.model import models
    from moe_trainer.trainer import lr_lambda

    tr, t = run.trainer, run.plan.training
    ref = tr.initial_model().to(run.env.device)
    models.permute_experts(ref, tr.permutation)
    return ReferenceRun(
        ref,
        num_experts=tr.num_experts,
        balance_mode=t.balance.mode,
        balance_coef=t.balance.coef,
        grad_clip=t.grad_clip,
        make_optimizer=lambda ps: torch.optim.AdamW(
            ps, lr=t.lr, betas=(0.9, 0.95), weight_decay=0.0
        ),
        make_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lr_lambda(t.warmup_steps, t.steps, t.min_lr_ratio)
        ),
    )


def _expert_slices(engine) -> tuple[dict[str, ExpertSlice], dict[str, tuple[int, int]]]:
    """(AutoEP expert module -> the HF rows it holds, every expert module -> (MoE layer index,
    slot of its local expert 0))."""
    from moe_trainer.model import models

    slices, layers = {}, {}
    for i, layer in enumerate(models.find_moe_layers(engine.module)):
        block, name = layer.block, f"{layer.name}.experts"
        layers[name] = (i, 0)
        if hasattr(block.experts, "w1") and hasattr(block, "ep_rank"):
            shape = getattr(block.experts.w1, "ds_shape", block.experts.w1.shape)
            slices[name] = ExpertSlice(int(block.ep_rank), int(shape[0]), int(shape[1]))
            layers[name] = (i, int(block.ep_rank) * int(shape[0]))
    return slices, layers


def _sync_reference(ref: ReferenceRun, weights, experts, world: int) -> None:
    """The reference takes the engine's master weights; expert rows come from every rank (each
    holds its own EP rank's experts)."""
    pieces = [hf_pieces(n, w, experts) for n, w in weights.items()]
    mine = [pc for pc, n in zip(pieces, weights, strict=True) if n.rsplit(".", 1)[0] in experts]
    if world > 1 and experts:
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        pieces += [pc for other in every for pc in other]
    ref.sync_weights(pieces)


def _dedup_counters():
    import sys

    mod = sys.modules.get("moe_trainer.dispatch.dedup_ep")
    return mod.counters if mod is not None else None


def _slot_counts(tokens, num_experts: int) -> torch.Tensor:
    """``tokens[R][M][L] -> [T, K]`` slot ids: tokens per (layer, slot), ``[L, E]``."""
    layers = len(tokens[0][0])
    out = torch.zeros(layers, num_experts, dtype=torch.float64)
    for rank in tokens:
        for micro in rank:
            for i, t in enumerate(micro):
                out[i] += torch.bincount(t.cpu().long().reshape(-1), minlength=num_experts).double()
    return out


def _step_bytes(run, mine, f, comm: dict, counted: dict, rs, row_bytes: int):
    """All ranks: the step's bytes summed over ranks, the byte model's prediction for the tokens
    every rank routed (``mine[M][L]``: this rank's, ``f`` forward passes per micro-step), the share
    of (token, layer) routed unlike the reference on any rank, the largest reference margin among
    those (0 when none), and the tokens each (layer, slot) got over all ranks."""
    tr, p, env = run.trainer, run.plan, run.env
    tiers = comm["allToAllTierBytes"]
    share, margin = D.routing_mismatch(mine, rs.topk[env.rank], rs.margin[env.rank])
    counts = _slot_counts([mine], tr.num_experts).to(env.device)
    dist.all_reduce(counts)
    flat = torch.tensor(
        [tiers[t] for t in D.TIERS] + [counted.get(t, 0) for t in D.TIERS], dtype=torch.float64
    ).to(env.device)
    dist.all_reduce(flat)
    worst = torch.tensor([share, margin], dtype=torch.float64).to(env.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    share, margin = (float(x) for x in worst.cpu().tolist())
    vals = [int(v) for v in flat.cpu().tolist()]
    measured = dict(zip(D.TIERS, vals[:3], strict=True))
    dedup = dict(zip(D.TIERS, vals[3:], strict=True))
    counts = counts.cpu()
    if p.ep_size == 1:  # nothing is dispatched
        zero = {d: dict.fromkeys(D.TIERS, 0.0) for d in D.DISPATCHERS}
        return D.StepBytes(measured, dedup, zero), share, margin, counts
    every: list = [None] * env.world_size
    dist.all_gather_object(every, (mine, row_bytes))
    group_of, node_of = tr.rank_tiers()
    predicted = D.predict(
        [m for m, _ in every],
        num_experts=tr.num_experts,
        ep_size=p.ep_size,
        rank_group=group_of,
        rank_node=node_of,
        row_bytes=max(b for _, b in every),
        forward_passes=f,
        serve=serve_table(tr.blocks),
    )
    return D.StepBytes(measured, dedup, predicted), share, margin, counts


def _compare(run, lm, aux, got, rs, views, tol, tokens) -> list[str]:
    """Problems of one step, the root cause first. ``tokens``: (expert slices, whether each
    (layer, slot) got as many tokens as in the reference, the tokens it got)."""
    r, clip = run.env.rank, run.plan.training.grad_clip
    grads, ours_u, m1, m2, lr, opt_step, gnorm = got
    want_g, want_u, want_m1, want_m2 = views
    out = []
    if not math.isfinite(lm):
        out.append(f"loss is {lm}")
    elif not C.rel(lm, rs.lm[r]) <= tol["loss"]:
        out.append(
            f"loss {lm:.6g}, the reference's {rs.lm[r]:.6g} (tolerance {tol['loss']:g} relative)"
        )
    if not C.rel(aux, rs.balance[r]) <= tol["balance"]:
        out.append(f"balancing loss {aux:.6g}, the reference's {rs.balance[r]:.6g}")
    _, g_bad, _ = C.compare_groups(grads, want_g, tol, "grad")
    out += g_bad
    out += C.compare_zero_fractions(grads, want_g, tol["expertZeroFraction"], *tokens)[1]
    if out:  # the gradients are off: norms, moments and updates follow from them
        return out
    if gnorm is None or not C.rel(gnorm, rs.grad_norm) <= tol["gradNorm"]:
        out.append(
            f"the global gradient norm ZeRO-3 clips with is {gnorm}, the reference's "
            f"{rs.grad_norm:.6g} (gradient clipping scales by the wrong factor)"
        )
    if not C.rel(lr, rs.lr) <= tol["lr"]:
        out.append(f"learning rate {lr:.6g}, the schedule's {rs.lr:.6g}")
    if opt_step != rs.opt_step:
        out.append(f"the optimizer's step count is {opt_step}, the reference's {rs.opt_step}")
    if out:
        return out
    rows, m_bad, _ = C.compare_groups(m1, want_m1, tol, "expAvg")
    if m_bad:
        size = max((x["size"] for x in rows.values()), key=lambda s: abs(s - 1))
        out.append(C.clipping_diagnosis(rs.grad_norm, clip, size))
        out += m_bad
    out += C.compare_groups(m2, want_m2, tol, "expAvgSq")[1]
    out += C.compare_groups(ours_u, want_u, tol, "update")[1]
    return out


def run_steps(run, failed):
    """Run and compare ``training.steps`` steps; raises ``failed`` (the check's error) at the first
    step that differs. Returns (message, this rank's losses, [(StepBytes, routing mismatch)] per
    step, golden summary)."""
    p, t, tr, env = run.plan, run.plan.training, run.trainer, run.env
    engine, tol = run.engine, run.tol
    if "optimizer" in p.deepspeed or "scheduler" in p.deepspeed:
        raise failed(
            "the plan's deepspeed.optimizer/scheduler blocks are not modelled by the reference"
        )
    ref = _reference(run)
    tape = D.TokenLog(tr)
    forwards = 2 if p.training.activation_checkpointing else 1
    half = any((p.deepspeed.get(k) or {}).get("enabled") for k in ("bf16", "fp16"))
    row_bytes = engine.module.config.hidden_size * (2 if half else 4)
    experts, layers = _expert_slices(engine)
    names = [n for n, _ in engine.module.named_parameters()]
    counters = _dedup_counters()
    losses, steps, golden = [], [], {"loss": [], "gradNorm": [], "update": {}}
    clipped = []
    ties = ""  # the step from which near-tie routing flips relaxed the tolerances
    worst: dict[str, float] = {}  # largest deviation per tolerance key, over the steps
    per_step: list[dict[str, float]] = []
    try:
        after = S.master_weights(engine)
        for k in range(t.steps):
            lr = S.learning_rate(engine)
            before = after  # the weights after the previous step
            if k:
                _sync_reference(ref, before, experts, env.world_size)
            grads: dict = {}
            tr.timer.take()
            if counters is not None:
                counters.take()
            with S.boundary_grads(engine, grads):
                lm, aux, _, _, _ = tr.train_step(k)
            comm = tr.timer.take()
            counted = counters.take() if counters is not None else {}
            after = S.master_weights(engine)
            m1, m2 = S.moments(engine)
            gnorm = engine.get_global_grad_norm()
            gnorm = float(gnorm) if gnorm is not None else None
            opt_step = S.optimizer_step_count(engine)
            batches = [
                [run._batch(k, m, r) for m in range(t.grad_accum)] for r in range(env.world_size)
            ]
            rs = ref.step(batches)
            mine = tape.take()
            sb, share, margin, counts = _step_bytes(
                run, mine, forwards, comm, counted, rs, row_bytes
            )
            same_tokens = _slot_counts(rs.topk, tr.num_experts) == counts  # [L, E]
            steps.append((sb, share))
            if share and margin < C.tie_margin(tol) and not ties:
                # a near-tie went the other way: fp32 arithmetic noise, not a fault; from here on
                # the two runs train slightly different models
                ties = f"step {k + 1}"
                tol = C.tolerances(run.tol_key, run.tol_path, near_tie=True)
            if len(grads) != len(names) or any(g is None for g in grads.values()):
                missing = [n for n in names if grads.get(n) is None]
                raise failed(
                    f"step {k + 1}: no gradient at the accumulation boundary for {missing[:4]}"
                )
            ours_u = {n: after[n] - before[n] for n in names}
            views = tuple(
                {n: hf_view(n, d, experts) for n in names}
                for d in (rs.grads, rs.updates, rs.exp_avg, rs.exp_avg_sq)
            )
            got = (grads, ours_u, m1, m2, lr, opt_step, gnorm)
            problems = _compare(run, lm, aux, got, rs, views, tol, (layers, same_tokens, counts))
            if share and margin >= C.tie_margin(tol):
                problems.append(
                    f"{share:.1%} of the (token, layer) routed to other experts than in the "
                    f"reference, some where the reference's choice was clear (logit margin up "
                    f"to {margin:.2g} of the largest): the model is not the reference's"
                )
            if problems:
                raise failed(
                    f"rank {env.rank}, optimizer step {k + 1} of {t.steps} vs plain PyTorch: "
                    + "; ".join(problems)
                )
            dev = {
                "loss": C.rel(lm, rs.lm[env.rank]),
                "balance": C.rel(aux, rs.balance[env.rank]),
                "gradNorm": C.rel(gnorm, rs.grad_norm),
                "lr": C.rel(lr, rs.lr),
                "expertZeroFraction": C.compare_zero_fractions(
                    grads, views[0], math.inf, layers, same_tokens, counts
                )[0],
                "routingMismatch": share,
                # the widest margin at which a choice went the other way (what tieMargin must pass)
                "tieMargin": float(margin) if share else 0.0,
            }
            for q, ours, want in (
                ("grad", grads, views[0]),
                ("update", ours_u, views[1]),
                ("expAvg", m1, views[2]),
                ("expAvgSq", m2, views[3]),
            ):
                rows, _, d = C.compare_groups(ours, want, tol, q)
                dev.update(d)
                if q == "update":
                    for g, row in rows.items():
                        golden["update"].setdefault(g, []).append(_round(row["norm"]))
            per_step.append(dev)
            for key, v in dev.items():
                worst[key] = max(worst.get(key, 0.0), v)
            mean_lm = torch.tensor([lm], dtype=torch.float64, device=env.device)
            dist.all_reduce(mean_lm)
            golden["loss"].append(_round(float(mean_lm) / env.world_size))
            golden["gradNorm"].append(_round(rs.grad_norm))
            losses.append(lm)
            if t.grad_clip and rs.grad_norm > t.grad_clip:
                clipped.append(t.grad_clip / rs.grad_norm)
    finally:
        ref.close()
        tape.remove()
    (run.dir / f"numerics_rank{env.rank}.json").write_text(
        json.dumps({"steps": per_step, "worst": worst}, indent=1)
    )
    key, share = max(((k, v / tol[k]) for k, v in worst.items() if k in tol), key=lambda kv: kv[1])
    clip = (
        f"clipping active at {len(clipped)} of {t.steps} steps (factor "
        f"{min(clipped):.2g}-{max(clipped):.2g})"
        if clipped
        else f"clipping at {t.grad_clip:g} never active"
    )
    msg = (
        f"{t.steps} optimizer steps match plain PyTorch: losses, global gradient norm, learning "
        f"rate, step count, and per group ({', '.join(golden['update'])}) gradients, updates and "
        f"Adam moments, expert zero counts; worst deviation {share:.2g} of its tolerance ({key})"
        f"{'; near-tie routing flips from ' + ties + ': near-tie tolerances' if ties else ''}; "
        f"{clip}; lm loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    return msg, losses, steps, golden


def _round(x: float) -> float:
    return float(f"{x:.{GOLDEN_DIGITS}g}") if math.isfinite(x) else x
