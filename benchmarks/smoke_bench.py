"""How long the upgrade gate's smoke run takes: `moe-smoke` on the planner's smoke plans, timed.

Renders the SmokePlans exactly as the operator does (`moejob_operator.core.smoke_plans`), runs the
real `python -m moe_trainer.gate.main` `--runs` times and writes each verdict's duration, the
per-check seconds (summed over cases), the machine (CPUs, load average before and after, GPU) and
the budget (CPU 180 s, GPU 120 s, docs/gate.md) to `<out>/smoke_<cpu|gpu>.json`.

    # CPU (2 gloo ranks); one GPU (FusedAdam JIT included)
    python benchmarks/smoke_bench.py --cpu --runs 2 --out benchmarks/results
    python benchmarks/smoke_bench.py --gpu --out benchmarks/results
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "trainer_image")]

from moejob_operator.core.dsconfig import GpuCaps
from moejob_operator.core.smoke_plans import smoke_plans

BUDGET_SECONDS = {"cpu": 180.0, "gpu": 120.0}


def gpu_caps() -> GpuCaps:
    out = (
        subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,compute_cap",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        .stdout.splitlines()[0]
        .split(", ")
    )
    return GpuCaps(out[0], int(float(out[1])) * 2**20, out[2])


def one_run(device: str, plans_file: Path, work: Path, timeout: float) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "trainer_image"), os.environ.get("PYTHONPATH", "")]),
    )
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_trainer.gate.main",
            f"--{device}",
            "--plans",
            str(plans_file),
            "--workdir",
            str(work),
            "--timeout",
            str(timeout),
            "--termination-log",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout + 120,
    )
    wall = time.perf_counter() - t0
    try:
        v = json.loads(p.stdout)
    except ValueError:
        return {
            "passed": False,
            "exitCode": p.returncode,
            "wallSeconds": round(wall, 1),
            "stderr": p.stderr[-2000:],
        }
    per_check: dict[str, float] = collections.defaultdict(float)
    for c in v["checks"]:
        per_check[c["name"]] += c["seconds"]
    failed = [c.get("message") for c in v["checks"] if not c.get("passed")]
    return {
        "passed": v["passed"],
        "failedCheck": v["failedCheck"],
        "failedCase": v.get("failedCase"),
        "failedMessage": (failed[0] or "")[:2000] if failed else (v.get("exception") or None),
        "exitCode": p.returncode,
        "durationSeconds": v["durationSeconds"],
        "wallSeconds": round(wall, 1),
        "loadAverageBefore": round(load, 2),
        "loadAverageAfter": round(os.getloadavg()[0], 2),
        "secondsByCheck": {k: round(x, 2) for k, x in per_check.items()},
        "checks": [{k: c[k] for k in ("name", "case", "seconds")} for c in v["checks"]],
        "versions": v["versions"],
        "worldSize": v["worldSize"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dev = ap.add_mutually_exclusive_group(required=True)
    dev.add_argument("--cpu", action="store_true")
    dev.add_argument("--gpu", action="store_true")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu else "gpu"
    plans = smoke_plans("cpu") if args.cpu else smoke_plans("cuda", gpu_caps())
    runs = []
    with tempfile.TemporaryDirectory(prefix="smoke-bench-") as tmp:
        plans_file = Path(tmp) / "plans.json"
        plans_file.write_text(json.dumps(plans))
        for i in range(args.runs):
            r = one_run(device, plans_file, Path(tmp) / f"work{i}", args.timeout)
            runs.append(r)
            print(
                f"run {i + 1}: passed={r['passed']} {r.get('durationSeconds', r['wallSeconds'])}s "
                f"(load {r.get('loadAverageBefore')} -> {r.get('loadAverageAfter')}) "
                f"{r.get('secondsByCheck')}",
                flush=True,
            )
    durations = [r.get("durationSeconds", r["wallSeconds"]) for r in runs]
    doc = {
        "benchmark": "gate smoke run",
        "device": device,
        "command": " ".join(["python", "benchmarks/smoke_bench.py", *(argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpus": os.cpu_count(),
        "cases": [c["name"] for c in plans["cases"]],
        "budgetSeconds": BUDGET_SECONDS[device],
        "maxDurationSeconds": max(durations),
        "minDurationSeconds": min(durations),
        "withinBudget": all(r["passed"] for r in runs) and max(durations) <= BUDGET_SECONDS[device],
        "runs": runs,
    }
    out = Path(args.out) / f"smoke_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"wrote {out}: {min(durations):.1f}-{max(durations):.1f}s, budget "
        f"{BUDGET_SECONDS[device]:.0f}s"
    )
    return 0 if doc["withinBudget"] else 1


if __name__ == "__main__":
    sys.exit(main())
