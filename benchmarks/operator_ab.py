"""The operator benchmark against two or more source trees in turns (A, B, A, B, ...), so each
sees the same machine load: a relative comparison on a busy machine, where absolute figures are
not comparable from one minute to the next.

    .venv/bin/python benchmarks/operator_ab.py --tree before=/tmp/main-copy --tree after=. \\
        [--rounds 3] [--jobs 100] [--out benchmarks/results]

Each run is ``benchmarks/operator_bench.py`` (this tree's) with the operator's code taken from
the given tree (``PYTHONPATH=<tree>/operator:<tree>/trainer_image``); the operator is started
as ``moectl operator`` from that tree. Writes ``operator_ab.{json,md}``: every run's p50, p99,
operator CPU (and of it kopf's event-loop thread), the 1-min load before its burst, and each
tree's medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "operator_bench.py"
KEYS = (
    "loadAverage1mBefore",
    "p50Seconds",
    "p99Seconds",
    "operatorCpuSeconds",
    "operatorLoopThreadCpuSeconds",
    "launchP50Seconds",
    "calibrationCpuSeconds",
)


def one_run(tree: Path, jobs: int) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'operator'}:{tree / 'trainer_image'}")
    with tempfile.TemporaryDirectory(prefix="moe-opab-") as out:
        proc = subprocess.run(
            [sys.executable, str(BENCH), "--jobs", str(jobs), "--out", out],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(
                f"benchmark failed on {tree}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        run = json.loads((Path(out) / "operator.json").read_text())["runs"][0]
    return {k: run.get(k) for k in KEYS} | {"completed": run["completed"], "jobs": run["jobs"]}


def median(values: list) -> float | None:
    xs = [v for v in values if v is not None]
    return round(statistics.median(xs), 3) if xs else None


def markdown(doc: dict) -> str:
    labels = list(doc["trees"])
    lines = [
        "# Operator benchmark, interleaved A/B",
        "",
        f"Command: `{doc['command']}`. {doc['rounds']} round(s); in each, one run per tree in "
        f"the order {', '.join(labels)}; {doc['jobs']} jobs per run. Trees: "
        + "; ".join(f"{k} = `{v}`" for k, v in doc["trees"].items())
        + ".",
        "",
        (
            "| round | tree | load (1 min) before | p50 | p99 | operator CPU "
            "| of it kopf's loop thread | launch in status p50 |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for i in range(doc["rounds"]):
        for label in labels:
            r = doc["runs"][label][i]
            lines.append(
                f"| {i + 1} | {label} | {r['loadAverage1mBefore']} | {r['p50Seconds']} s | "
                f"{r['p99Seconds']} s | {r['operatorCpuSeconds']} s | "
                f"{r['operatorLoopThreadCpuSeconds']} s | {r['launchP50Seconds']} s |"
            )
    lines += [
        "",
        "Medians:",
        "",
        "| tree | p50 | p99 | operator CPU | of it kopf's loop thread |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        m = doc["medians"][label]
        lines.append(
            f"| {label} | {m['p50Seconds']} s | {m['p99Seconds']} s | "
            f"{m['operatorCpuSeconds']} s | {m['operatorLoopThreadCpuSeconds']} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tree",
        action="append",
        required=True,
        metavar="LABEL=PATH",
        help="a source tree to run (repeat; run in this order each round)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    trees: dict[str, Path] = {}
    for item in args.tree:
        label, sep, path = item.partition("=")
        if not sep or not label or not (Path(path) / "operator" / "moejob_operator").is_dir():
            ap.error(
                f"--tree {item!r}: want LABEL=PATH, PATH a checkout with operator/moejob_operator"
            )
        trees[label] = Path(path).resolve()
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for i in range(args.rounds):
        for label, tree in trees.items():
            r = one_run(tree, args.jobs)
            runs[label].append(r)
            print(
                f"round {i + 1} {label}: load {r['loadAverage1mBefore']}, p50 {r['p50Seconds']} s, "
                f"p99 {r['p99Seconds']} s, operator CPU {r['operatorCpuSeconds']} s "
                f"(kopf loop {r['operatorLoopThreadCpuSeconds']} s)",
                flush=True,
            )
    doc = {
        "command": "benchmarks/operator_ab.py "
        + " ".join(f"--tree {k}=..." for k in trees)
        + f" --rounds {args.rounds} --jobs {args.jobs}",
        "trees": {k: str(v) for k, v in trees.items()},
        "rounds": args.rounds,
        "jobs": args.jobs,
        "runs": runs,
        "medians": {
            label: {k: median([r[k] for r in rs]) for k in KEYS} for label, rs in runs.items()
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "operator_ab.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "operator_ab.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
