"""MFU accounting and the report of ``mfu_bench``: model FLOPs per token, MFU against the measured
peak and the datasheet, ratios within a run, the loss-curve comparison, and the Markdown tables
and profile listing written beside the result JSON (``mfu_<tag>.{json,md}``,
``mfu_profiles_<tag>.txt``)."""

from __future__ import annotations

from pathlib import Path

DATASHEET_TFLOPS = 989.5
SIZES = {
    # name: (preset, seq, micro-batch)
    "3b": ("bench-mixtral-3b", 2048, 8),
    "430m": ("bench-mixtral", 1024, 16),
    "tiny": ("tiny-mixtral", 64, 2),
}


def flops_per_token(spec, seq: int) -> dict:
    """Model FLOPs per trained token (forward + backward), by the formula in the module
    docstring."""
    h, L = spec.hidden_size, spec.num_layers
    q_out, kv_out = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attn = L * (h * q_out + 2 * h * kv_out + q_out * h)
    router = spec.num_moe_layers * spec.num_experts * h
    experts = spec.num_moe_layers * spec.top_k * spec.expert_params()
    dense_mlp = spec.num_dense_layers * spec.dense_mlp_params()
    lm_head = spec.vocab_size * h
    active = attn + router + experts + dense_mlp + lm_head
    scores = 6 * L * seq * q_out
    return {
        "activeMatmulParams": active,
        "matmulFlops": 6 * active,
        "attentionScoreFlops": scores,
        "flopsPerToken": 6 * active + scores,
    }


def annotate(results: dict) -> dict:
    """Add FLOPs/token, MFU and the ratios within the run."""
    from moejob_operator.core import models as core_models

    by = {r["run"]: r for r in results["runs"] if "error" not in r}
    for r in results["runs"]:
        if "error" in r or r.get("kind") == "loss":
            continue
        preset, seq, _ = SIZES[r["size"]]
        f = flops_per_token(core_models.resolve_model(preset).spec, seq)
        r["flops"] = f
        tflops = r["tokensPerSecond"] * f["flopsPerToken"] / 1e12
        r["achievedTflops"] = tflops
        if r.get("peakTflops"):
            r["mfuMeasuredPeak"] = tflops / r["peakTflops"]
        r["mfuDatasheet"] = tflops / DATASHEET_TFLOPS
        for ref in ("stock", "plain_compiled", "plain_eager"):
            other = by.get(f"{r['size']}:{ref}")
            if other:
                r[f"vs_{ref}"] = r["tokensPerSecond"] / other["tokensPerSecond"]
    losses = {
        r["variant"]: r["losses"]
        for r in results["runs"]
        if r.get("kind") == "loss" and "error" not in r
    }
    if "stock" in losses:
        every = {v: compare_losses(losses["stock"], xs) for v, xs in losses.items() if v != "stock"}
        results["lossCurvesByVariant"] = every
        if "fast" in every:
            results["lossCurves"] = every["fast"]
    return results


LOSS_TOLERANCE = 0.03  # relative, on the 10-step moving average, every step from 10 on


def compare_losses(ref: list[float], fast: list[float]) -> dict:
    n = min(len(ref), len(fast))

    def ma(xs, i):
        lo = max(0, i - 9)
        return sum(xs[lo : i + 1]) / (i + 1 - lo)

    rel = [abs(ma(fast, i) - ma(ref, i)) / abs(ma(ref, i)) for i in range(9, n)]
    return {
        "steps": n,
        "first": [ref[0], fast[0]],
        "last10Mean": [ma(ref, n - 1), ma(fast, n - 1)],
        "maxRelDiffMovingAvg10": max(rel) if rel else None,
        "tolerance": LOSS_TOLERANCE,
        "within": bool(rel) and max(rel) <= LOSS_TOLERANCE,
        "maxAbsDiffPerStep": max(abs(a - b) for a, b in zip(ref[:n], fast[:n], strict=True)),
    }


def render(results: dict) -> str:
    lines = [
        f"# MFU benchmark ({results.get('device')}, torch {results.get('torch')})",
        "",
        (
            "FLOPs/token = 6 x active matmul params (attention, router, top-k experts, LM head) "
            "+ 6 x L x s x h (causal attention scores); no recompute counted."
        ),
        "",
        (
            "| size | variant | tokens/s | step ms | GFLOP/token | TFLOP/s | MFU (measured peak) "
            "| MFU (989 TF) "
            "| vs stock | vs plain compiled | peak device GiB | estimate GiB | est/meas |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        if r.get("kind") == "loss":
            continue
        if "error" in r:
            lines.append(f"| {r['run']} | FAILED: {r['error']} |" + " |" * 11)
            continue
        mem = r.get("memory") or {}
        meas = mem.get("peakDeviceBytes")
        est = (r.get("plan") or {}).get("estimatedPeakBytes")
        fmt = lambda v, f="{:.2f}x": f.format(v) if v is not None else "-"  # noqa: E731
        lines.append(
            f"| {r['size']} | {r['variant']} | {r['tokensPerSecond']:,.0f} | {r['stepMs']:.1f} | "
            f"{r['flops']['flopsPerToken'] / 1e9:.2f} | {r['achievedTflops']:.0f} | "
            f"{fmt(r.get('mfuMeasuredPeak'), '{:.1%}')} | {r['mfuDatasheet']:.1%} | "
            f"{fmt(r.get('vs_stock'))} | "
            f"{fmt(r.get('vs_plain_compiled'))} | {fmt(meas and meas / 2**30, '{:.1f}')} | "
            f"{fmt(est and est / 2**30, '{:.1f}')} | "
            f"{fmt(est / meas if est and meas else None, '{:.2f}')} |"
        )
    peaks = [r["peakTflops"] for r in results["runs"] if r.get("peakTflops")]
    if peaks:
        lo, hi = min(peaks), max(peaks)
        lines += [
            "",
            f"Measured bf16 matmul peak (8192^3, random data): {lo:.0f}-{hi:.0f} TFLOP/s.",
        ]
    lines += [
        "",
        "## Where the step goes (one profiled step per variant)",
        "",
        (
            "| size | variant | wall ms | GPU busy ms | GPU idle ms | top kernels (share of kernel "
            "time) |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        p = r.get("profile")
        if not p:
            continue
        top = "; ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in p["topKernels"][:4])
        lines.append(
            f"| {r['size']} | {r['variant']} | {p['wallMs']:.1f} | {p['gpuBusyMs']:.1f} | "
            f"{p['gpuIdleMs']:.1f} | {top} |"
        )
    every = results.get("lossCurvesByVariant") or (
        {"fast": results["lossCurves"]} if results.get("lossCurves") else {}
    )
    if every:
        lines += ["", "## Loss curves (real text, same seed, against stock)", ""]
    for v, lc in every.items():
        lines += [
            (
                f"- {v}: {lc['steps']} steps; first loss stock {lc['first'][0]:.4f} / {v} "
                f"{lc['first'][1]:.4f}; "
                f"last-10 mean stock {lc['last10Mean'][0]:.4f} / {v} {lc['last10Mean'][1]:.4f}; "
                "max relative difference of the 10-step moving average "
                f"{lc['maxRelDiffMovingAvg10']:.3%} "
                f"(tolerance {lc['tolerance']:.0%}: {'within' if lc['within'] else 'OUTSIDE'}); "
                f"max per-step |diff| {lc['maxAbsDiffPerStep']:.4f}."
            )
        ]
    return "\n".join(lines) + "\n"


def write_profiles(results: dict, path: Path) -> None:
    parts = []
    for r in results["runs"]:
        p = r.get("profile")
        if not p:
            continue
        parts.append(
            f"===== {r['run']}: wall {p['wallMs']:.1f} ms, GPU busy {p['gpuBusyMs']:.1f} ms, "
            f"idle {p['gpuIdleMs']:.1f} ms, kernel sum {p['kernelSumMs']:.1f} ms, {p['kernels']} "
            "kernels"
        )
        parts += [
            f"  {k['ms']:8.2f} ms {k['calls']:5d}x {k['share']:6.1%}  {k['name']}"
            for k in p["topKernels"]
        ]
        if p.get("hostSyncs"):
            parts.append(
                "  host syncs by tensor ops (torch.cuda sync debug mode; stream/event syncs are "
                "not listed):"
            )
            parts += [f"  {n:4d}x  {k}" for k, n in p["hostSyncs"]]
        parts.append("  longest host ops:")
        parts += [f"  {h['ms']:8.2f} ms  {h['name']}" for h in p["longestHostOps"]]
        parts.append(p["table"])
    path.write_text("\n".join(parts) + "\n")
