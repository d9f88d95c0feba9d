"""The Markdown report of ``trainer_bench`` (``trainer_<tag>.md``) from its result JSON."""

from __future__ import annotations


def report(results: dict, tag: str, d: dict, args) -> str:
    tr = results["train"]
    base = {
        k: tr[k]["tokensPerSecond"] for k in ("autoep", "hf") if "tokensPerSecond" in tr.get(k, {})
    }
    base.update(
        {
            k: tr[k]["tokensPerSecond"]
            for k in tr
            if k.startswith("autoep@") and "tokensPerSecond" in tr[k]
        }
    )
    gib = 2**30
    lines = [
        f"# Trainer benchmark ({tag})",
        "",
        (
            f"Model: Mixtral-style, hidden {d['hidden']}, intermediate {d['inter']}, "
            f"{d['experts']} experts "
            f"top-{d['top_k']}, {d['layers']} layers, seq {d['seq']}, micro-batch {d['batch']}, "
            f"{'bf16' if results['onGpu'] else 'fp32'}, ZeRO-3, 1 process; {args.steps} timed "
            "steps after "
            f"{args.warmup} warm-up. Device: {results['device']}."
        ),
        "",
        (
            "| variant | tokens/s | vs (a) | vs (b) | mean step ms | GPU busy ms/step | peak alloc "
            "GiB | peak reserved GiB | loss first/last |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in tr.items():
        if "error" in r:
            lines.append(f"| {r['label']} | failed | | | | | | | |")
            continue
        tps = r["tokensPerSecond"]
        suffix = k[k.index("@") :] if "@" in k else ""
        ra = f"{tps / base['autoep' + suffix]:.2f}x" if "autoep" + suffix in base else "-"
        rb = f"{tps / base['hf']:.2f}x" if "hf" in base and not suffix else "-"
        busy = f"{r['profile']['gpuBusyMsPerStep']:.1f}" if "profile" in r else "-"
        m = r.get("memorySteady", {})
        alloc = f"{m['maxAllocatedBytes'] / gib:.1f}" if m else "-"
        resv = f"{m['maxReservedBytes'] / gib:.1f}" if m else "-"
        lines.append(
            f"| {r['label']} | {tps / 1e3:.1f}k | {ra} | {rb} | {r['stepSecondsMean'] * 1e3:.1f} "
            f"| {busy} | {alloc} | {resv} | {r['losses'][0]:.4f} / {r['losses'][-1]:.4f} |"
        )
    chk = results.get("check", {})
    lines += [
        "",
        "Correctness on the device (grouped bf16 vs HF eager fp32, relative L2 error): "
        + ", ".join(f"{k} {v:.2e}" for k, v in chk.items() if isinstance(v, float))
        + (
            "; CUDA sync-debug 'error' mode: "
            f"{'no host sync' if chk.get('syncDebugError') is None else chk['syncDebugError']}"
            if "syncDebugError" in chk
            else ""
        ),
    ]
    lay = results.get("layer", {})
    if "ms" in lay:
        dev = lay.get("deviceMs", {})
        lines += [
            "",
            (
                f"MoE layer alone ({lay['tokens']} tokens, forward + backward, no ZeRO): wall ms "
                "(median, "
                "CUDA events) and device ms (sum of kernel time, torch.profiler):"
            ),
            "",
            "| path | wall ms | device ms |",
            "|---|---|---|",
        ]
        lines += [
            f"| {k} | {v:.3f} | {dev[k]:.3f} |"
            if dev.get(k) is not None
            else f"| {k} | {v:.3f} | - |"
            for k, v in lay["ms"].items()
        ]
        lines += [""] + [f"- {k}: {v:.1%}" for k, v in lay.items() if ".routingShare" in k]
    return "\n".join(lines) + "\n"
