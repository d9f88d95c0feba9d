"""Host time of the trainer's token sample per micro step (`moe_trainer.telemetry.token_samples`),
on the CPU, at the shape of a GPU micro step: what `TokenSampler.add` costs the host between
forward and backward.

Variants, each over the same expert ids and keys:
  one pool, folded every step   a single bottom-k pool whose holding is concatenated with the
                                step's candidates and selected again every micro step (how the
                                sample worked before candidates waited beside the holding)
  one pool                      the same pool with candidates folded in once they are as many as
                                the capacity (the trainer's whole-run sample without its window)
  two pools                     the trainer's sampler: the whole run's and the window's
  two pools, window every N     the same, the window taken (merged and emptied) every N steps, as
                                a publish does: every token of the steps after it is a candidate

  PYTHONPATH=trainer_image python benchmarks/sampler_bench.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from moe_trainer.telemetry.token_samples import TokenSampler


def run(variant: str, layers: int, top_k: int, tokens: int, cap: int, steps: int, every: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    window = variant.startswith("two")
    s = TokenSampler(layers, top_k, cap, 7, 0, 1, window=window)
    times = []
    for step in range(1, steps + 1):
        topk = [torch.randint(0, 64, (tokens, top_k), generator=g) for _ in range(layers)]
        t0 = time.perf_counter()
        s.add(topk, step, 0)
        if variant == "one pool, folded every step":
            s._compact()  # the holding and the candidates selected again at every step
        times.append(time.perf_counter() - t0)
        if window and every and step % every == 0:
            s.take_window("cpu")
    warm = times[steps // 4 :]  # the pools full or filling as in a long run
    return {
        "variant": variant,
        "meanMs": round(1e3 * statistics.fmean(warm), 3),
        "medianMs": round(1e3 * statistics.median(warm), 3),
        "timedSteps": len(warm),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per micro step")
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--every", type=int, default=16, help="steps between two window takes")
    a = ap.parse_args()
    variants = ["one pool, folded every step", "one pool", "two pools", "two pools, window every N"]
    rows = [
        run(
            v,
            a.layers,
            a.top_k,
            a.tokens,
            a.capacity,
            a.steps,
            a.every if v.endswith("every N") else 0,
        )
        for v in variants
    ]
    base = rows[0]["meanMs"]
    for r in rows:
        r["overFoldedEveryStep"] = round(r["meanMs"] / base, 3)
    shape = {
        "layers": a.layers,
        "topK": a.top_k,
        "tokensPerMicroStep": a.tokens,
        "capacity": a.capacity,
        "steps": a.steps,
        "windowEvery": a.every,
        "timed": "the last three quarters of the steps",
    }
    doc = {"shape": shape, "host": platform.processor() or platform.machine(), "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler_cpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "# Token sample host time per micro step (CPU)",
        "",
        f"Shape: {json.dumps(shape)}",
        "",
        "| variant | mean ms | median ms | over folded every step |",
        "|---|---|---|---|",
        *(
            f"| {r['variant']} | {r['meanMs']} | {r['medianMs']} | {r['overFoldedEveryStep']} |"
            for r in rows
        ),
    ]
    (out / "sampler_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
