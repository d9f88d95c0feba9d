"""The checks one rank of `moe-smoke` runs on each plan of the ``SmokePlans`` document.

Each case goes through the trainer's own code (`trainer.Trainer`: model from the plan, placement
permutation, activation checkpointing, `deepspeed.initialize` with the plan's DeepSpeed config,
router hooks, balancing loss, gradient accumulation, checkpoint save/resume), so what passes here
is what a job with such a plan runs. Phase 1 (``train``) runs, per case:

  initialize   Trainer.build(): every MoE block must come out an AutoEP layer (when the plan
               enables AutoEP)
  partition    ZeRO-3 partitioned most parameters (the planner's persistence threshold):
               >= half of the tensors and >= 90% of the elements, or the gather/release paths
               and partitioned checkpoints never run
  permutation  each EP rank holds the experts the plan put there; the sharded, permuted model
               computes what the plain, unpermuted model computes
  numerics     the first optimizer step vs the plain-PyTorch reference (`smoke_reference`), per
               parameter group: gradients and updates
  train        the remaining steps: loss finite and falling, router hooks fire, balancing loss
               finite
  checkpoint   Trainer.save(); the weights and the loss of the next step are written for phase 2

Phase 2 (``resume``), in new processes: per case, a fresh Trainer loads the checkpoint
(Trainer.resume()): weights identical to the save, and the next step's loss equals phase 1's.
Then `fused_adam` (GPU: DeepSpeed's FusedAdam steps; its JIT build starts in the background when
phase 1 starts, so it overlaps the cases).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

from moe_contracts.gate import CASE_CHECKS

# A learnable stream: the loss of a tiny model falls within a few steps (uniform random tokens
# would sit at ln(vocab) and prove nothing).
_TEXT = (
    "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
    "sphinx of black quartz, judge my vow. "
)
PARTITIONED_TENSOR_SHARE, PARTITIONED_ELEMENT_SHARE = 0.5, 0.9


class CheckFailed(AssertionError):
    """A check ran and found something wrong (its message is the verdict's message)."""


class Recorder:
    """This rank's check results, rewritten to `path` after every check (the parent reads it
    even when the rank dies later)."""

    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank
        self.checks: list[dict] = []
        self.versions: dict = {}
        self.exception: str | None = None
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "rank": self.rank,
                    "checks": self.checks,
                    "versions": self.versions,
                    "exception": self.exception,
                }
            )
        )
        os.replace(tmp, self.path)

    def run(self, name: str, case: str | None, fn) -> bool:
        t0 = time.perf_counter()
        try:
            message = fn() or "ok"
            passed = True
        except Exception as exc:  # noqa: BLE001 - any failure is the verdict, not a crash
            passed = False
            message = f"{type(exc).__name__}: {exc}".strip()
            self.exception = "".join(traceback.format_exception(exc)[-6:])[-3000:]
        self.checks.append(
            {
                "name": name,
                "case": case,
                "passed": passed,
                "seconds": round(time.perf_counter() - t0, 3),
                "message": message[:1000],
            }
        )
        self.write()
        return passed


def versions(cpu: bool) -> dict:
    """Versions of the stack and, on GPU, what the operator keys GPU verdicts by."""
    import deepspeed
    import torch
    import transformers

    cuda = torch.cuda.is_available() and not cpu
    v = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }
    if cuda:
        major, minor = torch.cuda.get_device_capability(0)
        v["computeCapability"] = f"{major}.{minor}"
        v["driver"], v["cudaDriver"] = _driver_versions()
        try:
            nccl = torch.cuda.nccl.version()
            v["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except (RuntimeError, AttributeError):
            v["nccl"] = None
    return v


def _driver_versions() -> tuple[str | None, str | None]:
    """(driver version, the driver's CUDA version "12.8") from NVML; None where NVML is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        d = pynvml.nvmlSystemGetDriverVersion()
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        return (d.decode() if isinstance(d, bytes) else d), f"{cuda // 1000}.{cuda % 1000 // 10}"
    except Exception:  # noqa: BLE001 - NVML missing: the operator then matches GPU model + capability only
        return None, None


class CaseRun:
    """One plan through the trainer on this rank."""

    def __init__(self, name: str, doc: dict, workdir: Path, env, cpu: bool):
        from moe_contracts.plan import parse_plan

        self.name, self.doc, self.env, self.cpu = name, doc, env, cpu
        self.plan = parse_plan(doc)
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trainer = None

    # ---- setup --------------------------------------------------------------------------------
    def build(self) -> None:
        import numpy as np

        from moe_trainer.data import BatchSource, ByteTokenizer
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

    def weights(self) -> dict:
        """Every parameter, gathered (this rank's view: its local experts), as float32 on CPU."""
        import deepspeed

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return {n: p.detach().float().cpu().clone() for n, p in params}

    def master_weights(self) -> dict:
        """The optimizer's fp32 master copy of every parameter (this rank's view). With bf16 the
        model's own copy cannot show a small update (a norm weight of 1.0 moves by less than one
        bf16 step), so the numeric check compares these."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for n, p in self.engine.module.named_parameters():
            w = safe_get_full_fp32_param(p)
            if w is None:
                raise CheckFailed(f"no fp32 master weight for {n}")
            out[n] = w.detach().float().cpu().reshape(getattr(p, "ds_shape", p.shape)).clone()
        return out

    # ---- phase 1 ------------------------------------------------------------------------------
    def initialize(self) -> str:
        self.build()
        blocks = self.trainer.blocks
        kinds = sorted({type(b).__name__ for b in blocks})
        n_layers = self.plan.placement.num_layers if self.plan.placement else len(blocks)
        want = "AutoEP layers"
        ok = len(blocks) == n_layers
        if self.plan.autoep_enabled:
            from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

            # The dedup dispatcher (the default when EP > 1) is a subclass of AutoEP's layer.
            want = "DedupEPMoELayer" if self.trainer.dispatcher == "dedup" else "AutoEPMoELayer"
            ok = ok and all(
                isinstance(b, AutoEPMoELayer) and type(b).__name__ == want for b in blocks
            )
        if not ok:
            raise CheckFailed(
                f"after initialize the MoE blocks are {kinds} x {len(blocks)}, expected "
                f"{n_layers} {want}"
            )
        ds = self.plan.deepspeed
        return (
            f"{self.plan.model.family}: ZeRO-3 + "
            f"{'AutoEP' if self.plan.autoep_enabled else 'no EP'} "
            f"(EP size {self.plan.ep_size} of world {self.env.world_size}, grad accum "
            f"{ds.get('gradient_accumulation_steps')}, activation checkpointing "
            f"{'on' if self.plan.raw['training'].get('activationCheckpointing') else 'off'}): "
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
        import torch

        from moe_trainer import models
        from moe_trainer.placement import verify_placement

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

    def _batch(self, step: int, micro: int = 0):
        import torch

        t = self.plan.training
        b = self.trainer.source.batch(step, micro, t.grad_accum, self.env.rank, self.env.world_size)
        return torch.from_numpy(b).to(self.env.device)

    def numerics(self) -> str:
        import torch
        from deepspeed.utils import safe_get_full_grad

        from moe_trainer import models
        from moe_trainer import smoke_reference as R
        from moe_trainer.trainer import lr_lambda

        p, t, tr = self.plan, self.plan.training, self.trainer
        if "optimizer" in p.deepspeed or "scheduler" in p.deepspeed:
            raise CheckFailed(
                "the plan's deepspeed.optimizer/scheduler blocks are not modelled by the reference"
            )
        names = [n for n, _ in self.engine.module.named_parameters()]
        before = self.master_weights()
        grads: dict = {}
        engine = self.engine
        inner_step = engine.step

        def step_capturing_grads(*a, **kw):
            if not grads and engine.is_gradient_accumulation_boundary():
                for n, q in engine.module.named_parameters():
                    g = safe_get_full_grad(q)
                    grads[n] = (
                        g.detach().float().cpu().reshape(q.ds_shape) if g is not None else None
                    )
            return inner_step(*a, **kw)

        engine.step = step_capturing_grads
        try:
            lm, aux, _, _, _ = tr.train_step(0)
        finally:
            del engine.step
        after = self.master_weights()
        self.first_loss = lm
        if len(grads) != len(names) or any(g is None for g in grads.values()):
            missing = [n for n in names if grads.get(n) is None]
            raise CheckFailed(f"no gradient at the accumulation boundary for {missing[:4]}")

        # the reference: plain PyTorch, whole model, every rank's micro-batches of step 0
        ref = tr.initial_model().to(self.env.device)
        models.permute_experts(ref, tr.permutation)
        batches = [
            torch.from_numpy(tr.source.batch(0, m, t.grad_accum, r, self.env.world_size)).to(
                self.env.device
            )
            for r in range(self.env.world_size)
            for m in range(t.grad_accum)
        ]
        ref_grads, ref_updates = R.reference_step(
            ref,
            batches,
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
        experts = {}  # AutoEP layer -> which HF expert rows this rank holds
        for layer in models.find_moe_layers(self.engine.module):
            block = layer.block
            if hasattr(block.experts, "w1") and hasattr(block, "ep_rank"):
                shape = getattr(block.experts.w1, "ds_shape", block.experts.w1.shape)
                experts[f"{layer.name}.experts"] = R.ExpertSlice(
                    int(block.ep_rank), int(shape[0]), int(shape[1])
                )
        want_g = {n: R.hf_view(n, ref_grads, experts) for n in names}
        want_u = {n: R.hf_view(n, ref_updates, experts) for n in names}
        ours_u = {n: after[n] - before[n] for n in names}
        half = any((p.deepspeed.get(k) or {}).get("enabled") for k in ("bf16", "fp16"))
        tol = R.TOLERANCE["half" if half else "fp32"]
        g_rows, g_bad = R.compare_groups(grads, want_g, tol, "grad")
        u_rows, u_bad = R.compare_groups(ours_u, want_u, tol, "update")
        self.numeric_rows = {"grad": g_rows, "update": u_rows}
        (self.dir / f"numerics_rank{self.env.rank}.json").write_text(
            json.dumps(self.numeric_rows, indent=1)
        )
        if g_bad or u_bad:
            raise CheckFailed(
                f"rank {self.env.rank}, first optimizer step vs plain PyTorch: "
                + "; ".join(g_bad + u_bad)
            )
        worst = max(max(abs(r["ratio"] - 1), 1 - r["cos"]) for r in g_rows + u_rows)
        return (
            f"first step matches plain PyTorch for {', '.join(r['group'] for r in u_rows)} "
            f"(gradients and updates; worst deviation {worst:.2g}; lm loss {lm:.3f}, balance loss "
            f"{aux:.3f})"
        )

    def train(self) -> str:
        tr, t = self.trainer, self.plan.training
        losses = [self.first_loss]
        for step in range(1, t.steps):
            lm, aux, load, _, _ = tr.train_step(step)
            if not math.isfinite(lm) or not math.isfinite(aux):
                raise CheckFailed(f"loss is {lm} (balance loss {aux}) at step {step + 1}")
            if float(load.sum()) <= 0:
                raise CheckFailed(f"router hooks counted no routed tokens at step {step + 1}")
            losses.append(lm)
        self.losses = losses
        if not losses[-1] < losses[0]:
            raise CheckFailed(f"loss did not fall over {len(losses)} steps: {_fmt(losses)}")
        return (
            f"{len(losses)} steps, loss {_fmt(losses)} "
            f"(balance mode {t.balance.mode}, coef {t.balance.coef:g})"
        )

    def checkpoint(self) -> str:
        import torch

        tr, t = self.trainer, self.plan.training
        step = t.steps
        tr.losses = list(self.losses)
        tr.save(step)
        saved = self.weights()
        torch.save(saved, self.dir / f"saved_rank{self.env.rank}.pt")
        lm, _, _, _, _ = tr.train_step(step)  # the step a resumed run must reproduce
        moved = self.weights()
        if all(torch.equal(saved[n], moved[n]) for n in saved):
            raise CheckFailed(
                "an optimizer step after the save changed no weight (nothing to restore)"
            )
        (self.dir / f"continue_rank{self.env.rank}.json").write_text(
            json.dumps({"step": step, "loss": lm})
        )
        return (
            f"saved step {step} ({len(saved)} tensors); "
            f"next step's loss {lm:.5f} recorded for the resume"
        )

    # ---- phase 2 ------------------------------------------------------------------------------
    def resume(self) -> str:
        import torch

        self.build()
        tr = self.trainer
        tr.resume()
        want = json.loads((self.dir / f"continue_rank{self.env.rank}.json").read_text())
        if tr.start_step != want["step"]:
            raise CheckFailed(
                f"resumed at step {tr.start_step}, the checkpoint was saved at step {want['step']}"
            )
        saved = torch.load(self.dir / f"saved_rank{self.env.rank}.pt", weights_only=True)
        loaded = self.weights()
        diff = [n for n in saved if not torch.equal(saved[n], loaded[n])]
        if diff:
            raise CheckFailed(
                f"after loading in a new process {len(diff)} of {len(saved)} tensors differ from "
                f"the save (first: {diff[:3]})"
            )
        lm, _, _, _, _ = tr.train_step(tr.start_step)
        tol = 1e-5 if self.env.device.type == "cpu" else 2e-2
        if not abs(lm - want["loss"]) <= tol * max(1.0, abs(want["loss"])):
            raise CheckFailed(
                f"the resumed run's step {tr.start_step + 1} loss {lm:.6f} differs from the "
                f"uninterrupted run's {want['loss']:.6f}"
            )
        return (
            f"new process loaded step {tr.start_step}: {len(saved)} tensors identical, next loss "
            f"{lm:.5f} = uninterrupted {want['loss']:.5f}"
        )


def fused_adam(env) -> str:
    import torch

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


def _fmt(xs) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


PHASE1_CHECKS = CASE_CHECKS  # the order a passing verdict reports (the contract fixes it)


def run_phase(
    phase: str,
    plans: dict,
    workdir: Path,
    rec: Recorder,
    *,
    cpu: bool,
    expect_deepspeed: str | None,
    only_case: str | None = None,
) -> bool:
    """All checks of one phase on this rank, stopping at the first failure."""
    from moe_trainer import distenv

    state: dict = {}

    def imports() -> str:
        v = versions(cpu)
        rec.versions = v
        if not cpu and v["device"] != "cuda":
            raise CheckFailed("no CUDA device is visible (run with --cpu to test on CPU)")
        if expect_deepspeed and v["deepspeed"] != expect_deepspeed:
            raise CheckFailed(
                f"the image has deepspeed {v['deepspeed']}, the job declares {expect_deepspeed}"
            )
        first = plans["cases"][0]["plan"]
        env = distenv.read_env(
            first["worldSize"], [r["gpu"] for r in first["ranks"]], force_cpu=cpu
        )
        distenv.set_cpu_threads(env)
        distenv.init_distributed(env, timeout_s=120)
        state["env"] = env
        return (
            f"deepspeed {v['deepspeed']}, torch {v['torch']}, transformers {v['transformers']}, "
            f"cuda {v['cuda']}"
            + (
                f", {v['gpu']} (compute capability {v['computeCapability']}, driver {v['driver']})"
                if v.get("gpu")
                else ""
            )
        )

    if phase == "train" and not rec.run("imports", None, imports):
        return False
    build = _start_fused_adam_build(state["env"]) if phase == "train" else None
    try:
        return _run_cases(phase, plans, workdir, rec, state, cpu, imports, only_case)
    finally:
        if build is not None:
            build.join(timeout=600)


def _start_fused_adam_build(env):
    """GPU, local rank 0: JIT-build FusedAdam (~47 s on a fresh H200) in the background while the
    cases train; the `fused_adam` check of phase 2 then loads it from the extensions cache. A
    failed build is reported there (it builds again and fails with the compiler's message)."""
    import threading

    if env.device.type != "cuda" or env.local_rank != 0:
        return None

    def build():
        try:
            from deepspeed.ops.op_builder import FusedAdamBuilder

            FusedAdamBuilder().load(verbose=False)
        except Exception:  # noqa: BLE001 - the fused_adam check reports it
            pass

    t = threading.Thread(target=build, name="fused-adam-build", daemon=True)
    t.start()
    return t


def _run_cases(phase, plans, workdir, rec, state, cpu, imports, only_case) -> bool:
    if phase == "resume":
        try:
            imports()
        except Exception as exc:  # noqa: BLE001 - reported as the first resume check

            def failed_start(exc=exc):
                raise exc

            return rec.run("resume", plans["cases"][0]["name"], failed_start)
    for case in plans["cases"]:
        if only_case and case["name"] != only_case:
            continue
        run = None

        def make(case=case):
            nonlocal run
            run = CaseRun(case["name"], case["plan"], workdir, state["env"], cpu)
            return run

        try:
            if phase == "train":
                checks = [("initialize", lambda: make().initialize())]
                # `run` is late-bound on purpose: each check runs in this iteration, after make()
                checks += [(n, (lambda n=n: getattr(run, n)())) for n in PHASE1_CHECKS[1:]]  # noqa: B023
            else:
                checks = [("resume", lambda: make().resume())]
            for name, fn in checks:
                if not rec.run(name, case["name"], fn):
                    return False
        finally:
            if run is not None:
                with contextlib.suppress(Exception):  # a failed case may leave no engine to close
                    run.close()
    if phase == "resume":
        return rec.run("fused_adam", None, lambda: fused_adam(state["env"]))
    return True
