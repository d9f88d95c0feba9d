"""MFU benchmark: the product's trainer (plan -> moe_trainer.Trainer) against stock AutoEP + ZeRO-3
and plain PyTorch, on one GPU, several model sizes; one profiled step per variant; loss curves.

  H200:  python3 benchmarks/mfu_bench.py --out $OUT                    (all sizes and variants)
  CPU:   python benchmarks/mfu_bench.py --tiny --out /tmp/mfu           (tiny model, end to end)

Model FLOPs per token (no recompute counted; the input embedding is a lookup, not a matmul):
    6 x (active matmul parameters: attention q/k/v/o + router + top_k experts' gate/up/down,
         every layer, + the LM head)  +  6 x L x s x h
The second term is causal attention's QK^T and AV (2 x 2 x s x h per token and layer forward for
full attention, half of it under the causal mask, x3 for forward + backward). MFU = tokens/s x
FLOPs/token / peak, peak = the bf16 dense matmul rate measured in the same process (8192^3 on
random data) and, as a second column, the 989.5 TFLOP/s datasheet number.

Variants (each in its own process; clean CUDA memory and DeepSpeed state):
  plain_eager      HF model, bf16 parameters, no DeepSpeed, fused AdamW, SDPA, HF grouped_mm experts
  plain_compiled   the same + torch.compile of each decoder layer's forward (ceiling reference)
  stock            moe_trainer through a stock plan: HF blocks + AutoEP, ZeRO-3 "auto" knobs
  stock_levers     stock + the levers AutoEP can take: fused AdamW, fused loss, every parameter
                   persistent (one rank)
  fast             moe_trainer through the planner's default plan (`moectl plan`, nothing forced)
  fast_nocompile   fast without compileLayers (ablation)
  fast_hf          fast with HF's grouped_mm experts instead of the grouped block (ablation)
  fast_smallbucket fast with HF's reduce_bucket_size h*h instead of one bucket (ablation)
  fast_stockgrads  fast with DeepSpeed's own gradient reduce path on one rank instead of
                   `install_single_rank_grads` (ablation)
  fast_bf16accum   fast with DeepSpeed's default 16-bit gradient accumulation instead of the
                   planner's fp32 one (each sub-group's fp32 gradient is then one cast copy)
  fast_bf16master  fast + DeepSpeed's bf16 master weights, gradients and Adam moments
                   (bf16.bf16_master_weights_and_grads + bf16_optimizer_states; not the default)
  fast_nosample    fast without the token sample (routingSampleTokens 0; ablation)
  fast_nowindow    fast without the token sample's window pool (ablation)
  fast_windowreset fast with the window pool emptied after every step, as at the start of every
                   window (a publish): every token of a step is offered to it
Loss curves: `loss_stock` and `loss_fast`, same seed, real text (the trainer's built-in corpus,
byte tokenizer), 200 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

from bench_common import (
    copy_sites,
    env_single,
    free_port,
    gpu_memory,
    matmul_peak_tflops,
    profile_summary,
    run_child,
)
from mfu_report import SIZES, annotate, render, write_profiles

ROOT = Path(__file__).resolve().parents[1]
TRAINER_VARIANTS = (
    "stock",
    "stock_levers",
    "fast",
    "fast_nocompile",
    "fast_hf",
    "fast_smallbucket",
    "fast_stockgrads",
    "fast_bf16accum",
    "fast_bf16master",
    "fast_nosample",
    "fast_nowindow",
    "fast_windowreset",
)
# the token sample's ablations: variant -> (routingSampleTokens or None for the plan's, window pool)
SAMPLE_VARIANTS = {"fast_nosample": (0, False), "fast_nowindow": (None, False)}
PLAIN_VARIANTS = ("plain_eager", "plain_compiled")
DEFAULT_RUNS = (
    "3b:stock,3b:fast,3b:plain_compiled,3b:plain_eager,loss:stock,loss:fast,"
    "3b:stock_levers,430m:stock,430m:fast,430m:plain_compiled,3b:fast_nocompile"
)
LOSS_SIZE = "430m"
BF16_MASTER = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


# ---- helpers -----------------------------------------------------------------------------------


def _note_sync(syncs: dict) -> None:
    """Count a synchronizing CUDA call by its innermost Python frames (sync debug mode 'warn')."""
    import traceback

    frames = [
        f
        for f in traceback.extract_stack()[:-2]
        if "mfu_bench" not in f.filename and "/warnings.py" not in f.filename
    ]
    key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
    syncs[key] = syncs.get(key, 0) + 1


# ---- workers -----------------------------------------------------------------------------------


def plan_doc(size: str, variant: str, steps: int, data: dict | None = None) -> dict:
    """The plan the product's planner writes for this size (the `moectl plan` path)."""
    from moejob_operator.core import models as core_models
    from moejob_operator.core.plan import PlanRequest, TrainingOptions, build_plan
    from moejob_operator.core.topology import load_topology

    preset, seq, micro = SIZES[size]
    tiny = size == "tiny"
    model = core_models.resolve_model(preset)
    training = TrainingOptions(
        steps=steps,
        lr=3e-4,
        warmup_steps=10,
        checkpoint_every_steps=10**6,
        seed=1234,
        data=data or {"kind": "synthetic"},
    )
    stock = variant.startswith("stock")
    if tiny:  # CPU: gloo, fp32; the performance options are forced below to test their code paths
        plan = build_plan(
            PlanRequest(
                "mfu",
                "default",
                model,
                None,
                device="cpu",
                procs_per_node=1,
                cpu_memory_bytes=8 << 30,
                global_batch=micro,
                micro_batch=micro,
                seq_len=seq,
                training=training,
                performance=not stock,
            )
        )
    else:
        topo = load_topology(str(ROOT / "tests/fixtures/topology/h200-vm-1gpu.json"))
        plan = build_plan(
            PlanRequest(
                "mfu",
                "default",
                model,
                [topo],
                global_batch=micro,
                micro_batch=micro,
                seq_len=seq,
                training=training,
                performance=not stock,
            )
        )
    doc = json.loads(json.dumps(plan.document))
    tr = doc["training"]
    if variant == "stock_levers":
        tr["performance"] = {"fusedOptimizer": True, "fusedLoss": True}
        doc["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] = 10**10
    if tiny and not stock:  # what the planner picks on a GPU, on CPU (aot_eager compile; CPU's
        # torch._grouped_mm takes fp32 eagerly but its meta kernel wants bf16: HF experts there)
        doc["deepspeed"].pop("expert_parallel", None)
        tr["moeImpl"] = "grouped" if variant == "fast_nocompile" else "hf"
        tr["performance"] = {
            "fusedOptimizer": True,
            "fusedLoss": True,
            "lossChunkTokens": 48,
            "zeroLeafModules": ["MixtralDecoderLayer"],
            "compileLayers": True,
        }
        doc["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] = 10**10
    if variant == "fast_nocompile":
        tr["performance"]["compileLayers"] = False
    if variant == "fast_hf":
        tr["moeImpl"] = "hf"
    if variant.endswith("bf16master") and (doc["deepspeed"].get("bf16") or {}).get("enabled"):
        doc["deepspeed"]["bf16"].update(BF16_MASTER)
    if variant == "fast_bf16accum":
        (doc["deepspeed"].get("data_types") or {}).pop("grad_accum_dtype", None)
    if variant == "fast_smallbucket":
        h = model.spec.hidden_size
        doc["deepspeed"]["zero_optimization"]["reduce_bucket_size"] = h * h
    cap = SAMPLE_VARIANTS.get(variant, (None, True))[0]
    if cap is not None:
        tr["routingSampleTokens"] = cap
    return doc


def variant_estimate(size: str, doc: dict, variant: str = "") -> int:
    """The memory model's peak for the plan as this variant runs it (variants that change the
    planner's document after planning get their own estimate, not the planner's)."""
    from moejob_operator.core import models as core_models
    from moejob_operator.core.memory import estimate_memory, grad_handoff_applies

    preset, seq, micro = SIZES[size]
    perf_doc = doc["training"].get("performance") or {}
    est = estimate_memory(
        core_models.resolve_model(preset).spec,
        doc["deepspeed"],
        world_size=doc["worldSize"],
        ep_size=doc["epSize"],
        seq_len=seq,
        micro_batch=micro,
        device="cpu" if doc["device"] == "cpu" else "gpu",
        fused_loss_chunk=perf_doc.get("lossChunkTokens", 8192)
        if perf_doc.get("fusedLoss")
        else None,
        # fast_stockgrads turns the trainer's hand-off off after planning
        grad_handoff=grad_handoff_applies(doc["deepspeed"], perf_doc)
        and variant != "fast_stockgrads",
        compiled_layers=bool(perf_doc.get("compileLayers")),
    )
    return est.total


def trainer_worker(
    size: str, variant: str, warmup: int, steps: int, profile: bool, data: dict | None = None
) -> dict:
    import torch

    env_single(free_port())
    from moe_contracts.plan import parse_plan
    from moe_trainer import distenv
    from moe_trainer.model import perf
    from moe_trainer.trainer import Trainer

    lean: list[str] = []  # what the trainer installed around DeepSpeed's ZeRO-3 optimizer

    def recording(install):
        def wrapped(zero_opt):
            done = [] if variant == "fast_stockgrads" and install is grads else install(zero_opt)
            lean.extend(done)
            return done

        return wrapped

    grads = perf.install_single_rank_grads
    perf.install_zero3_fused_step = recording(perf.install_zero3_fused_step)
    perf.install_single_rank_grads = recording(grads)
    perf.install_flat_sub_group_grads = recording(perf.install_flat_sub_group_grads)

    total = warmup + steps + (2 if profile else 0)  # + one profiled step + one sync-debug step
    doc = plan_doc(size, variant, total, data)
    plan = parse_plan(doc)
    peak = matmul_peak_tflops(torch)
    env = distenv.read_env(
        plan.world_size, [r.gpu for r in plan.ranks], force_cpu=doc["device"] == "cpu"
    )
    distenv.init_distributed(env)
    trainer = Trainer(plan, env, None)
    t0 = time.perf_counter()
    trainer.build()
    build_s = time.perf_counter() - t0
    if not SAMPLE_VARIANTS.get(variant, (None, True))[1]:  # no window pool (ablation)
        trainer.samples.window = None
        trainer.samples.take_window = lambda device: None
    after_init = torch.cuda.memory_allocated() if env.device.type == "cuda" else None
    marks: dict[int, float] = {}
    syncs: dict[str, int] = {}
    prof_box: dict = {}

    def on_step(step: int) -> None:
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        marks[step] = time.perf_counter()
        if variant == "fast_windowreset":  # the next step starts a window (its merge, once per
            # window in a real run, is timed here every step)
            trainer.samples.take_window(env.device)
        if profile and step == warmup + steps:  # profile the next (last) step
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as tprof

            acts = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if env.device.type == "cuda" else []
            )
            stacks = bool(os.environ.get("MFU_PROFILE_STACKS"))
            prof_box["p"] = tprof(activities=acts, with_stack=stacks, record_shapes=stacks)
            prof_box["p"].__enter__()
            prof_box["t"] = time.perf_counter()
        if profile and step == total - 1 and "p" in prof_box:
            prof_box["p"].__exit__(None, None, None)
            prof_box["wall"] = time.perf_counter() - prof_box["t"]
            if env.device.type == "cuda":  # the last step: where it syncs with the host
                prof_box["show"] = warnings.showwarning
                warnings.showwarning = lambda *a, **k: _note_sync(syncs)
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
        if profile and step == total and "show" in prof_box:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = prof_box["show"]

    trainer.on_step = on_step
    torch.manual_seed(0)
    marks[0] = time.perf_counter()
    code = trainer.run()
    timed = (marks[warmup + steps] - marks[warmup]) / steps
    t = plan.training
    tokens = t.micro_batch * t.seq_len * t.grad_accum
    out = {
        "kind": "trainer",
        "size": size,
        "variant": variant,
        "exit": code,
        "buildSeconds": build_s,
        "stepMs": timed * 1e3,
        "tokensPerSecond": tokens / timed,
        "tokensPerStep": tokens,
        "losses": trainer.losses,
        "leanZero3": lean,
        "peakTflops": peak,
        "plan": {
            "moeImpl": t.moe_impl,
            "autoep": plan.autoep_enabled,
            "performance": doc["training"].get("performance"),
            "persistenceThreshold": doc["deepspeed"]["zero_optimization"].get(
                "stage3_param_persistence_threshold"
            ),
            "estimatedPeakBytes": variant_estimate(size, doc, variant),
            "plannerEstimatedPeakBytes": doc["memory"]["estimatedPeakBytes"],
            "memoryBreakdown": doc["memory"]["breakdown"],
        },
        "memory": gpu_memory(torch),
        "params": sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel()
            for p in trainer.engine.module.parameters()
        ),
    }
    if "wall" in prof_box:
        out["profile"] = profile_summary(prof_box["p"], prof_box["wall"])
        if os.environ.get("MFU_PROFILE_STACKS"):
            out["profile"]["copySites"] = copy_sites(prof_box["p"])
        out["profile"]["hostSyncs"] = sorted(syncs.items(), key=lambda kv: -kv[1])
    out["memory"]["allocatedAfterInitBytes"] = after_init
    trainer.close()
    return out


def plain_worker(size: str, variant: str, warmup: int, steps: int, profile: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from moe_trainer.model import models, perf
    from moejob_operator.core import models as core_models

    preset, seq, micro = SIZES[size]
    cuda = torch.cuda.is_available() and size != "tiny"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    peak = matmul_peak_tflops(torch) if cuda else None
    model = models.build_model(
        core_models.resolve_model(preset).hf_config, seed=1234, dtype=dtype, device=device
    )
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("grouped_mm" if cuda else "eager")
    model.train()
    if variant == "plain_compiled":
        perf.compile_layers(model, backend=None if cuda else "aot_eager")
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=cuda
    )
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (micro, seq + 1), generator=gen).to(device) for _ in range(4)]
    losses = []

    def step(i):
        b = batches[i % len(batches)]
        logits = model(input_ids=b[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, V), b[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    losses.extend(float(step(i)) for i in range(warmup))
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    sync()
    timed = (time.perf_counter() - t0) / steps
    losses.append(float(loss))
    out = {
        "kind": "plain",
        "size": size,
        "variant": variant,
        "stepMs": timed * 1e3,
        "tokensPerSecond": micro * seq / timed,
        "tokensPerStep": micro * seq,
        "losses": losses,
        "peakTflops": peak,
        "memory": gpu_memory(torch),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprof

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        with tprof(activities=acts) as prof:
            t0 = time.perf_counter()
            step(0)
            sync()
            wall = time.perf_counter() - t0
        out["profile"] = profile_summary(prof, wall)
    return out


def worker_main(args) -> None:
    size, _, variant = args.worker.partition(":")
    if size == "loss":
        data = {"kind": "corpus", "path": args.corpus_cache}
        size = "tiny" if args.tiny else LOSS_SIZE
        res = trainer_worker(size, variant, 0, args.loss_steps, False, data)
        res["kind"], res["variant"] = "loss", variant
    elif variant in PLAIN_VARIANTS:
        res = plain_worker(size, variant, args.warmup, args.steps, not args.no_profile)
    elif variant in TRAINER_VARIANTS:
        res = trainer_worker(size, variant, args.warmup, args.steps, not args.no_profile)
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    Path(args.result).write_text(json.dumps(res))


# ---- orchestration and report --------------------------------------------------------------------


def run_all(args) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if args.tiny:
        os.environ.setdefault("MOE_COMPILE_BACKEND", "aot_eager")  # no C++/Triton build on CPU
        runs = [r.replace("3b:", "tiny:").replace("430m:", "tiny:") for r in runs]
        runs = list(dict.fromkeys(runs))
    results = {"device": None, "runs": [], "args": vars(args)}
    try:
        import torch

        results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        results["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - the report says what it could
        pass
    deadline = time.monotonic() + args.budget_s
    for run in runs:
        left = deadline - time.monotonic()
        if left < 20:
            results["runs"].append({"run": run, "error": "skipped: time budget spent"})
            continue
        res_path = out_dir / f".{run.replace(':', '_')}.json"
        cmd = (
            [
                sys.executable,
                __file__,
                "--worker",
                run,
                "--result",
                str(res_path),
                "--warmup",
                str(args.warmup),
                "--steps",
                str(args.steps),
                "--loss-steps",
                str(args.loss_steps),
                "--corpus-cache",
                args.corpus_cache,
            ]
            + (["--tiny"] if args.tiny else [])
            + (["--no-profile"] if args.no_profile else [])
        )
        t0 = time.perf_counter()
        print(f"== {run}", flush=True)
        timeout = min(args.run_timeout, left)
        code, log = run_child(cmd, timeout)
        rc: int | str = "timeout" if code is None else code
        if code is None:
            log += f"Command '{cmd}' timed out after {timeout} seconds"
        wall = time.perf_counter() - t0
        if rc == 0 and res_path.exists():
            res = json.loads(res_path.read_text())
            res_path.unlink()
            res["run"], res["wallSeconds"] = run, wall
            print(
                f"   {res.get('tokensPerSecond', 0):,.0f} tok/s  step {res.get('stepMs', 0):.1f} "
                "ms  "
                f"({wall:.0f} s)",
                flush=True,
            )
        else:
            res = {"run": run, "error": f"exit {rc}", "logTail": log[-4000:], "wallSeconds": wall}
            print(f"   FAILED ({rc}):\n{log[-2500:]}", flush=True)
        results["runs"].append(res)
        (out_dir / f"mfu_{args.tag}.json").write_text(json.dumps(annotate(results), indent=1))
    return annotate(results)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="size:variant,... (loss:stock, loss:fast)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--loss-steps", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (code paths only)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting runs after this")
    ap.add_argument("--run-timeout", type=float, default=240)
    ap.add_argument("--corpus-cache", default=os.environ.get("MOE_CORPUS_CACHE", "/tmp/moe_corpus"))
    ap.add_argument("--render", help="re-render the tables of a result JSON")
    ap.add_argument(
        "--reestimate",
        action="store_true",
        help="with --render: recompute each trainer variant's memory estimate from its plan",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    if args.render:
        results = annotate(json.loads(Path(args.render).read_text()))
        if args.reestimate:
            for r in results["runs"]:
                if r.get("kind") == "trainer" and "error" not in r:
                    r["plan"]["estimatedPeakBytes"] = variant_estimate(
                        r["size"], plan_doc(r["size"], r["variant"], 10), r["variant"]
                    )
        print(render(results))
        return
    results = run_all(args)
    out = Path(args.out)
    (out / f"mfu_{args.tag}.json").write_text(json.dumps(results, indent=1))
    (out / f"mfu_{args.tag}.md").write_text(render(results))
    write_profiles(results, out / f"mfu_profiles_{args.tag}.txt")
    print(render(results))


if __name__ == "__main__":
    main()
