"""Fit the throughput model (``moejob_operator.core.throughput``) to measured H200 runs.

    PYTHONPATH=operator .venv/bin/python benchmarks/sizing_calibrate.py \
        --out benchmarks/results [--sweep benchmarks/results/sizing_sweep_h200.json]

Reads the result files of earlier H200 runs in ``benchmarks/results`` (each case: a plan the
trainer ran and its measured step time), rebuilds every case's counts with the same code the
sizing uses (``throughput.workload``), fits the coefficients to the cases of the FIT list
(non-negative least squares on relative step-time errors; the link coefficient from the 2-GPU
runs' measured over nominal all-to-all time) and checks them on every other case (held out).
Writes the calibration the planner ships (``operator/moejob_operator/core/fixtures/
throughput_h200.json``) and ``OUT/sizing_calibration.{json,md}`` (per case: measured, predicted,
error; fitted vs held out).

Which runs (the FIT list below; every other case is held out):
* fitted: ``mfu_h200_run9`` (the newest run with both sizes: the planner's plan and the stock
  plan of the 3.4 B and 430 M models, each with its profiled step's GPU busy time, which separates
  device from host time), ``mfu_h200_run10`` ``stock_levers`` (AutoEP blocks with the fused
  optimizer: the planner's path at EP size > 1), ``multigpu_h200x2_run2`` (AutoEP + ZeRO-3 on 2
  GPUs and on 1 at micro-batch 8 and 4; its measured all-to-all time gives ``link``) and
  ``trainer_h200`` (micro-batch 16 and 32) and ``launcher_h200`` (the planner's plan of an 8-layer
  model small enough to be host-bound: with the 430 M model's 4 layers it separates the host's
  per-step from its per-layer work), ``trainer_h200_zero`` (the persistence threshold varied:
  separates ZeRO-3's per-tensor fetches from the per-layer work);
* held out: the repeats of those configurations in ``mfu_h200_run1-8,10``, ``multigpu_h200x2_run1``
  and ``run3``; ``userflow_h200*`` (the user flow: ``moectl plan`` defaults, another sequence
  length for the 3.4 B model); ``trainer_h200_repeat`` and ``_run1``; ``gpu_e2e_h200_run1`` (the
  operator's GPU path: worker pods and the direct command); with ``--sweep``, every
  second sweep configuration is fitted and the others held out.
The runs before ``mfu_h200_run6`` ran older trainer code (the planner's 3.4 B plan reached 68-78k
tokens/s there, 84-92k from run 7): their error is the code's change as much as the model's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from moejob_operator.core import throughput as T
from moejob_operator.core.models import resolve_model, spec_from_hf_config

RESULTS = ROOT / "benchmarks" / "results"
FIXTURE = ROOT / "operator" / "moejob_operator" / "core" / "fixtures" / "throughput_h200.json"
GPU = "NVIDIA H200"
MFU_SIZES = {"3b": ("bench-mixtral-3b", 2048, 8), "430m": ("bench-mixtral", 1024, 16)}
MFU_VARIANTS = ("fast", "stock", "stock_levers")
# multigpu_bench.MODEL (64 experts of width 1024, top-8, byte vocabulary)
MULTIGPU_MODEL = {
    "model_type": "mixtral",
    "vocab_size": 320,
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "num_local_experts": 64,
    "num_experts_per_tok": 8,
    "tie_word_embeddings": False,
}
NVLINK_GBPS = 450.0  # the 2-GPU host's discovered NVLink rate (multigpu_h200x2_run*.md)
FIT = {
    ("mfu_h200_run9.json", "3b:fast"),
    ("mfu_h200_run9.json", "3b:stock"),
    ("mfu_h200_run9.json", "430m:fast"),
    ("mfu_h200_run9.json", "430m:stock"),
    ("mfu_h200_run10.json", "3b:stock_levers"),
    ("multigpu_h200x2_run2.json", "*"),
    ("trainer_h200.json", "*"),
    ("launcher_h200.json", "*"),
    ("trainer_h200_zero.json", "*"),
}


@dataclass(frozen=True)
class Case:
    file: str
    name: str
    workload: T.Workload
    measured_seconds: float  # per optimizer step
    peak_tflops: float | None
    device_seconds: float | None = None  # GPU busy time of the profiled step (mfu runs)
    optimizer_seconds: float | None = None  # the profiled step's fused AdamW kernel time
    a2a_measured: float | None = None  # seconds per step (multi-GPU runs)
    a2a_nominal: float | None = None
    note: str = ""

    @property
    def fit(self) -> bool:
        return (self.file, self.name) in FIT or (self.file, "*") in FIT


def _planned_fast(spec, seq, micro, ga=1):
    """The planner's plan on one GPU: compiled layers, fused AdamW, every parameter persistent."""
    return T.workload(
        spec,
        seq_len=seq,
        micro_batch=micro,
        grad_accum=ga,
        world_size=1,
        ep_size=1,
        autoep=False,
        activation_checkpointing=False,
        compiled=True,
        fused_optimizer=True,
        persistence_threshold=10**12,
        bytes_per_elem=2,
    )


def mfu_cases() -> list[Case]:
    out = []
    for path in sorted(RESULTS.glob("mfu_h200_run*.json")):
        if not re.fullmatch(r"mfu_h200_run\d+\.json", path.name):
            continue
        doc = json.loads(path.read_text())
        for r in doc["runs"]:
            if r.get("kind") != "trainer" or r.get("variant") not in MFU_VARIANTS:
                continue
            preset, seq, micro = MFU_SIZES[r["size"]]
            plan = r["plan"]
            perf = plan.get("performance") or {}
            spec = resolve_model(preset).spec
            w = T.workload(
                spec,
                seq_len=seq,
                micro_batch=micro,
                grad_accum=1,
                world_size=1,
                ep_size=1,
                autoep=bool(plan.get("autoep")),
                activation_checkpointing=False,
                compiled=bool(perf.get("compileLayers")),
                fused_optimizer=bool(perf.get("fusedOptimizer")),
                persistence_threshold=int(
                    plan.get("persistenceThreshold") or T.DEFAULT_PERSISTENCE_THRESHOLD
                ),
                bytes_per_elem=2,
            )
            out.append(
                Case(
                    path.name,
                    f"{r['size']}:{r['variant']}",
                    w,
                    r["stepMs"] / 1e3,
                    r.get("peakTflops"),
                    device_seconds=(r.get("profile") or {}).get("gpuBusyMs", 0) / 1e3 or None,
                    optimizer_seconds=_fused_adam_seconds(r),
                )
            )
    return out


def _fused_adam_seconds(run: dict[str, Any]) -> float | None:
    """GPU time of torch's fused AdamW kernel in the profiled step (its top-kernel list)."""
    if not ((run.get("plan") or {}).get("performance") or {}).get("fusedOptimizer"):
        return None
    kernels = (run.get("profile") or {}).get("topKernels") or []
    ms = sum(k["ms"] for k in kernels if "FusedOpti" in k["name"])
    return ms / 1e3 or None


def userflow_cases() -> list[Case]:
    out = []
    for name, preset in (
        ("userflow_h200.json", "bench-mixtral"),
        ("userflow_h200_3b.json", "bench-mixtral-3b"),
    ):
        doc = json.loads((RESULTS / name).read_text())
        tps = doc["medianTokensPerSecondAfterStep10"]
        # moectl plan defaults of that flow: seq 1024, global batch 16 = micro-batch 16 (plan.txt)
        w = _planned_fast(resolve_model(preset).spec, 1024, 16)
        out.append(Case(name, f"{preset} seq 1024 mb 16", w, w.tokens_per_step / tps, None))
    return out


def multigpu_cases() -> list[Case]:
    spec = spec_from_hf_config(MULTIGPU_MODEL)
    out = []
    for path in sorted(RESULTS.glob("multigpu_h200x2_run*.json")):
        doc = json.loads(path.read_text())
        for name, run in doc["runs"].items():
            m = re.search(r"\((\d+) GPUs?(?:, mb (\d+))?\)", name)
            if not m or "measured" not in run:
                continue
            gpus, micro = int(m.group(1)), int(m.group(2) or 8)
            pred, meas = run["predicted"], run["measured"]
            # planned before the planner's speed choices existed: AutoEP blocks, DeepSpeed's
            # optimizer step, HF's persistence threshold (10 h)
            w = T.workload(
                spec,
                seq_len=1024,
                micro_batch=micro,
                grad_accum=1,
                world_size=gpus,
                ep_size=gpus,
                autoep=True,
                activation_checkpointing=False,
                compiled=False,
                fused_optimizer=False,
                persistence_threshold=10 * spec.hidden_size,
                bytes_per_elem=2,
                all_to_all_seconds=float(pred.get("allToAllSecondsPerStep") or 0.0),
                data_parallel_gbps=NVLINK_GBPS if gpus > 1 else 0.0,
            )
            out.append(
                Case(
                    path.name,
                    name,
                    w,
                    w.tokens_per_step / meas["tokensPerSecond"],
                    None,
                    a2a_measured=meas.get("allToAllSecondsPerStep") if gpus > 1 else None,
                    a2a_nominal=pred.get("allToAllSecondsPerStep") if gpus > 1 else None,
                )
            )
    return out


def trainer_bench_cases() -> list[Case]:
    """``benchmarks/trainer_bench.py`` (bench-mixtral, seq 1024; DeepSpeed's optimizer step and
    HF's persistence threshold unless the variant says otherwise)."""
    spec = resolve_model("bench-mixtral").spec
    out = []
    for path in sorted(RESULTS.glob("trainer_h200*.json")):
        doc = json.loads(path.read_text())
        for name, r in (doc.get("train") or {}).items():
            if "z2" in name or "eager" in name:
                continue  # ZeRO-2, or an eager per-expert loop: not a path the planner takes
            micro = int(r.get("microBatch") or doc["config"]["batch"])
            step = r.get("stepSecondsMean") or r.get("stepSecondsMedian")
            w = T.workload(
                spec,
                seq_len=doc["config"]["seq"],
                micro_batch=micro,
                grad_accum=1,
                world_size=1,
                ep_size=1,
                autoep=name.startswith("autoep"),
                activation_checkpointing=False,
                compiled=False,
                fused_optimizer=False,
                persistence_threshold=10**9 if "persist" in name else 10 * spec.hidden_size,
                bytes_per_elem=2,
            )
            out.append(Case(path.name, name, w, float(step), None))
    return out


def launcher_cases() -> list[Case]:
    """``benchmarks/launcher_bench.py``: the planner's plan (``moectl plan`` on one H200) of a
    smaller 8-layer model, the trainer called directly (median of its per-step rates)."""
    doc = json.loads((RESULTS / "launcher_h200.json").read_text())
    m = doc["model"]
    cfg = {
        "model_type": "mixtral",
        "vocab_size": m["vocab"],
        "hidden_size": m["hidden"],
        "intermediate_size": m["inter"],
        "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv_heads"],
        "head_dim": m["hidden"] // m["heads"],
        "max_position_embeddings": max(2048, m["seq"]),
        "num_local_experts": m["experts"],
        "num_experts_per_tok": m["top_k"],
        "tie_word_embeddings": False,
    }
    w = _planned_fast(spec_from_hf_config(cfg), m["seq"], m["batch"])
    tps = doc["medianDirectTokensPerSecond"]
    name = f"8 layers, hidden {m['hidden']}, seq {m['seq']} mb {m['batch']} (direct)"
    return [Case("launcher_h200.json", name, w, w.tokens_per_step / tps, None)]


def gpu_e2e_cases() -> list[Case]:
    """``benchmarks/gpu_e2e.sh``: the operator's GPU path on one H200 (the planner's plan of the
    3.4 B model; each job's worker and the same command started directly)."""
    out = []
    for path in sorted(RESULTS.glob("gpu_e2e_h200_run*/gpu_e2e.json")):
        doc = json.loads(path.read_text())
        shape = doc["shape"]
        spec = resolve_model(shape["model"]).spec
        w = _planned_fast(spec, shape["seqLen"], shape["microBatch"])
        name = f"{path.parent.name}/{path.name}"
        for key, run in doc.items():
            if not isinstance(run, dict) or key == "shape":
                continue
            tps = run.get("workerMedianTokensPerSecondAfterStep10") or run.get(
                "medianTokensPerSecondAfterStep10"
            )
            if tps:
                out.append(Case(name, key, w, w.tokens_per_step / tps, None))
    return out


def sweep_cases(path: Path) -> list[Case]:
    """Configurations measured by ``benchmarks/sizing_sweep.py`` (each with its workload)."""
    doc = json.loads(path.read_text())
    if doc.get("dryRun"):
        raise SystemExit(f"{path}: a --dry-run sweep (CPU timings of a tiny model): not used")
    out = []
    for i, r in enumerate(x for x in doc["cases"] if x.get("measured", {}).get("tokensPerSecond")):
        w = T.Workload(**r["workload"])
        seconds = w.tokens_per_step / r["measured"]["tokensPerSecond"]
        out.append(Case(path.name, r["name"], w, seconds, r["measured"].get("peakTflops")))
        if i % 2 == 0:
            FIT.add((path.name, r["name"]))
    return out


def fit(cases: list[Case], peak: float) -> T.Coefficients:
    link_cases = [c for c in cases if c.fit and c.a2a_measured and c.a2a_nominal]
    link = (
        statistics.mean(c.a2a_measured / c.a2a_nominal for c in link_cases) if link_cases else 1.0
    )
    names = [n for n in T.Coefficients.names() if n != "link"]
    fitted = [c for c in cases if c.fit]

    def residuals(x: np.ndarray) -> np.ndarray:
        coef = dict(zip(names, x, strict=True), link=link)
        res = []
        for c in fitted:
            n = c.workload.counts(peak * 1e12, coef["compute"])
            terms = T.step_terms(n, T.Coefficients(**coef))
            pred = T.StepTime(terms, c.workload.tokens_per_step, True, GPU)
            res.append(pred.seconds / c.measured_seconds - 1.0)
            if c.device_seconds:  # the profile separates device time from the host's
                res.append(pred.device / c.device_seconds - 1.0)
            if c.optimizer_seconds:  # and the optimizer's kernel from the rest
                res.append(terms["optimizer"] / c.optimizer_seconds - 1.0)
        return np.array(res)

    # start: compute at 50 % efficiency, small per-unit costs; all coefficients >= 0
    # compute >= 1: no plan runs faster than the measured peak matmul rate
    x0 = np.array([2.0, 1e-2, 1e-3, 1e-3, 1e-11, 1e-11, 1e-5])
    lower = np.array([1.0, 0, 0, 0, 0, 0, 0])
    sol = least_squares(residuals, x0, bounds=(lower, np.inf), x_scale=x0, method="trf")
    return T.Coefficients(**dict(zip(names, map(float, sol.x), strict=True)), link=float(link))


def report(cases: list[Case], cal: T.Calibration) -> dict[str, Any]:
    rows = []
    for c in cases:
        pred = T.predict(c.workload, GPU, cal)
        rows.append(
            {
                "file": c.file,
                "case": c.name,
                "fitted": c.fit,
                "measuredTokensPerSecond": round(c.workload.tokens_per_step / c.measured_seconds),
                "predictedTokensPerSecond": round(pred.tokens_per_second),
                "error": round(pred.seconds / c.measured_seconds - 1.0, 4),
                "terms": {k: round(v * 1e3, 3) for k, v in pred.terms.items()},
            }
        )

    def summary(sel: list[dict[str, Any]]) -> dict[str, Any]:
        errs = [abs(r["error"]) for r in sel]
        return {
            "cases": len(sel),
            "meanAbsError": round(statistics.mean(errs), 4) if errs else None,
            "maxAbsError": round(max(errs), 4) if errs else None,
        }

    link_rows = [
        {
            "file": c.file,
            "case": c.name,
            "fitted": c.fit,
            "measuredMs": round(c.a2a_measured * 1e3, 2),
            "predictedMs": round(c.a2a_nominal * cal.coefficients.link * 1e3, 2),
        }
        for c in cases
        if c.a2a_measured and c.a2a_nominal
    ]
    by_file = {
        f"{name} ({'fit' if fitted else 'held out'})": summary(
            [r for r in rows if r["file"] == name and r["fitted"] == fitted]
        )
        for name, fitted in sorted({(r["file"], r["fitted"]) for r in rows})
    }
    return {
        "cases": rows,
        "allToAll": link_rows,
        "fit": summary([r for r in rows if r["fitted"]]),
        "heldOut": summary([r for r in rows if not r["fitted"]]),
        "byFile": by_file,
    }


def markdown(cal: T.Calibration, rep: dict[str, Any]) -> str:
    c, fit, held = cal.coefficients, rep["fit"], rep["heldOut"]
    head = (
        "Command: `PYTHONPATH=operator .venv/bin/python benchmarks/sizing_calibrate.py "
        "--out benchmarks/results`. Model: `moejob_operator.core.throughput` (step time = "
        "max(device, host) + communication; docs/planning.md, Sizing). Fitted on the cases "
        "marked fit, checked on the rest (held out). Error = predicted / measured step time - 1."
    )
    coefs = (
        f"Peak (measured bf16 matmul, mean of the fitted runs): {cal.peak_tflops:.1f} TFLOP/s. "
        f"Compute efficiency 1/compute = {1 / c.compute:.3f}; host per step "
        f"{c.host_step * 1e3:.3f} ms, per layer pass compiled "
        f"{c.host_compiled * 1e3:.3f} ms, eager {c.host_eager * 1e3:.3f} ms; optimizer per "
        f"element fused {c.optimizer_fused * 1e12:.1f} ps, unfused "
        f"{c.optimizer_unfused * 1e12:.1f} ps; per fetched tensor {c.fetch * 1e6:.1f} us; link "
        f"(measured / nominal all-to-all) {c.link:.3f}."
    )
    errors = (
        f"Fitted: {fit['cases']} cases, mean |error| {fit['meanAbsError']:.1%}, max "
        f"{fit['maxAbsError']:.1%}. Held out: {held['cases']} cases, mean |error| "
        f"{held['meanAbsError']:.1%}, max {held['maxAbsError']:.1%}."
    )
    lines = ["# Throughput model calibration (H200)", "", head, "", coefs, "", errors, ""]
    lines += ["| file | cases | mean abs error | max abs error |", "|---|---|---|---|"]
    lines += [
        f"| {k} | {v['cases']} | {v['meanAbsError']:.1%} | {v['maxAbsError']:.1%} |"
        for k, v in rep["byFile"].items()
    ]
    lines += [""]
    lines += ["| file | case | fit/held out | measured tok/s | predicted tok/s | error |"]
    lines += ["|---|---|---|---|---|---|"]
    lines += [
        f"| {r['file']} | {r['case']} | {'fit' if r['fitted'] else 'held out'} | "
        f"{r['measuredTokensPerSecond']} | {r['predictedTokensPerSecond']} | {r['error']:+.1%} |"
        for r in rep["cases"]
    ]
    a2a = (
        "All-to-all per step on 2 GPUs (measured host-side time in the collective vs the cost "
        "model's nominal time x link):"
    )
    lines += ["", a2a, "", "| file | case | fit/held out | measured ms | predicted ms |"]
    lines += ["|---|---|---|---|---|"]
    lines += [
        f"| {r['file']} | {r['case']} | {'fit' if r['fitted'] else 'held out'} | "
        f"{r['measuredMs']} | {r['predictedMs']} |"
        for r in rep["allToAll"]
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--sweep", type=Path, action="append", default=[])
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    a = ap.parse_args(argv)
    cases = (
        mfu_cases()
        + userflow_cases()
        + multigpu_cases()
        + trainer_bench_cases()
        + launcher_cases()
        + gpu_e2e_cases()
    )
    for path in a.sweep:
        cases += sweep_cases(path)
    peaks = [c.peak_tflops for c in cases if c.fit and c.peak_tflops]
    peak = statistics.mean(peaks)
    coef = fit(cases, peak)
    fit_files = sorted({c.file for c in cases if c.fit})
    held_files = sorted({c.file for c in cases if not c.fit})
    cal = T.Calibration(GPU, round(peak, 1), coef, {})
    rep = report(cases, cal)
    cal = replace(
        cal,
        source={
            "command": "PYTHONPATH=operator .venv/bin/python benchmarks/sizing_calibrate.py "
            "--out benchmarks/results",
            "fittedFiles": fit_files,
            "heldOutFiles": held_files,
            "fit": rep["fit"],
            "heldOut": rep["heldOut"],
        },
    )
    a.fixture.write_text(json.dumps(cal.to_json(), indent=1) + "\n")
    a.out.mkdir(parents=True, exist_ok=True)
    full = {"calibration": cal.to_json(), **rep}
    (a.out / "sizing_calibration.json").write_text(json.dumps(full, indent=1) + "\n")
    (a.out / "sizing_calibration.md").write_text(markdown(cal, rep))
    print(markdown(cal, rep))
    print(json.dumps(asdict(coef)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
