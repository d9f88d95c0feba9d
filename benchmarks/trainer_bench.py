"""Trainer throughput benchmark: HF Mixtral + AutoEP vs HF experts vs the grouped MoE path, ZeRO-3.

One invocation runs every variant side by side, each in its own process (clean CUDA memory and
DeepSpeed state), then an isolated MoE-layer benchmark that splits layer time into expert FFN
(grouped GEMMs + SwiGLU) and routing + permutation, and writes `trainer_<tag>.{json,md}`.

  H200:  PYTHONPATH=trainer_image python benchmarks/trainer_bench.py --out $OUT
  CPU:   PYTHONPATH=trainer_image python benchmarks/trainer_bench.py --tiny --steps 2 --warmup 1

Model: Mixtral-style, hidden 1024, intermediate 3584 (Mixtral's 3.5x ratio), 8 experts
top-2, 4 layers, 16 heads / 4 KV heads, vocab 32000, seq 1024, micro-batch 16, bf16, ZeRO-3, one
GPU, synthetic tokens. Same seed, same init, same optimizer (torch AdamW, fused on CUDA) for all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_common import device_ms, device_us, env_single, free_port, median_ms, run_child
from trainer_report import report

VARIANTS = {
    # name: (label, how the MoE runs)
    "autoep": "(a) HF Mixtral + AutoEP, ZeRO-3",
    "hf": "(b) HF Mixtral experts (transformers default experts impl = grouped_mm), ZeRO-3",
    "hf_eager": "(b') HF Mixtral experts, eager per-expert loop, ZeRO-3",
    "grouped": "(c) grouped MoE block (trainer default: compiled SwiGLU on CUDA), ZeRO-3",
    "grouped_eager": "(c') grouped MoE block, eager SwiGLU, ZeRO-3",
}
DEFAULT_VARIANTS = "autoep,hf,grouped,grouped_eager,autoep@32,grouped@32"


# ZeRO modifiers ('grouped+persist'): test where a ZeRO-3 step's time goes.
ZERO_MODS = {
    "z2": "ZeRO-2 instead of 3 (no parameter partitioning: no gather/release hooks)",
    "persist": "ZeRO-3 with stage3_param_persistence_threshold=1e9 "
    "(every parameter persistent: no per-step gathers)",
}


def parse_variant(spec: str) -> tuple[str, int | None]:
    """'grouped@32' -> ('grouped', 32): same variant at another micro-batch; 'grouped+z2' -> ZeRO
    mod."""
    name, _, batch = spec.partition("@")
    name = name.split("+")[0]
    if name not in VARIANTS:
        raise SystemExit(f"--variants: unknown variant {name!r} (known: {', '.join(VARIANTS)})")
    for mod in zero_mods(spec):
        if mod not in ZERO_MODS:
            raise SystemExit(
                f"--variants: unknown modifier {mod!r} (known: {', '.join(ZERO_MODS)})"
            )
    return name, int(batch) if batch else None


def zero_mods(spec: str) -> list[str]:
    return spec.partition("@")[0].split("+")[1:]


FULL = dict(
    hidden=1024,
    inter=3584,
    experts=8,
    top_k=2,
    layers=4,
    heads=16,
    kv_heads=4,
    vocab=32000,
    seq=1024,
    batch=16,
)
TINY = dict(
    hidden=64,
    inter=128,
    experts=4,
    top_k=2,
    layers=2,
    heads=4,
    kv_heads=2,
    vocab=256,
    seq=32,
    batch=2,
)


def mixtral_config(d: dict):
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=d["hidden"],
        intermediate_size=d["inter"],
        num_local_experts=d["experts"],
        num_experts_per_tok=d["top_k"],
        num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        vocab_size=d["vocab"],
        max_position_embeddings=d["seq"],
        tie_word_embeddings=False,
        use_cache=False,
        output_router_logits=False,
    )


def ds_config(d: dict, on_gpu: bool, autoep: bool, mods: list[str] = ()) -> dict:
    h = d["hidden"]
    cfg = {
        "train_micro_batch_size_per_gpu": d["batch"],
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": on_gpu},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {  # HF's "auto" rules
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
        },
    }
    if "z2" in mods:
        cfg["zero_optimization"] = {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
        }
    if "persist" in mods:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**9
    if autoep:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}
    return cfg


def _setup(tiny: bool):
    import torch

    env_single(29500)
    on_gpu = torch.cuda.is_available() and not tiny
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    return torch, on_gpu, device, dtype


def build_model(variant: str, d: dict, device, dtype):
    import torch
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = MixtralForCausalLM(mixtral_config(d)).to(dtype)
    if variant == "hf_eager":
        model.set_experts_implementation("eager")
    elif variant in ("hf", "autoep"):
        model.set_experts_implementation("grouped_mm" if device.type == "cuda" else "eager")
    elif variant.startswith("grouped"):
        from moe_trainer.model.grouped_moe import swap_moe_blocks

        assert (
            swap_moe_blocks(model, fused_act=False if variant == "grouped_eager" else None)
            == d["layers"]
        )
    return model


def _mem(torch, on_gpu):
    if not on_gpu:
        return {}
    return {
        "maxAllocatedBytes": torch.cuda.max_memory_allocated(),
        "maxReservedBytes": torch.cuda.max_memory_reserved(),
    }


def train_worker(args) -> dict:
    torch, on_gpu, device, dtype = _setup(args.tiny)
    import deepspeed

    variant, batch = parse_variant(args.worker)
    d = dict(TINY if args.tiny else FULL)
    d["batch"] = batch or d["batch"]
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    model = build_model(variant, d, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=on_gpu)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        config=ds_config(d, on_gpu, variant == "autoep", zero_mods(args.worker)),
    )
    init_s = time.perf_counter() - t0
    if on_gpu:
        torch.cuda.synchronize()
    mem_init = _mem(torch, on_gpu)
    g = torch.Generator(device=device).manual_seed(1)
    batches = [
        torch.randint(0, d["vocab"], (d["batch"], d["seq"]), device=device, generator=g)
        for _ in range(4)
    ]

    def step(i):
        ids = batches[i % len(batches)]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    # No host sync inside the timed window (the loss is read at the end): the host may run ahead
    # of the GPU exactly as in training. Warm-up steps are timed on their own (compile, JIT).
    losses, warm_s = [], []
    for i in range(args.warmup):
        t = time.perf_counter()
        losses.append(step(i).detach())
        if on_gpu:
            torch.cuda.synchronize()
        warm_s.append(time.perf_counter() - t)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    losses.extend(step(i).detach() for i in range(args.warmup, args.warmup + args.steps))
    if on_gpu:
        torch.cuda.synchronize()
    timed_s = time.perf_counter() - t
    losses = [float(x) for x in losses]
    tokens = d["batch"] * d["seq"]
    res = {
        "variant": args.worker,
        "label": VARIANTS[variant]
        + "".join(f"; {ZERO_MODS[m]}" for m in zero_mods(args.worker))
        + (f", micro-batch {batch}" if batch else ""),
        "params": n_params,
        "microBatch": d["batch"],
        "tokensPerSecond": tokens * args.steps / timed_s,
        "stepSecondsMean": timed_s / args.steps,
        "warmupStepSeconds": warm_s,
        "initSeconds": init_s,
        "losses": losses,
        "memoryAfterInit": mem_init,
        "memorySteady": _mem(torch, on_gpu),
    }
    if args.profile and on_gpu:
        res["profile"] = profile_steps(torch, step, args)
    return res


def profile_steps(torch, step, args) -> dict:
    """3 profiled steps: kernel table by device time, and GPU-busy vs wall time per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            step(i)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 3
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=70
    )
    cpu_table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70
    )
    path = Path(args.out) / f"trainer_profile_{args.worker.replace('@', '_b')}.txt"
    path.write_text(table + "\n\nBy self CPU time:\n" + cpu_table)
    busy = device_us(prof) / 3 / 1e3
    return {"table": path.name, "gpuBusyMsPerStep": busy, "wallMsPerStepProfiled": wall * 1e3}


def layer_worker(args) -> dict:
    """One MoE layer at benchmark shapes, forward + backward, no ZeRO: where the layer's time
    goes."""
    torch, on_gpu, device, dtype = _setup(args.tiny)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from moe_trainer.fast.ops import combine, dispatch, plan_dispatch
    from moe_trainer.model.grouped_moe import GroupedMoeBlock

    d = TINY if args.tiny else FULL
    cfg = mixtral_config(d)
    torch.manual_seed(0)
    tokens = d["batch"] * d["seq"]
    with torch.device(device):
        hf = MixtralSparseMoeBlock(cfg)
        for p in hf.parameters():
            torch.nn.init.normal_(p, std=0.02)
        hf = hf.to(dtype)
        x = torch.randn(d["batch"], d["seq"], d["hidden"], dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)

    def fwd_bwd(block):
        def run():
            x.grad = None
            for p in block.parameters():
                p.grad = None
            block(x).backward(grad)

        return run

    res = {"tokens": tokens, "ms": {}, "deviceMs": {}}

    def measure(name, fn):
        res["ms"][name] = median_ms(torch, fn, on_gpu)
        res["deviceMs"][name] = device_ms(torch, fn, on_gpu)

    for impl in ("eager", "grouped_mm"):
        cfg._experts_implementation = impl if (impl == "eager" or on_gpu) else "eager"
        measure(f"hf_{impl}", fwd_bwd(hf))
    for fused in (True, False):
        if fused and not on_gpu:
            continue
        fast = GroupedMoeBlock.from_hf(hf, fused_act=fused)
        name = "grouped" if fused else "grouped_eager"
        measure(name, fwd_bwd(fast))
        # the same layer's pieces, each forward + backward on its own
        x2 = x.detach().reshape(-1, d["hidden"])
        _logits, w, ids = fast.gate(x2)
        plan = plan_dispatch(ids, fast.num_experts)
        xs = dispatch(x2, plan).detach().requires_grad_()
        ys = fast.experts(xs, plan.offsets).detach().requires_grad_()
        wr = w.detach().requires_grad_()
        gs, gt = torch.randn_like(ys), torch.randn_like(x2)

        def experts():
            xs.grad = None
            for p in fast.experts.parameters():
                p.grad = None
            fast.experts(xs, plan.offsets).backward(gs)

        def router():
            xr = x2.detach().requires_grad_()
            fast.gate.weight.grad = None
            lg, ww, _ = fast.gate(xr)
            (lg.float().sum() + ww.sum()).backward()

        def permute():
            xr = x2.detach().requires_grad_()
            pl = plan_dispatch(ids, fast.num_experts)
            dispatch(xr, pl).backward(gs)
            ysr = ys.detach().requires_grad_()
            combine(ysr, wr, pl).backward(gt)

        measure(name + ".experts", experts)
        measure(name + ".router", router)
        measure(name + ".plan_dispatch_combine", permute)
    # routing + permutation share = (layer - expert FFN) / layer, in wall time (host gaps included)
    # and in device time (kernels only). HF paths: our expert FFN time as the estimate of theirs.
    ref = "grouped" if "grouped" in res["ms"] else "grouped_eager"
    for key in ("ms", "deviceMs"):
        t = res[key]
        if t.get(ref) is None:
            continue
        for name in ("grouped", "grouped_eager"):
            if name in t:
                res[f"{name}.routingShare.{key}"] = (t[name] - t[name + ".experts"]) / t[name]
        for name in ("hf_grouped_mm", "hf_eager"):
            res[f"{name}.routingShareEst.{key}"] = max(
                0.0, (t[name] - t[ref + ".experts"]) / t[name]
            )
    return res


def check_worker(args) -> dict:
    """On the device: grouped block (bf16, grouped_mm) vs HF eager block (fp32) on the same weights,
    relative errors of output and gradients; then forward + backward under CUDA sync-debug
    'error'."""
    torch, on_gpu, device, dtype = _setup(args.tiny)
    import copy

    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from moe_trainer.model.grouped_moe import GroupedMoeBlock

    d = TINY if args.tiny else FULL
    cfg = mixtral_config(d)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        hf = MixtralSparseMoeBlock(cfg)
        for p in hf.parameters():
            torch.nn.init.normal_(p, std=0.05)
        x = torch.randn(2, 512, d["hidden"], requires_grad=True)
        grad = torch.randn_like(x)
    fast = GroupedMoeBlock.from_hf(copy.deepcopy(hf).to(dtype))
    y_ref = hf(x)
    y_ref.backward(grad)
    xb = x.detach().to(dtype).requires_grad_()
    y = fast(xb)
    y.backward(grad.to(dtype))

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    res = {
        "impl": fast.experts.resolved_impl(xb),
        "dtype": str(dtype),
        "out": rel(y, y_ref),
        "gradX": rel(xb.grad, x.grad),
    }
    for (n, p), (_, q) in zip(fast.named_parameters(), hf.named_parameters(), strict=True):
        res["grad." + n] = rel(p.grad, q.grad)
    ids_ref = torch.sort(hf.gate(x.detach().reshape(-1, d["hidden"]))[2], -1).values
    res["routingFlipFraction"] = float(
        (torch.sort(fast.last_topk_ids, -1).values != ids_ref).any(-1).float().mean()
    )
    # same comparison against HF's eager block run in the same dtype (same rounding of weights)
    hf_low = copy.deepcopy(hf).to(dtype)
    xl = x.detach().to(dtype).requires_grad_()
    y_low = hf_low(xl)
    y_low.backward(grad.to(dtype))
    res["sameDtype.out"] = rel(y, y_low)
    res["sameDtype.gradX"] = rel(xb.grad, xl.grad)
    for (n, p), (_, q) in zip(fast.named_parameters(), hf_low.named_parameters(), strict=True):
        res["sameDtype.grad." + n] = rel(p.grad, q.grad)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fast(xb).backward(grad.to(dtype))
            res["syncDebugError"] = None
        except RuntimeError as exc:
            res["syncDebugError"] = str(exc)[:500]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return res


def run_worker(variant: str, args, log) -> dict:
    out_json = Path(args.out) / f".{variant}.json"
    cmd = (
        [
            sys.executable,
            __file__,
            "--worker",
            variant,
            "--result",
            str(out_json),
            "--out",
            args.out,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        + (["--tiny"] if args.tiny else [])
        + (["--profile"] if variant in args.profile_variants.split(",") else [])
    )
    t = time.perf_counter()
    env = dict(os.environ)
    env.setdefault(
        "MASTER_PORT", str(free_port())
    )  # 29500 may be taken by another run on this host
    rc, out = run_child(cmd, args.worker_timeout, env)
    if rc is None:
        rc, out = -9, out + f"\nTIMEOUT after {args.worker_timeout}s"
    log.write(f"===== {variant} rc={rc} {time.perf_counter() - t:.1f}s\n{out}\n")
    log.flush()
    if rc != 0 or not out_json.exists():
        tail = "\n".join(out.splitlines()[-15:])
        print(f"[{variant}] FAILED rc={rc}\n{tail}", flush=True)
        return {"variant": variant, "label": VARIANTS.get(variant, variant), "error": tail[-2000:]}
    res = json.loads(out_json.read_text())
    out_json.unlink()
    print(f"[{variant}] done in {time.perf_counter() - t:.0f}s", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (tests the script)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--profile-variants", default="autoep,hf,grouped,grouped@32")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--tag", default=None, help="results file suffix (default h200 on GPU, cpu_tiny on CPU)"
    )
    ap.add_argument("--skip", default="", help="comma list of 'check', 'layer' to skip")
    ap.add_argument(
        "--render", default=None, help="re-render the .md from a results .json and exit"
    )
    ap.add_argument("--worker-timeout", type=int, default=240, help="seconds per variant process")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        results = json.loads(Path(args.render).read_text())
        args.steps, args.warmup = results["steps"], results["warmup"]
        md = report(
            results, Path(args.render).stem.removeprefix("trainer_"), results["config"], args
        )
        Path(args.render).with_suffix(".md").write_text(md)
        print(md)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.worker:
        workers = {"layer": layer_worker, "check": check_worker}
        res = workers.get(args.worker, train_worker)(args)
        Path(args.result).write_text(json.dumps(res))
        return 0

    import torch

    on_gpu = torch.cuda.is_available() and not args.tiny
    tag = args.tag or ("h200" if on_gpu else "cpu_tiny")
    d = TINY if args.tiny else FULL
    results = {
        "onGpu": on_gpu,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "torch": torch.__version__,
        "config": d,
        "steps": args.steps,
        "warmup": args.warmup,
        "train": {},
    }
    with open(Path(args.out) / f"trainer_{tag}.log", "w") as log:
        if "check" not in args.skip.split(","):
            results["check"] = run_worker("check", args, log)
            print("check:", json.dumps(results["check"]), flush=True)
        for v in args.variants.split(","):
            parse_variant(v)
            results["train"][v] = run_worker(v, args, log)
        if "layer" not in args.skip.split(","):
            results["layer"] = run_worker("layer", args, log)
    (Path(args.out) / f"trainer_{tag}.json").write_text(json.dumps(results, indent=1))
    md = report(results, tag, d, args)
    (Path(args.out) / f"trainer_{tag}.md").write_text(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
