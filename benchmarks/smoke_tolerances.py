"""Derive the smoke test's numeric tolerances from the spread of correct runs.

Runs the real `moe-smoke` on the planner's smoke plans rendered with ``--seeds`` different seeds
(model init and data order), with unbounded tolerances so every step of every case is compared
and recorded, and collects from each case's work dir the largest deviation of every compared
quantity from the plain-PyTorch reference (``numerics_rank<r>.json``) and of the resumed run from
the uninterrupted one (``resume_rank<r>.json``). The tolerance of a quantity is

    max(FLOOR[dtype][class], FACTOR x the largest deviation over seeds, cases, ranks and steps)

written, with the measured spread, to ``benchmarks/results/smoke_tolerances_<table>.json`` and,
as the table the smoke test reads, into ``trainer_image/moe_trainer/gate/tolerances.json``
(``moe_trainer.gate.compare``; docs/gate.md shows the values).

    python benchmarks/smoke_tolerances.py --cpu --seeds 5                  # table cpu-fp32
    python benchmarks/smoke_tolerances.py --gpu --seeds 5                  # cuda-bf16 (cc >= 8.0)
    python benchmarks/smoke_tolerances.py --gpu --seeds 5 --fp16           # cuda-fp16
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "trainer_image")]

from moe_trainer.gate.compare import TOLERANCES_FILE
from moejob_operator.core.dsconfig import GpuCaps
from moejob_operator.core.smoke_plans import smoke_plans

FACTOR = 10.0
# tieMargin, the widest router-logit margin (share of the largest |logit|) at which a correct run's
# choice went the other way, is noise-sized: a wrong model flips choices at any margin. It gets a
# smaller factor than the deviations, whose size scales with what a fault does to them.
MARGIN_FACTOR = 3.0
# Quantity classes and their floors per dtype: a tolerance never goes below the floor (a quantity
# that came out exactly equal in every run would otherwise get a tolerance of 0).
CLASSES = {
    "relative": (
        "loss",
        "balance",
        "gradNorm",
        "gradSize",
        "updateSize",
        "expAvgSize",
        "expAvgSqSize",
    ),
    "cosine": ("gradCos", "updateCos", "expAvgCos", "expAvgSqCos"),
    "exact": ("lr", "resumeScalar"),
    "resume": ("resumeTensor",),
    "zeros": ("expertZeroFraction",),
    "margin": ("tieMargin",),
}
FLOOR = {
    "fp32": {
        "relative": 1e-6,
        "cosine": 1e-9,
        "exact": 1e-9,
        "resume": 1e-6,
        "zeros": 1e-3,
        "margin": 1e-3,
    },
    "bf16": {
        "relative": 1e-3,
        "cosine": 1e-4,
        "exact": 1e-6,
        "resume": 1e-3,
        "zeros": 1e-2,
        "margin": 1e-2,
    },
    "fp16": {
        "relative": 1e-4,
        "cosine": 1e-5,
        "exact": 1e-6,
        "resume": 1e-4,
        "zeros": 1e-2,
        "margin": 2e-3,
    },
}
# After a near-tie routing flip the runs train slightly different models; these are the 16-bit
# tolerances the first H200 verification passed with (they allow a few tokens routed to another
# expert), not a measurement: flips cannot be provoked on purpose.
NEAR_TIE = {
    "loss": 2e-2,
    "balance": 5e-2,
    "gradNorm": 0.1,
    "gradSize": 0.2,
    "gradCos": 0.1,
    "updateSize": 0.25,
    "updateCos": 0.3,
    "expAvgSize": 0.2,
    "expAvgCos": 0.1,
    "expAvgSqSize": 0.4,
    "expAvgSqCos": 0.1,
    # after a first near-tie flip the runs train slightly different models: later flips may come
    # at wider margins (provisional, like the rest of this set)
    "tieMargin": 0.1,
}
KEYS = [k for ks in CLASSES.values() for k in ks]


def unbounded() -> dict:
    table = {"source": "unbounded (measurement)", "tolerances": dict.fromkeys(KEYS, 1e30)}
    return {
        "kind": "SmokeTolerances",
        "version": 1,
        "tables": {
            k: dict(table, nearTie={}) for k in ("cpu-fp32", "cuda-bf16", "cuda-fp16", "cuda-fp32")
        },
    }


def one_seed(device: str, plans: dict, work: Path, tol_file: Path) -> dict:
    plans_file = work / "plans.json"
    plans_file.write_text(json.dumps(plans))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "trainer_image"), os.environ.get("PYTHONPATH", "")]),
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_trainer.gate.main",
            f"--{device}",
            "--plans",
            str(plans_file),
            "--workdir",
            str(work / "run"),
            "--tolerances",
            str(tol_file),
            "--termination-log",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    verdict = json.loads(p.stdout)
    if not verdict["passed"]:
        raise SystemExit(
            f"seed run failed at {verdict['failedCheck']} [{verdict['failedCase']}]: "
            f"{verdict['checks'][-1]['message']}"
        )
    out: dict = {}
    for case in plans["cases"]:
        for f in sorted((work / "run" / case["name"]).glob("*_rank*.json")):
            if f.name.startswith(("numerics_", "resume_")):
                doc = json.loads(f.read_text())
                for k, v in (doc.get("worst") or doc).items():
                    out.setdefault(case["name"], {})[k] = max(
                        out.get(case["name"], {}).get(k, 0.0), v
                    )
    return {
        "durationSeconds": verdict["durationSeconds"],
        "cases": out,
        "versions": verdict["versions"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dev = ap.add_mutually_exclusive_group(required=True)
    dev.add_argument("--cpu", action="store_true")
    dev.add_argument("--gpu", action="store_true")
    ap.add_argument(
        "--fp16", action="store_true", help="GPU: render fp16 plans (compute capability 7.5)"
    )
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--table", default=str(TOLERANCES_FILE), help="tolerance file to update")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu else "gpu"
    if args.cpu:
        key, dtype, render = "cpu-fp32", "fp32", lambda s: smoke_plans("cpu", seed=s)
    else:
        from smoke_bench import gpu_caps

        caps = gpu_caps()
        if args.fp16:
            caps = GpuCaps(caps.model, caps.memory_bytes, "7.5")
        dtype = "fp16" if args.fp16 or float(caps.compute_capability) < 8.0 else "bf16"
        key = f"cuda-{dtype}"
        render = lambda s: smoke_plans("cuda", caps, seed=s)  # noqa: E731
    seeds = [1234 + 1000 * i for i in range(args.seeds)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="smoke-tol-") as tmp:
        tol_file = Path(tmp) / "unbounded.json"
        tol_file.write_text(json.dumps(unbounded()))
        for seed in seeds:
            work = Path(tmp) / f"seed{seed}"
            work.mkdir()
            r = one_seed("cpu" if args.cpu else "gpu", render(seed), work, tol_file)
            runs.append({"seed": seed, **r})
            print(f"seed {seed}: {r['durationSeconds']}s", flush=True)
    spread = {k: max(c.get(k, 0.0) for r in runs for c in r["cases"].values()) for k in KEYS}
    floors = FLOOR[dtype]
    tolerances = {}
    for cls, keys in CLASSES.items():
        for k in keys:
            factor = MARGIN_FACTOR if cls == "margin" else FACTOR
            tolerances[k] = float(f"{max(floors[cls], factor * spread[k]):.2g}")
    result = Path(args.out) / f"smoke_tolerances_{key}.json"
    command = "python benchmarks/smoke_tolerances.py " + " ".join(argv or sys.argv[1:])
    doc = {
        "benchmark": "smoke test tolerances: spread of correct runs vs the plain-PyTorch reference",
        "command": command,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "table": key,
        "seeds": seeds,
        "factor": FACTOR,
        "floors": floors,
        "spread": spread,
        "tolerances": tolerances,
        "runs": runs,
    }
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(doc, indent=1) + "\n")
    table_path = Path(args.table)
    table = json.loads(table_path.read_text()) if table_path.exists() else unbounded()
    table["tables"][key] = {
        "source": (
            f"measured: {len(seeds)} seeds, {FACTOR:g} x the largest deviation of a correct run "
            f"({MARGIN_FACTOR:g} x for tieMargin), "
            f"floors {floors} (benchmarks/results/{result.name}, `{command}`)"
        ),
        "tolerances": tolerances,
        "nearTie": NEAR_TIE,
    }
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {result} and table {key} of {table_path}")
    for k in KEYS:
        print(f"  {k:20s} spread {spread[k]:.3g} -> tolerance {tolerances[k]:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
