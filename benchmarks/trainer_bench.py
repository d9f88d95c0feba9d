"""Trainer throughput benchmark: HF Mixtral + AutoEP vs HF experts vs the grouped MoE path, ZeRO-3.

One invocation runs every variant side by side, each in its own process (clean CUDA memory and
DeepSpeed state), then an isolated MoE-layer benchmark that splits layer time into expert FFN
(grouped GEMMs + SwiGLU) and routing + permutation, and writes `trainer_<tag>.{json,md}`.

  H200:  PYTHONPATH=trainer_image python benchmarks/trainer_bench.py --out $OUT
  CPU:   PYTHONPATH=trainer_image python benchmarks/trainer_bench.py --tiny --steps 2 --warmup 1

Model (DESIGN.md): Mixtral-style, hidden 1024, intermediate 3584 (Mixtral's 3.5x ratio), 8 experts
top-2, 4 layers, 16 heads / 4 KV heads, vocab 32000, seq 1024, micro-batch 16, bf16, ZeRO-3, one
GPU, synthetic tokens. Same seed, same init, same optimizer (torch AdamW, fused on CUDA) for all.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    # name: (label, how the MoE runs)
    "autoep": "(a) HF Mixtral + AutoEP, ZeRO-3",
    "hf": "(b) HF Mixtral experts (transformers default experts impl = grouped_mm), ZeRO-3",
    "hf_eager": "(b') HF Mixtral experts, eager per-expert loop, ZeRO-3",
    "grouped": "(c) grouped MoE block (moe_trainer.grouped_moe), ZeRO-3",
    "grouped_fused": "(c') grouped MoE block + torch.compile'd SwiGLU, ZeRO-3",
}
DEFAULT_VARIANTS = "autoep,hf,hf_eager,grouped,grouped_fused"

FULL = dict(hidden=1024, inter=3584, experts=8, top_k=2, layers=4, heads=16, kv_heads=4, vocab=32000,
            seq=1024, batch=16)
TINY = dict(hidden=64, inter=128, experts=4, top_k=2, layers=2, heads=4, kv_heads=2, vocab=256,
            seq=32, batch=2)


def mixtral_config(d: dict):
    from transformers import MixtralConfig
    return MixtralConfig(
        hidden_size=d["hidden"], intermediate_size=d["inter"], num_local_experts=d["experts"],
        num_experts_per_tok=d["top_k"], num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"], vocab_size=d["vocab"], max_position_embeddings=d["seq"],
        tie_word_embeddings=False, use_cache=False, output_router_logits=False)


def ds_config(d: dict, on_gpu: bool, autoep: bool) -> dict:
    h = d["hidden"]
    cfg = {
        "train_micro_batch_size_per_gpu": d["batch"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": on_gpu}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {  # HF "auto" rules (DESIGN.md)
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
        },
    }
    if autoep:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}
    return cfg


def _setup(tiny: bool):
    import torch
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
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
        from moe_trainer.grouped_moe import swap_moe_blocks
        assert swap_moe_blocks(model, fused_act=variant == "grouped_fused") == d["layers"]
    return model


def _mem(torch, on_gpu):
    if not on_gpu:
        return {}
    return {"maxAllocatedBytes": torch.cuda.max_memory_allocated(), "maxReservedBytes": torch.cuda.max_memory_reserved()}


def train_worker(args) -> dict:
    torch, on_gpu, device, dtype = _setup(args.tiny)
    import deepspeed
    d = TINY if args.tiny else FULL
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    model = build_model(args.worker, d, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=on_gpu)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=ds_config(d, on_gpu, args.worker == "autoep"))
    init_s = time.perf_counter() - t0
    if on_gpu:
        torch.cuda.synchronize()
    mem_init = _mem(torch, on_gpu)
    g = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, d["vocab"], (d["batch"], d["seq"]), device=device, generator=g) for _ in range(4)]

    def step(i):
        ids = batches[i % len(batches)]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    losses, step_s = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = step(i)
        if on_gpu:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t)
        losses.append(float(loss))
    timed = step_s[args.warmup:]
    tokens = d["batch"] * d["seq"]
    res = {
        "variant": args.worker, "label": VARIANTS[args.worker], "params": n_params,
        "tokensPerSecond": tokens * len(timed) / sum(timed),
        "stepSecondsMedian": sorted(timed)[len(timed) // 2], "stepSeconds": timed,
        "firstStepSeconds": step_s[0], "initSeconds": init_s, "losses": losses,
        "memoryAfterInit": mem_init, "memorySteady": _mem(torch, on_gpu),
    }
    if args.profile and on_gpu:
        res["profile"] = profile_steps(torch, step, args)
    return res


def profile_steps(torch, step, args) -> str:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            step(i)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
    path = Path(args.out) / f"trainer_profile_{args.worker}.txt"
    path.write_text(table)
    return str(path)


def _time(torch, fn, on_gpu, warmup=5, iters=20) -> float:
    """Median milliseconds of fn() (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if on_gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return sorted(out)[len(out) // 2]


def layer_worker(args) -> dict:
    """One MoE layer at benchmark shapes, forward + backward, no ZeRO: where the layer's time goes."""
    torch, on_gpu, device, dtype = _setup(args.tiny)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from moe_trainer.fast.ops import combine, dispatch, plan_dispatch
    from moe_trainer.grouped_moe import GroupedMoeBlock
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

    res = {"tokens": tokens, "ms": {}}
    for impl in ("eager", "grouped_mm"):
        cfg._experts_implementation = impl if (impl == "eager" or on_gpu) else "eager"
        res["ms"][f"hf_{impl}"] = _time(torch, fwd_bwd(hf), on_gpu)
    for fused in (False, True):
        if fused and not on_gpu:
            continue
        fast = GroupedMoeBlock.from_hf(hf, fused_act=fused)
        name = "grouped_fused" if fused else "grouped"
        res["ms"][name] = _time(torch, fwd_bwd(fast), on_gpu)
        # the same layer's pieces, each forward + backward on its own
        x2 = x.detach().reshape(-1, d["hidden"])
        logits, w, ids = fast.gate(x2)
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

        res["ms"][name + ".experts"] = _time(torch, experts, on_gpu)
        res["ms"][name + ".router"] = _time(torch, router, on_gpu)
        res["ms"][name + ".plan_dispatch_combine"] = _time(torch, permute, on_gpu)
    ms = res["ms"]
    for name in ("grouped", "grouped_fused"):
        if name in ms:
            total, exp = ms[name], ms[name + ".experts"]
            res[name + ".routingShare"] = (total - exp) / total
    # HF paths: same expert GEMM work, so (total - our expert FFN time) / total, an estimate
    for name in ("hf_grouped_mm", "hf_eager"):
        res[name + ".routingShareEst"] = max(0.0, (ms[name] - ms["grouped.experts"]) / ms[name])
    return res


def check_worker(args) -> dict:
    """On the device: grouped block (bf16, grouped_mm) vs HF eager block (fp32) on the same weights,
    relative errors of output and gradients; then forward + backward under CUDA sync-debug 'error'."""
    torch, on_gpu, device, dtype = _setup(args.tiny)
    import copy
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from moe_trainer.grouped_moe import GroupedMoeBlock
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
    res = {"impl": fast.experts.resolved_impl(xb), "dtype": str(dtype), "out": rel(y, y_ref),
           "gradX": rel(xb.grad, x.grad)}
    for (n, p), (_, q) in zip(fast.named_parameters(), hf.named_parameters()):
        res["grad." + n] = rel(p.grad, q.grad)
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
    cmd = [sys.executable, __file__, "--worker", variant, "--result", str(out_json), "--out", args.out,
           "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else []) \
        + (["--profile"] if variant in args.profile_variants.split(",") else [])
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=args.worker_timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        proc = subprocess.CompletedProcess(cmd, -9, out + f"\nTIMEOUT after {args.worker_timeout}s")
    log.write(f"===== {variant} rc={proc.returncode} {time.perf_counter() - t:.1f}s\n{proc.stdout}\n")
    log.flush()
    if proc.returncode != 0 or not out_json.exists():
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        print(f"[{variant}] FAILED rc={proc.returncode}\n{tail}", flush=True)
        return {"variant": variant, "label": VARIANTS.get(variant, variant), "error": tail[-2000:]}
    res = json.loads(out_json.read_text())
    out_json.unlink()
    print(f"[{variant}] done in {time.perf_counter() - t:.0f}s", flush=True)
    return res


def report(results: dict, tag: str, d: dict, args) -> str:
    tr = results["train"]
    base = {k: tr[k]["tokensPerSecond"] for k in ("autoep", "hf") if "tokensPerSecond" in tr.get(k, {})}
    gib = 2 ** 30
    lines = [f"# Trainer benchmark ({tag})", "",
             f"Model: Mixtral-style, hidden {d['hidden']}, intermediate {d['inter']}, {d['experts']} experts "
             f"top-{d['top_k']}, {d['layers']} layers, seq {d['seq']}, micro-batch {d['batch']}, "
             f"{'bf16' if results['onGpu'] else 'fp32'}, ZeRO-3, 1 process; {args.steps} timed steps after "
             f"{args.warmup} warm-up. Device: {results['device']}.", "",
             "| variant | tokens/s | vs (a) | vs (b) | median step ms | peak alloc GiB | peak reserved GiB | loss[0] |",
             "|---|---|---|---|---|---|---|---|"]
    for k, r in tr.items():
        if "error" in r:
            lines.append(f"| {r['label']} | failed | | | | | | |")
            continue
        tps = r["tokensPerSecond"]
        ra = f"{tps / base['autoep']:.2f}x" if "autoep" in base else "-"
        rb = f"{tps / base['hf']:.2f}x" if "hf" in base else "-"
        m = r.get("memorySteady", {})
        alloc = f"{m['maxAllocatedBytes'] / gib:.1f}" if m else "-"
        resv = f"{m['maxReservedBytes'] / gib:.1f}" if m else "-"
        lines.append(f"| {r['label']} | {tps / 1e3:.1f}k | {ra} | {rb} | {r['stepSecondsMedian'] * 1e3:.1f} "
                     f"| {alloc} | {resv} | {r['losses'][0]:.4f} |")
    chk = results.get("check", {})
    lines += ["", "Correctness on the device (grouped bf16 vs HF eager fp32, relative L2 error): " +
              ", ".join(f"{k} {v:.2e}" for k, v in chk.items() if isinstance(v, float)) +
              (f"; CUDA sync-debug 'error' mode: {'no host sync' if chk.get('syncDebugError') is None else chk['syncDebugError']}"
               if "syncDebugError" in chk else "")]
    lay = results.get("layer", {})
    if "ms" in lay:
        lines += ["", f"MoE layer alone ({lay['tokens']} tokens, forward + backward, no ZeRO), median ms:", "",
                  "| path | ms |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in lay["ms"].items()]
        lines += [""] + [f"- {k}: {v:.1%}" for k, v in lay.items() if k.endswith(("routingShare", "routingShareEst"))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (tests the script)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--profile-variants", default="grouped,hf")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="results file suffix (default h200 on GPU, cpu_tiny on CPU)")
    ap.add_argument("--worker-timeout", type=int, default=240, help="seconds per variant process")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
    results = {"onGpu": on_gpu, "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
               "torch": torch.__version__, "config": d, "steps": args.steps, "warmup": args.warmup, "train": {}}
    with open(Path(args.out) / f"trainer_{tag}.log", "w") as log:
        results["check"] = run_worker("check", args, log)
        print("check:", json.dumps(results["check"]), flush=True)
        for v in args.variants.split(","):
            results["train"][v] = run_worker(v, args, log)
        results["layer"] = run_worker("layer", args, log)
    (Path(args.out) / f"trainer_{tag}.json").write_text(json.dumps(results, indent=1))
    md = report(results, tag, d, args)
    (Path(args.out) / f"trainer_{tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
