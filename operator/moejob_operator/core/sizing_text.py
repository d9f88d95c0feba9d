"""``moectl plan --auto``'s account of the sizing: the ranked candidates with their predicted
memory and tokens/s, and why each rejected shape was rejected."""

from __future__ import annotations

from typing import Any

from .memory import GiB

SHOWN = 12  # rows of each table


def _shape(c: dict[str, Any]) -> str:
    return f"{c['nodeCount']} x {c['gpusPerNode']}"


def sizing_table(record: dict[str, Any], gpu: str) -> str:
    """The plan's ``sizing`` block as text (ranked candidates, chosen first, then rejections)."""
    cal = record["calibration"]
    err = cal.get("heldOutMeanAbsError")
    lines = [
        (
            f"sizing     Auto: {', '.join(record['auto'])}; "
            f"{record['candidatesConsidered']} shapes considered on {gpu}"
        ),
        f"           throughput model calibrated on {cal['gpu']}"
        + (f" (mean |error| on held-out runs {err:.0%})" if err is not None else "")
        + ("" if cal["calibrated"] else f"; {gpu} scaled from it by datasheet rates"),
        (
            f"{'rank':>4}  {'nodes x GPUs':<12}  {'EP':>3}  {'micro':>5}  {'ckpt':<4}  "
            f"{'persist':<7}  {'peak GiB':>8}  {'tokens/s':>11}  {'step s':>8}  bound"
        ),
    ]
    for i, c in enumerate(record["candidates"][:SHOWN], 1):
        lines.append(
            f"{i:>4}  {_shape(c):<12}  {c['expertParallelSize']:>3}  {c['microBatch']:>5}  "
            f"{'on' if c['activationCheckpointing'] else 'off':<4}  {c['persistence']:<7}  "
            f"{c['peakBytes'] / GiB:>8.1f}  {c['tokensPerSecond']:>11,.0f}  "
            f"{c['stepSeconds']:>8.3f}  {c['bound']}" + ("  <- chosen" if i == 1 else "")
        )
    rejected = record.get("rejected") or []
    if rejected:
        lines.append("rejected:")
        for c in rejected[:SHOWN]:
            what = (
                f"{_shape(c)}, EP {c['expertParallelSize']}, microBatch {c['microBatch']}, "
                f"checkpointing {'on' if c['activationCheckpointing'] else 'off'}, "
                f"persistence {c['persistence']}"
                if c["microBatch"]
                else f"{_shape(c)}"
            )
            lines.append(f"  {what}: {c['rejected']}")
    ch = record["chosen"]
    lines.append(
        f"chosen     {ch['nodeCount']} node(s) x {ch['gpusPerNode']} GPU(s), EP "
        f"{ch['expertParallelSize']}, microBatch {ch['microBatch']}, activation checkpointing "
        f"{'on' if ch['activationCheckpointing'] else 'off'}, persistence {ch['persistence']}: "
        f"predicted {record['predictedTokensPerSecond']:,.0f} tokens/s, "
        f"{record['predictedPeakBytes'] / GiB:.1f} GiB per GPU"
    )
    return "\n".join(lines)
