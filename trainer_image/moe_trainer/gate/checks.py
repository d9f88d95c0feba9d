"""The checks one rank of `moe-smoke` runs on each plan of the ``SmokePlans`` document.

Each case goes through the trainer's own code (`trainer.Trainer`: model from the plan, placement
permutation, activation checkpointing, `deepspeed.initialize` with the plan's DeepSpeed config,
router hooks, balancing loss, gradient accumulation, checkpoint save/resume), so what passes here
is what a job with such a plan runs. Phase 1 (``train``) runs, per case:

  capabilities DeepSpeed has what the plan uses (`moe_trainer.capabilities`), before our layers
               import any of it
  initialize   Trainer.build(): AutoEP applied to every MoE block (when the plan enables it)
  partition    ZeRO-3 keeps whole exactly what the plan's thresholds say, partitions the rest
  permutation  each EP rank holds the experts the plan put there; the sharded, permuted model
               computes what the plain, unpermuted model computes
  numerics     every optimizer step of the plan (``training.steps``) vs the plain-PyTorch
               reference run alongside (`reference`, compared by `compare`)
  dispatch     the bytes those steps' all-to-alls sent, per tier, equal the plan's byte model
               for the tokens they routed (`dispatch`)
  checkpoint   Trainer.save(); one more step, whose weights, Adam moments, step count, learning
               rate and loss are kept for phase 2

Phase 2 (``resume``), in new processes: a fresh Trainer loads the checkpoint, its weights equal the
save, and after the same step its state equals the uninterrupted run's. (`runner` runs the
phases; `fused_adam` follows the cases there.)
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from moe_trainer.gate import compare as C
from moe_trainer.gate import dispatch as D
from moe_trainer.gate import state as S

# A learnable stream: the loss of a tiny model falls within a few steps (uniform random tokens
# would sit at ln(vocab) and prove nothing).
_TEXT = (
    "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
    "sphinx of black quartz, judge my vow. "
)
PARTITIONED_TENSOR_SHARE, PARTITIONED_ELEMENT_SHARE = 0.5, 0.9


class CheckFailed(AssertionError):
    """A check ran and found something wrong (its message is the verdict's message)."""


class CaseRun:
    """One plan through the trainer on this rank."""

    def __init__(self, name: str, doc: dict, workdir: Path, env, cpu: bool, tolerances=None):
        from moe_contracts.plan import parse_plan

        self.name, self.doc, self.env, self.cpu = name, doc, env, cpu
        self.plan = parse_plan(doc)
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tol_key, self.tol_path = C.table_key(env.device.type, self.plan.deepspeed), tolerances
        self.tol = C.tolerances(self.tol_key, tolerances)
        self.trainer = None
        self.golden: dict = {}

    # ---- setup --------------------------------------------------------------------------------
    def build(self) -> None:
        import numpy as np

        from moe_trainer.inputs.data import BatchSource, ByteTokenizer
        from moe_trainer.trainer import Trainer

        self.trainer = tr = Trainer(self.plan, self.env, str(self.dir / "ckpt"))
        tr.build()
        t = self.plan.training
        tr.source = BatchSource(
            np.asarray(ByteTokenizer().encode(_TEXT * 64)),
            t.seq_len,
            t.micro_batch,
            t.seed,
            tr.engine.module.config.vocab_size,
        )

    @property
    def engine(self):
        return self.trainer.engine

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.probe.remove()
            self.trainer.close()
            self.engine.destroy()
            self.trainer = None
        gc.collect()

    def _batch(self, step: int, micro: int = 0, rank: int | None = None):
        t = self.plan.training
        r = self.env.rank if rank is None else rank
        b = self.trainer.source.batch(step, micro, t.grad_accum, r, self.env.world_size)
        return torch.from_numpy(b).to(self.env.device)

    # ---- phase 1 ------------------------------------------------------------------------------
    def capabilities(self) -> str:
        from moe_trainer import capabilities
        from moe_trainer.trainer import deepspeed_config

        p = self.plan
        dispatcher = p.placement.dispatcher if p.placement and p.ep_size > 1 else None
        try:
            return capabilities.check(deepspeed_config(p), dispatcher)
        except capabilities.MissingFeature as exc:
            raise CheckFailed(str(exc)) from None

    def initialize(self) -> str:
        import deepspeed

        self.build()
        blocks = self.trainer.blocks
        kinds = sorted({type(b).__name__ for b in blocks})
        n_layers = self.plan.placement.num_layers if self.plan.placement else len(blocks)
        if len(blocks) != n_layers:
            raise CheckFailed(
                f"after initialize the model has {len(blocks)} MoE blocks, the plan {n_layers}"
            )
        if self.plan.autoep_enabled:
            from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

            # The dedup dispatcher (the default when EP > 1) is a subclass of AutoEP's layer.
            want = "DedupEPMoELayer" if self.trainer.dispatcher == "dedup" else "AutoEPMoELayer"
            bad = [
                i
                for i, b in enumerate(blocks)
                if not (isinstance(b, AutoEPMoELayer) and type(b).__name__ == want)
            ]
            if bad:
                got = sorted({type(blocks[i]).__name__ for i in bad})
                raise CheckFailed(
                    f"AutoEP was not applied to every MoE block: after deepspeed.initialize "
                    f"(deepspeed {deepspeed.__version__}, expert_parallel enabled, preset "
                    f"{self.plan.deepspeed['expert_parallel'].get('preset_model')}) MoE block(s) "
                    f"{bad} of {len(blocks)} are {got}, "
                    f"expected {want}"
                )
        ds = self.plan.deepspeed
        return (
            f"{self.plan.model.family}: ZeRO-3 + "
            f"{'AutoEP' if self.plan.autoep_enabled else 'no EP'} "
            f"(EP size {self.plan.ep_size} of world {self.env.world_size}, grad accum "
            f"{ds.get('gradient_accumulation_steps')}, activation checkpointing "
            f"{'on' if self.plan.training.activation_checkpointing else 'off'}): "
            f"{len(blocks)} x {kinds[0]}, dispatcher {self.trainer.dispatcher}"
        )

    def partition(self) -> str:
        """ZeRO-3 keeps whole exactly the tensors the plan's persistence thresholds say (DeepSpeed's
        rule: ``numel <= stage3_param_persistence_threshold`` while the persistent total stays under
        ``stage3_model_persistence_threshold``), and a plan that partitions most of the model gets
        most of it partitioned. The fast one-GPU plan keeps everything whole on purpose; the stock
        cases partition most tensors (core/smoke_plans.py)."""
        params = list(self.engine.module.named_parameters())
        if any(not hasattr(p, "ds_id") for _, p in params):
            raise CheckFailed(
                "ZeRO-3 did not convert every parameter: "
                f"{[n for n, p in params if not hasattr(p, 'ds_id')][:3]}"
            )
        zo = self.plan.deepspeed.get("zero_optimization") or {}
        threshold = zo.get("stage3_param_persistence_threshold")
        model_cap = zo.get("stage3_model_persistence_threshold", sys.maxsize)
        persistent = {n for n, p in params if getattr(p, "ds_persist", False)}
        part = [(n, p) for n, p in params if n not in persistent]
        numel = sum(p.ds_numel for _, p in params)
        part_numel = sum(p.ds_numel for _, p in part)
        msg = (
            f"{len(part)} of {len(params)} tensors ({part_numel} of {numel} elements) partitioned "
            f"(stage3_param_persistence_threshold {threshold})"
        )
        if isinstance(threshold, int) and isinstance(model_cap, int):
            expected, total = set(), 0
            for n, p in params:
                if p.ds_numel + total <= model_cap and p.ds_numel <= threshold:
                    expected.add(n)
                    total += p.ds_numel
            if expected != persistent:
                raise CheckFailed(
                    f"ZeRO-3 persistence is not what the plan's thresholds say: {msg}; whole but "
                    f"over the threshold: {sorted(persistent - expected)[:4]}; partitioned but "
                    f"under it: {sorted(expected - persistent)[:4]}"
                )
            if len(expected) == len(params):
                return (
                    f"all {len(params)} tensors kept whole as the plan says (threshold {threshold})"
                )
        share_t, share_e = len(part) / len(params), part_numel / max(numel, 1)
        if share_t < PARTITIONED_TENSOR_SHARE or share_e < PARTITIONED_ELEMENT_SHARE:
            raise CheckFailed(
                f"ZeRO-3 keeps most parameters whole: {msg}; persistent: {sorted(persistent)[:6]}"
            )
        return msg

    def permutation(self) -> str:
        from moe_trainer.model import models
        from moe_trainer.model.placement import verify_placement

        # the plain model as the plan describes it, before the permutation
        ref = self.trainer.initial_model().to(self.env.device).eval()
        originals = [
            {k: v.to(self.env.device) for k, v in layer.items()}
            for layer in models.original_expert_tensors(ref)
        ]
        perm = self.trainer.permutation
        report = verify_placement(self.trainer.blocks, perm, originals, self.env.rank)
        if not report["ok"]:
            bad = [x for x in report["layers"] if not x["ok"]]
            raise CheckFailed(f"rank {self.env.rank} does not hold the planned experts: {bad}")
        batch = self._batch(10_000)[:, :-1]
        self.engine.eval()
        with torch.no_grad():
            got = self.engine(input_ids=batch).logits.float()
            want = ref(input_ids=batch).logits.float()
        self.engine.train()
        err = (got - want).abs().flatten()
        diff = float(err.max())
        if self.env.device.type == "cuda":
            # 16-bit: rounding can flip a near-tied top-k choice for a few tokens; judge the bulk
            tol = 5e-2 * max(1.0, float(want.abs().max()))
            measured, what = float(torch.quantile(err, 0.99)), "99th percentile"
        else:
            tol, measured, what = 1e-4, diff, "max"
        if not measured <= tol:
            raise CheckFailed(
                f"the permuted ZeRO-3 model computes a different function than the plain "
                f"model: {what} |logits - reference| = {measured:.3g} > {tol:.3g}"
            )
        moved = sum(1 for row in perm for s, e in enumerate(row) if s != e)
        held = [x["experts"] for x in report["layers"]]
        return (
            f"rank {self.env.rank} holds experts {held} per layer as planned ({moved} expert slots "
            f"moved); max |dlogits| {diff:.2g}"
        )

    def numerics(self) -> str:
        from moe_trainer.gate.numerics import run_steps

        msg, self.losses, self.bytes, self.golden = run_steps(self, CheckFailed)
        return msg

    def dispatch(self) -> str:
        p, tr = self.plan, self.trainer
        dispatcher = tr.dispatcher if p.ep_size > 1 else "autoep"
        problems = [
            why for k, (sb, _) in enumerate(self.bytes, 1) if (why := D.explain(k, dispatcher, sb))
        ]
        if problems:
            raise CheckFailed("; ".join(problems[:2]))
        total = {t: sum(sb.measured[t] for sb, _ in self.bytes) for t in D.TIERS}
        flips = max((share for _, share in self.bytes), default=0.0)
        if p.ep_size == 1:
            return f"EP size 1: no all-to-all traffic in {len(self.bytes)} steps, as the plan says"
        return (
            f"dispatcher {dispatcher}: {len(self.bytes)} steps sent {total} bytes by tier (summed "
            f"over ranks), equal to the plan's byte model for the tokens routed (routed unlike "
            f"the plain model: {flips:.1%}, near-ties only)"
        )

    def checkpoint(self) -> str:
        tr, t = self.trainer, self.plan.training
        step = t.steps
        tr.losses = list(self.losses)
        tr.save(step)
        saved = S.weights(self.engine)
        torch.save(saved, self.dir / f"saved_rank{self.env.rank}.pt")
        lm, _, _, _, _ = tr.train_step(step)  # the step a resumed run must reproduce
        after = self._state(lm)
        if all(torch.equal(saved[n], w) for n, w in S.weights(self.engine).items()):
            raise CheckFailed(
                "an optimizer step after the save changed no weight (nothing to restore)"
            )
        torch.save({"step": step, **after}, self.dir / f"continue_rank{self.env.rank}.pt")
        return (
            f"saved step {step} ({len(saved)} tensors); step {step + 1}'s loss {lm:.5f}, weights, "
            f"Adam moments, step count {after['optStep']} and learning rate {after['lr']:.4g} "
            f"recorded for the resume"
        )

    def _state(self, loss: float) -> dict:
        m1, m2 = S.moments(self.engine)
        return {
            "loss": loss,
            "lr": S.learning_rate(self.engine),
            "optStep": S.optimizer_step_count(self.engine),
            "weights": S.master_weights(self.engine),
            "expAvg": m1,
            "expAvgSq": m2,
        }

    # ---- phase 2 ------------------------------------------------------------------------------
    def resume(self) -> str:
        self.build()
        tr = self.trainer
        tr.resume()
        want = torch.load(self.dir / f"continue_rank{self.env.rank}.pt", weights_only=True)
        if tr.start_step != want["step"]:
            raise CheckFailed(
                f"resumed at step {tr.start_step}, the checkpoint was saved at step {want['step']}"
            )
        saved = torch.load(self.dir / f"saved_rank{self.env.rank}.pt", weights_only=True)
        loaded = S.weights(self.engine)
        diff = [n for n in saved if not torch.equal(saved[n], loaded[n])]
        if diff:
            raise CheckFailed(
                f"after loading in a new process {len(diff)} of {len(saved)} tensors differ from "
                f"the save (first: {diff[:3]})"
            )
        lm, _, _, _, _ = tr.train_step(tr.start_step)
        got = self._state(lm)
        step = tr.start_step + 1
        problems, dev = self._resume_problems(got, want)
        dump(self.dir / f"resume_rank{self.env.rank}.json", dev)
        if problems:
            raise CheckFailed(
                f"rank {self.env.rank}: after the resumed step {step} the state differs from the "
                f"uninterrupted run's: " + "; ".join(problems)
            )
        return (
            f"new process loaded step {tr.start_step}: {len(saved)} tensors identical; after step "
            f"{step} loss {lm:.5f}, fp32 weights, Adam moments, step count {got['optStep']} and "
            f"learning rate {got['lr']:.4g} equal the uninterrupted run's"
        )

    def _resume_problems(self, got: dict, want: dict) -> tuple[list[str], dict[str, float]]:
        """(mismatches, each named; the largest deviation per tolerance key)."""
        tol_t, tol_s = self.tol["resumeTensor"], self.tol["resumeScalar"]
        out = []
        dev = {
            "resumeScalar": max(C.rel(got[k], want[k]) for k in ("lr", "loss")),
            "resumeTensor": 0.0,
        }
        if got["optStep"] != want["optStep"]:
            out.append(
                f"optimizer step count {got['optStep']}, uninterrupted {want['optStep']} (the "
                "optimizer state was not restored)"
            )
        if not C.rel(got["lr"], want["lr"]) <= tol_s:
            out.append(
                f"learning rate {got['lr']:.6g}, uninterrupted {want['lr']:.6g} (the learning-rate "
                "schedule was not restored)"
            )
        for key, what in (
            ("expAvg", C.WHAT["expAvg"]),
            ("expAvgSq", C.WHAT["expAvgSq"]),
            ("weights", "fp32 master weights"),
        ):
            errs = C.relative_tensor_errors(got[key], want[key])
            dev["resumeTensor"] = max(dev["resumeTensor"], *errs.values())
            bad = {n: e for n, e in errs.items() if not e <= tol_t}
            if bad:
                name = max(bad, key=bad.get)
                out.append(
                    f"{what} of {len(bad)} of {len(errs)} tensors (worst {name}: relative "
                    f"difference {bad[name]:.3g} > {tol_t:g})"
                )
        if not C.rel(got["loss"], want["loss"]) <= tol_s:
            out.append(f"loss {got['loss']:.6f}, uninterrupted {want['loss']:.6f}")
        return out, dev


def fused_adam(env) -> str:
    import time

    if env.device.type != "cuda":
        return "fallback: no GPU, FusedAdam not built; the trainer uses torch.optim.AdamW on CPU"
    t0 = time.perf_counter()
    from deepspeed.ops.adam import FusedAdam

    p = torch.nn.Parameter(torch.ones(4096, device=env.device))
    opt = FusedAdam([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.step()
    torch.cuda.synchronize()
    if not bool((p < 1).all()):
        raise CheckFailed("FusedAdam.step() did not move the parameter against its gradient")
    return f"FusedAdam built and stepped in {time.perf_counter() - t0:.1f}s"


def dump(path: Path, doc) -> None:
    path.write_text(json.dumps(doc, indent=1))
