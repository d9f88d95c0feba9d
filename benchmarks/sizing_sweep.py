"""GPU sweep for the sizing: measured peak memory and tokens/s of many configurations, beside the
planner's memory estimate and the throughput model's prediction, and the configuration ``Auto``
picks run like the others.

On one H200 (the lead; two calls of at most 9 minutes, each writes its part):

    python3 benchmarks/sizing_sweep.py --part 1 --out $OUT      # 3.4 B model, 8 configurations
    python3 benchmarks/sizing_sweep.py --part 2 --out $OUT      # 430 M, ~6 B models (+ Auto)
then, anywhere (no GPU), the report over both parts:
    python3 benchmarks/sizing_sweep.py --merge P1.json P2.json --out benchmarks/results
CPU (the whole script, a tiny model, seconds per configuration):
    .venv/bin/python benchmarks/sizing_sweep.py --dry-run --out /tmp/sweep

Every configuration runs through the trainer's real path, as ``benchmarks/mfu_bench.py`` does:
the planner builds the plan (``core.plan.build_plan`` on the H200's topology, the configuration's
micro-batch, sequence length, activation checkpointing and persistence threshold), the trainer
(``moe_trainer.trainer.Trainer``) builds the model and DeepSpeed engine from it and trains
``--warmup`` + ``--steps`` steps; tokens/s over the timed steps only, peak memory as the memory
model counts it (``torch.cuda.max_memory_reserved`` + what lives outside the caching allocator:
the CUDA context, NCCL, cuBLAS). One process per configuration: an out-of-memory leaves nothing
behind for the next one. A group is one (model, sequence length, global batch): the
configurations vary the micro-batch (global batch fixed, so gradient accumulation makes up the
rest), checkpointing and the persistence threshold (``planner``: the planner's, every parameter
persistent on one GPU; ``hf``: Hugging Face's ``10 x hidden``); ``Auto`` is the plan
``core.sizing.plan_sized`` makes for the group with those three fields left to it.

Writes ``OUT/sizing_sweep_h200_part<N>.json`` (after every configuration, so a run cut short
keeps what it measured) and, with ``--merge``, ``OUT/sizing_sweep_h200.{json,md}``: per case the
predicted and measured memory (goal: within +-10 % on at least 10 cases) and tokens/s, per group
the best configuration and whether Auto's pick reaches 0.9x its tokens/s, and whether any Auto pick
ran out of memory. ``benchmarks/sizing_calibrate.py --sweep OUT/sizing_sweep_h200.json`` refits
the throughput model with these runs (half fitted, half held out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("operator", "trainer_image", "benchmarks"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

GiB = 2**30
GRACE_S = 60.0  # how far past --budget-s a started case may run before it is stopped
TOPOLOGY = "single-h200"  # core fixture: one H200 (141 GB), as the lead's machine
# the larger model: the 3.4 B bench model with 14 decoder layers instead of 8 (~6 B parameters)
LARGE_LAYERS = 14
# group -> (model, seq, global batch, the part that runs Auto's pick for it or None)
GROUPS = {
    "3.4b-s2048": ("3.4b", 2048, 32, 1),
    "3.4b-s1024": ("3.4b", 1024, 64, None),
    "3.4b-s4096": ("3.4b", 4096, 16, None),
    "430m-s1024": ("430m", 1024, 64, 2),
    "6b-s2048": ("6b", 2048, 16, 2),
}
# (group, micro-batch, activation checkpointing, persistence, part), in the order they run
# (Auto's picks first); a part's time budget cuts from the end
CONFIGS = [
    ("3.4b-s2048", 8, False, "planner", 1),
    ("3.4b-s2048", 16, False, "planner", 1),
    ("3.4b-s2048", 4, False, "planner", 1),
    ("3.4b-s2048", 16, True, "planner", 1),
    ("3.4b-s2048", 8, False, "hf", 1),
    ("3.4b-s2048", 32, True, "planner", 1),
    ("430m-s1024", 16, False, "planner", 2),
    ("430m-s1024", 64, False, "planner", 2),
    ("6b-s2048", 2, False, "planner", 2),
    ("3.4b-s1024", 32, False, "planner", 2),
    ("3.4b-s4096", 4, False, "planner", 2),
    ("6b-s2048", 4, True, "planner", 2),
    ("430m-s1024", 16, False, "hf", 2),
]
# dry run: the same script on CPU with a tiny model
DRY_GROUPS = {"tiny-s64": ("tiny", 64, 8, 1)}
DRY_CONFIGS = [("tiny-s64", 2, False, "planner", 1), ("tiny-s64", 4, True, "hf", 1)]


# ---- plans and predictions --------------------------------------------------------------------


def resolve(model: str):
    from moejob_operator.core import models

    if model == "6b":
        cfg = {**models.preset_hf_config("bench-mixtral-3b"), "num_hidden_layers": LARGE_LAYERS}
        return models.ResolvedModel(
            models.spec_from_hf_config(cfg, "bench-mixtral-6b"), cfg, None, None
        )
    preset = {"3.4b": "bench-mixtral-3b", "430m": "bench-mixtral", "tiny": "tiny-mixtral"}[model]
    return models.resolve_model(preset)


def request(group: str, steps: int, groups: dict, *, micro=None, ckpt=False, persistence="planner"):
    from moejob_operator.core.plan import PlanRequest, TrainingOptions
    from moejob_operator.core.topology import load_topology

    model, seq, batch, _ = groups[group]
    resolved = resolve(model)
    overrides = None
    if persistence == "hf":
        h = resolved.spec.hidden_size
        overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 10 * h}}
    training = TrainingOptions(
        steps=steps,
        lr=3e-4,
        warmup_steps=1,
        checkpoint_every_steps=10**6,
        activation_checkpointing=ckpt,
    )
    return PlanRequest(
        "sweep",
        "default",
        resolved,
        [load_topology(TOPOLOGY)],
        global_batch=batch,
        seq_len=seq,
        micro_batch=micro,
        training=training,
        ds_overrides=overrides,
    )


def auto_pick(group: str, steps: int, groups: dict) -> tuple[int, bool, str]:
    """(micro-batch, checkpointing, persistence) the sizing picks for the group on one H200."""
    from moejob_operator.core import sizing

    auto = sizing.AutoFields(micro_batch=True, activation_checkpointing=True, persistence=True)
    plan = sizing.plan_sized(request(group, steps, groups), auto)
    chosen = plan.document["sizing"]["chosen"]
    persistence = chosen["persistence"]
    return chosen["microBatch"], chosen["activationCheckpointing"], persistence


def case_doc(group, micro, ckpt, persistence, steps, groups, dry, auto=False) -> dict[str, Any]:
    """The case: its plan (what the trainer runs), the estimate and the prediction."""
    from moejob_operator.core import sizing
    from moejob_operator.core.plan import build_plan

    req = request(group, steps, groups, micro=micro, ckpt=ckpt, persistence=persistence)
    cand = sizing.evaluate(req)
    model, seq, batch, _ = groups[group]
    out: dict[str, Any] = {
        "name": f"{group} mb{micro} {'ckpt' if ckpt else 'no-ckpt'} {persistence}",
        "group": group,
        "model": model,
        "seqLen": seq,
        "globalBatch": batch,
        "microBatch": micro,
        "gradAccum": batch // micro,
        "activationCheckpointing": ckpt,
        "persistence": persistence,
        "autoPick": auto,
        "predicted": {
            "peakBytes": cand.peak_bytes,
            "fits": cand.rejected is None,
            "tokensPerSecond": cand.tokens_per_second,
            "stepSeconds": cand.step.seconds if cand.step else None,
            "bound": cand.step.bound if cand.step else None,
            "terms": cand.step.terms if cand.step else None,
        },
        "workload": asdict(cand.workload) if cand.workload else None,
    }
    if cand.rejected is None or dry:
        req_run = req
        if dry:  # run it on CPU: gloo, fp32 (the estimate above is the GPU plan's)
            req_run = replace(req, device="cpu", topology=None, cpu_memory_bytes=0)
        doc = json.loads(json.dumps(build_plan(req_run).document))
        if dry:  # the GPU plan's speed choices, on CPU (as mfu_bench --tiny): compiled layers
            # (aot_eager), ZeRO-3 leaf layers, fused loss; with checkpointing they run together
            doc["deepspeed"].pop("expert_parallel", None)
            doc["training"]["moeImpl"] = "hf"
            doc["training"]["performance"] = {
                "fusedOptimizer": True,
                "fusedLoss": True,
                "lossChunkTokens": 48,
                "zeroLeafModules": ["MixtralDecoderLayer"],
                "compileLayers": True,
            }
        out["plan"] = doc
    return out


# ---- the worker: one configuration in its own process -------------------------------------------


def worker(case_path: Path, result_path: Path, warmup: int, steps: int) -> int:
    import torch

    import bench_common
    from moe_contracts.plan import parse_plan
    from moe_trainer import distenv
    from moe_trainer.trainer import Trainer

    bench_common.env_single(bench_common.free_port())
    case = json.loads(case_path.read_text())
    plan = parse_plan(case["plan"])
    cuda = plan.device == "cuda"
    peak = bench_common.matmul_peak_tflops(torch) if cuda else None
    env = distenv.read_env(plan.world_size, [r.gpu for r in plan.ranks], force_cpu=not cuda)
    distenv.init_distributed(env)
    marks: dict[int, float] = {}
    out: dict[str, Any] = {"peakTflops": peak}
    try:
        trainer = Trainer(plan, env, None)
        trainer.build()

        def on_step(step: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            marks[step] = time.perf_counter()

        trainer.on_step = on_step
        torch.manual_seed(0)
        marks[0] = time.perf_counter()
        code = trainer.run()
        timed = (marks[warmup + steps] - marks[warmup]) / steps
        t = plan.training
        tokens = t.micro_batch * t.seq_len * t.grad_accum * plan.world_size
        out.update(exit=code, stepSeconds=timed, tokensPerSecond=tokens / timed, oom=False)
    except torch.cuda.OutOfMemoryError as exc:
        out.update(oom=True, error=str(exc)[:500])
    out.update(bench_common.gpu_memory(torch) if cuda else {})
    result_path.write_text(json.dumps(out))
    return 3 if out.get("oom") else 0


# ---- orchestration ------------------------------------------------------------------------------


def run_case(case: dict, work: Path, args, timeout: float) -> dict:
    case_path = work / f".case-{abs(hash(case['name']))}.json"
    res_path = case_path.with_suffix(".result.json")
    case_path.write_text(json.dumps(case))
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(case_path),
        "--result",
        str(res_path),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = "timeout", str(exc)
    wall = time.perf_counter() - t0
    measured: dict[str, Any] = {"wallSeconds": round(wall, 1)}
    if res_path.exists():
        measured.update(json.loads(res_path.read_text()))
        res_path.unlink()
    if rc not in (0, 3):
        measured["error"] = f"exit {rc}"
        measured["logTail"] = log[-3000:]
    case_path.unlink(missing_ok=True)
    return measured


def summarize(cases: list[dict]) -> dict[str, Any]:
    mem, by_group = [], {}
    for c in cases:
        m = c.get("measured") or {}
        p = c["predicted"]
        if m.get("peakDeviceBytes") and p.get("peakBytes") and not m.get("oom"):
            c["memoryRatio"] = round(p["peakBytes"] / m["peakDeviceBytes"], 4)
            mem.append(c["memoryRatio"])
        if m.get("tokensPerSecond") and p.get("tokensPerSecond"):
            c["tokensRatio"] = round(m["tokensPerSecond"] / p["tokensPerSecond"], 4)
        by_group.setdefault(c["group"], []).append(c)
    groups = {}
    for g, cs in by_group.items():
        ran = [c for c in cs if (c.get("measured") or {}).get("tokensPerSecond")]
        best = max(ran, key=lambda c: c["measured"]["tokensPerSecond"], default=None)
        picks = [c for c in cs if c.get("autoPick")]
        pick = picks[0] if picks else None
        out: dict[str, Any] = {"configurations": len(cs), "measured": len(ran)}
        if best is not None:
            out["best"] = best["name"]
            out["bestTokensPerSecond"] = round(best["measured"]["tokensPerSecond"])
        if pick is not None:
            pm = pick.get("measured") or {}
            out["autoPick"] = pick["name"]
            out["autoPickOom"] = bool(pm.get("oom"))
            if pm.get("tokensPerSecond") and best is not None:
                ratio = pm["tokensPerSecond"] / best["measured"]["tokensPerSecond"]
                out["autoVsBest"] = round(ratio, 4)
                out["autoReaches0.9xBest"] = ratio >= 0.9
        groups[g] = out
    within = [r for r in mem if abs(r - 1) <= 0.10]
    return {
        "memoryCases": len(mem),
        "memoryWithin10pct": len(within),
        "memoryGoalMet": len(within) >= 10,
        "anyAutoPickOom": any(g.get("autoPickOom") for g in groups.values()),
        "groups": groups,
    }


def markdown(doc: dict) -> str:
    s = doc["summary"]
    lines = [
        f"# Sizing sweep ({doc.get('device')})",
        "",
        (
            "Command: `python3 benchmarks/sizing_sweep.py --part 1|2 --out DIR` on one H200, "
            "then `--merge`. Each configuration: the planner's plan run by the trainer in its own "
            f"process, {doc.get('warmup')} warm-up + {doc.get('steps')} timed steps; predicted "
            "memory = the planner's estimate, measured = peak reserved + outside the allocator; "
            "predicted tokens/s = the throughput model (core.throughput)."
        ),
        "",
        (
            f"Memory within +-10%: {s['memoryWithin10pct']} of {s['memoryCases']} cases (goal: "
            f"10). Any Auto pick out of memory: {'yes' if s['anyAutoPickOom'] else 'no'}."
        ),
        "",
        "| case | Auto | est. GiB | meas. GiB | est/meas | pred. tok/s | meas. tok/s | meas/pred |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in doc["cases"]:
        m, p = c.get("measured") or {}, c["predicted"]
        meas_mem = m.get("peakDeviceBytes")
        lines.append(
            f"| {c['name']} | {'yes' if c.get('autoPick') else ''} | "
            f"{p['peakBytes'] / GiB:.1f} | "
            + (f"{meas_mem / GiB:.1f}" if meas_mem else "-")
            + f" | {c.get('memoryRatio', '-')} | {p['tokensPerSecond']:,.0f} | "
            + (
                "OOM"
                if m.get("oom")
                else f"{m['tokensPerSecond']:,.0f}"
                if m.get("tokensPerSecond")
                else m.get("error", "not run")
            )
            + f" | {c.get('tokensRatio', '-')} |"
        )
    lines += [
        "",
        "| group | best (measured) | tok/s | Auto's pick | Auto / best |",
        "|---|---|---|---|---|",
    ]
    for g, v in s["groups"].items():
        lines.append(
            f"| {g} | {v.get('best', '-')} | {v.get('bestTokensPerSecond', '-')} | "
            f"{v.get('autoPick', '-')}{' (OOM)' if v.get('autoPickOom') else ''} | "
            f"{v.get('autoVsBest', '-')} |"
        )
    return "\n".join(lines) + "\n"


def run_part(args) -> dict:
    groups, configs = (DRY_GROUPS, DRY_CONFIGS) if args.dry_run else (GROUPS, CONFIGS)
    if args.dry_run:
        os.environ.setdefault("MOE_COMPILE_BACKEND", "aot_eager")  # no C++/Triton build on CPU
    part = 1 if args.dry_run else args.part
    total = args.warmup + args.steps
    mine = [c[:4] for c in configs if c[4] == part]
    todo: list[dict] = []
    picks = {g: auto_pick(g, total, groups) for g, v in groups.items() if v[3] == part}
    for g, pick in picks.items():  # Auto's picks first: the measurements that matter most
        if (g, *pick) not in mine:
            todo.append(case_doc(g, *pick, total, groups, args.dry_run, auto=True))
    todo += [case_doc(*c, total, groups, args.dry_run, auto=picks.get(c[0]) == c[1:]) for c in mine]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "part": part,
        "dryRun": args.dry_run,
        "warmup": args.warmup,
        "steps": args.steps,
        "topology": TOPOLOGY,
        "cases": [],
    }
    try:
        import torch

        doc["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        doc["torch"] = torch.__version__
    except ImportError:
        doc["device"] = None
    deadline = time.monotonic() + args.budget_s
    path = out_dir / f"sizing_sweep_h200_part{part}.json"
    last = 0.0
    for case in todo:
        left = deadline - time.monotonic()
        print(f"== {case['name']}{' (Auto)' if case['autoPick'] else ''}", flush=True)
        if "plan" not in case:
            case["measured"] = {"error": "not run: the memory estimate says it does not fit"}
        elif left < max(30.0, 1.2 * last):
            case["measured"] = {"error": "not run: time budget spent"}
        else:
            t0 = time.monotonic()
            # a case may run past the budget by at most GRACE_S (the call's own limit)
            timeout = min(args.case_timeout, left + GRACE_S)
            case["measured"] = run_case(case, out_dir, args, timeout)
            last = time.monotonic() - t0
        case.pop("plan", None)
        m = case["measured"]
        print(
            f"   est {case['predicted']['peakBytes'] / GiB:.1f} GiB, "
            f"pred {case['predicted']['tokensPerSecond']:,.0f} tok/s | measured "
            + (
                f"{m.get('peakDeviceBytes', 0) / GiB:.1f} GiB, {m['tokensPerSecond']:,.0f} tok/s"
                if m.get("tokensPerSecond")
                else str(m.get("error") or ("OOM" if m.get("oom") else "?"))
            ),
            flush=True,
        )
        doc["cases"].append(case)
        path.write_text(json.dumps(doc, indent=1))
    return doc


def merge(paths: list[Path], out: Path) -> dict:
    parts = [json.loads(p.read_text()) for p in paths]
    doc = {
        "device": next((p.get("device") for p in parts if p.get("device")), None),
        "torch": next((p.get("torch") for p in parts if p.get("torch")), None),
        "warmup": parts[0].get("warmup"),
        "steps": parts[0].get("steps"),
        "dryRun": any(p.get("dryRun") for p in parts),
        "parts": [p.get("part") for p in parts],
        "cases": [c for p in parts for c in p["cases"]],
    }
    doc["summary"] = summarize(doc["cases"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "sizing_sweep_h200.json").write_text(json.dumps(doc, indent=1))
    (out / "sizing_sweep_h200.md").write_text(markdown(doc))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/sizing_sweep")
    ap.add_argument("--part", type=int, choices=(1, 2), default=1)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, the whole script")
    ap.add_argument("--merge", nargs="+", type=Path, help="part JSONs -> the report")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no case after this; a started one is stopped 60 s past it (a 9-minute call "
        "holds the default with room for start-up)",
    )
    ap.add_argument("--case-timeout", type=float, default=240.0)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.result, args.warmup, args.steps)
    if args.merge:
        doc = merge(args.merge, Path(args.out))
        print(markdown(doc))
        return 0
    doc = run_part(args)
    if args.dry_run:
        path = Path(args.out) / "sizing_sweep_h200_part1.json"
        doc = merge([path], Path(args.out))
        print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
