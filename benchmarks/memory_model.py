"""The planner's per-GPU memory estimate beside the peaks the trainer benchmark measured on an H200.

Reads the measured peaks from ``benchmarks/results/trainer_h200.json`` (``trainer_bench.py``: the
AutoEP + ZeRO-3 variant at micro-batch 16 and 32), computes ``core.memory.benchmark_estimate`` for
the same model and batch with the current code, and writes ``memory_model.{json,md}``. CPU only,
a few seconds:

    PYTHONPATH=operator .venv/bin/python benchmarks/memory_model.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moejob_operator.core.memory import benchmark_estimate

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
VARIANTS = {16: "autoep", 32: "autoep@32"}


def compare(measured: dict) -> list[dict]:
    rows = []
    for micro_batch, key in VARIANTS.items():
        steady = measured["train"][key]["memorySteady"]
        est = benchmark_estimate(micro_batch=micro_batch).total
        rows.append(
            {
                "microBatch": micro_batch,
                "variant": key,
                "measuredPeakAllocatedGiB": round(steady["maxAllocatedBytes"] / GIB, 2),
                "measuredPeakReservedGiB": round(steady["maxReservedBytes"] / GIB, 2),
                "estimateGiB": round(est / GIB, 2),
                "errorVsReservedPercent": round(100 * (est / steady["maxReservedBytes"] - 1), 1),
                "errorVsAllocatedPercent": round(100 * (est / steady["maxAllocatedBytes"] - 1), 1),
            }
        )
    return rows


def render(rows: list[dict], source: str) -> str:
    out = [
        "# Memory model vs measured peaks (one H200, bench-mixtral, AutoEP + ZeRO-3)",
        "",
        (
            f"Measured: `{source}` (`benchmarks/trainer_bench.py`); estimate: "
            "`core.memory.benchmark_estimate(micro_batch=N)` with the code that wrote this file. "
            "Command: `PYTHONPATH=operator .venv/bin/python benchmarks/memory_model.py --out "
            "benchmarks/results`."
        ),
        "",
        (
            "| micro-batch | measured peak allocated GiB | measured peak reserved GiB | estimate "
            "GiB "
            "| estimate vs reserved | estimate vs allocated |"
        ),
        "|---|---|---|---|---|---|",
    ]
    out.extend(
        f"| {r['microBatch']} | {r['measuredPeakAllocatedGiB']:.2f} | "
        f"{r['measuredPeakReservedGiB']:.2f} "
        f"| {r['estimateGiB']:.2f} | {r['errorVsReservedPercent']:+.1f}% | "
        f"{r['errorVsAllocatedPercent']:+.1f}% |"
        for r in rows
    )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--measured", default=str(ROOT / "benchmarks" / "results" / "trainer_h200.json")
    )
    ap.add_argument(
        "--out", default=None, help="folder for memory_model.{json,md} (default: print only)"
    )
    args = ap.parse_args()
    source = Path(args.measured).resolve()
    measured = json.loads(source.read_text())
    rows = compare(measured)
    rel = str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else str(source)
    md = render(rows, rel)
    print(md, end="")
    if args.out:
        out = Path(args.out)
        (out / "memory_model.json").write_text(
            json.dumps(
                {
                    "measuredFrom": rel,
                    "model": measured["config"],
                    "params": measured["train"]["autoep"]["params"],
                    "worldSize": 1,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
        (out / "memory_model.md").write_text(md)


if __name__ == "__main__":
    main()
