"""The worker pod's entry point vs the trainer called directly: one GPU, same plan, interleaved.

    H200:    PYTHONPATH=operator:trainer_image python3 benchmarks/launcher_bench.py \\
                 --out benchmarks/results
    CPU dry: PYTHONPATH=operator:trainer_image python3 benchmarks/launcher_bench.py --tiny \\
                 --out /tmp/lb

The plan comes from `moectl plan` (in-process: `moejob_operator.cli.main`) for the single-H200
topology fixture (CPU: `--cpu`, one process). Each round runs the trainer twice, in alternating
order, same plan, seed and synthetic data:
- "launcher": `python -m moe_trainer.train` with a worker pod's env (NODE_RANK, NNODES,
  NPROC_PER_NODE=1, WORLD_SIZE, MASTER_*; no RANK): `moe-train` as the node launcher
  (moe_trainer.launch.node_main), which starts the rank as its child and pipes its output;
- "direct": the same command with RANK/LOCAL_RANK/WORLD_SIZE set: the trainer itself.
Steady tokens/s per run = median of the trainer's per-step rate (rank 0's log) after the warm-up
steps; the ratio is median(launcher) / median(direct). Writes launcher_<tag>.{json,md}.

Model (GPU): Mixtral-style, hidden 1024, intermediate 2048, 8 experts top-2, 8 layers, 16 / 4
heads, vocab 32000, seq 2048, micro-batch 8, bf16, ZeRO-3 + AutoEP (EP 1), no checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("operator", "trainer_image"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_common import free_port

STEP_LINE = re.compile(r"step (\d+)/\d+ loss \S+ aux \S+ (\d+) tok/s")
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
FULL = dict(
    hidden=1024,
    inter=2048,
    experts=8,
    top_k=2,
    layers=8,
    heads=16,
    kv_heads=4,
    vocab=32000,
    seq=2048,
    batch=8,
    steps=40,
    warmup=10,
)
TINY = dict(
    hidden=64,
    inter=128,
    experts=4,
    top_k=2,
    layers=2,
    heads=4,
    kv_heads=2,
    vocab=320,
    seq=64,
    batch=2,
    steps=12,
    warmup=4,
)


def model_config(m: dict) -> dict:
    return {
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
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "router_aux_loss_coef": 0.01,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
    }


def make_plan(work: Path, m: dict, cpu: bool) -> Path:
    """The plan `moectl plan` writes (same function as the console script)."""
    from moejob_operator.cli import main as moectl

    cfg, plan = work / "config.json", work / "plan.json"
    cfg.write_text(json.dumps(model_config(m)))
    where = (
        ["--cpu", "--nodes", "bench-node", "--procs-per-node", "1"]
        if cpu
        else ["--topology", "single-h200@bench-node"]
    )
    code = moectl(
        [
            "plan",
            *where,
            "--model",
            str(cfg),
            "--seq-len",
            str(m["seq"]),
            "--global-batch",
            str(m["batch"]),
            "--micro-batch",
            str(m["batch"]),
            "--steps",
            str(m["steps"]),
            "--checkpoint-every",
            str(10 * m["steps"]),
            "--data",
            json.dumps({"kind": "synthetic"}),
            "--job",
            "launcher-bench",
            "-o",
            str(plan),
        ]
    )
    if code != 0:
        raise SystemExit(f"moectl plan exited {code}")
    doc = json.loads(plan.read_text())
    doc["training"].pop("checkpointDir", None)  # no checkpoints: they are not what is measured
    plan.write_text(json.dumps(doc))
    return plan


def run_once(
    mode: str, plan: Path, work: Path, tag: str, cpu: bool, warmup: int, timeout: float
) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "NPROC_PER_NODE",
            "MOE_CHECKPOINT_DIR",
            "MOE_PROGRESS_CONFIGMAP",
            "MOE_ROUTING_STATS_CONFIGMAP",
            "MOE_METRICS_PORT",
        )
    }
    env.update(
        NO_MULTICAST,
        MOE_PLAN=str(plan),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
        MOE_TERMINATION_LOG=str(work / f"termination-{tag}.log"),
    )
    if mode == "launcher":  # a worker pod's env: moe-train is the node launcher
        env.update(NODE_RANK="0", NNODES="1", NPROC_PER_NODE="1", WORLD_SIZE="1")
    else:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    cmd = [sys.executable, "-m", "moe_trainer.train", *(["--cpu"] if cpu else [])]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    log = r.stdout + r.stderr
    (work / f"log-{tag}.txt").write_text(log)
    steps = [(int(a), float(b)) for a, b in STEP_LINE.findall(log)]
    out = {
        "mode": mode,
        "exitCode": r.returncode,
        "wallSeconds": round(wall, 1),
        "steps": len(steps),
        "prefixedLines": sum(x.startswith("[rank0] ") for x in log.splitlines()),
    }
    steady = [tps for s, tps in steps if s > warmup]
    if r.returncode != 0 or not steady:
        out["logTail"] = log[-3000:]
        return out
    out["tokensPerSecond"] = round(statistics.median(steady), 1)
    return out


def markdown(res: dict) -> str:
    rows = [
        f"| {i + 1} | {' / '.join(r['order'])} | {r['launcher'].get('tokensPerSecond', 'failed')} "
        "| "
        f"{r['direct'].get('tokensPerSecond', 'failed')} | {r.get('ratio', '-')} |"
        for i, r in enumerate(res["rounds"])
    ]
    m = res["model"]
    return "\n".join(
        [
            f"# Launcher overhead ({res['tag']})",
            "",
            f"Command: `{res['command']}`  ",
            (
                f"Device: {res['device']}; model: hidden {m['hidden']}, "
                f"intermediate {m['inter']}, {m['experts']} experts top-{m['top_k']}, "
                f"{m['layers']} layers, seq "
                f"{m['seq']}, micro-batch {m['batch']}, {m['steps']} steps ({m['warmup']} "
                "warm-up), plan from "
                f"`moectl plan` ({res['planDevice']}, {res['precision']})."
            ),
            "",
            "| round | order | launcher tok/s | direct tok/s | launcher / direct |",
            "|---|---|---|---|---|",
            *rows,
            "",
            (
                f"**Median launcher / direct: {res['ratio']}** (goal: >= 0.97). Launcher runs "
                "printed "
                f"their rank's lines with the `[rank0] ` prefix: {res['launcherPrefixed']}."
            ),
            "",
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for launcher_<tag>.{json,md}")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (dry run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, help="steps per run (default: 40 GPU, 12 tiny)")
    ap.add_argument("--tag", help="default: h200 on a GPU, cpu-dry with --tiny")
    ap.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    a = ap.parse_args(argv)
    import torch

    cpu = a.tiny or not torch.cuda.is_available()
    m = dict(TINY if a.tiny else FULL)
    if a.steps:
        m["steps"] = a.steps
        m["warmup"] = min(m["warmup"], a.steps // 3)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or ("cpu-dry" if cpu else "h200")
    work = Path(tempfile.mkdtemp(prefix="launcher-bench-"))
    plan = make_plan(work, m, cpu)
    rounds = []
    for i in range(a.rounds):
        order = ("launcher", "direct") if i % 2 == 0 else ("direct", "launcher")
        rnd = {"order": list(order)}
        for mode in order:
            rnd[mode] = run_once(mode, plan, work, f"{i}-{mode}", cpu, m["warmup"], a.timeout)
            print(
                f"round {i + 1} {mode}: {rnd[mode].get('tokensPerSecond', 'FAILED')} tok/s "
                f"(exit {rnd[mode]['exitCode']}, {rnd[mode]['wallSeconds']} s)",
                flush=True,
            )
        if "tokensPerSecond" in rnd["launcher"] and "tokensPerSecond" in rnd["direct"]:
            rnd["ratio"] = round(
                rnd["launcher"]["tokensPerSecond"] / rnd["direct"]["tokensPerSecond"], 4
            )
        rounds.append(rnd)
    ok = [r for r in rounds if "ratio" in r]
    lau = [r["launcher"]["tokensPerSecond"] for r in ok]
    dire = [r["direct"]["tokensPerSecond"] for r in ok]
    res = {
        "tag": tag,
        "command": " ".join(["python3", "benchmarks/launcher_bench.py", *(argv or sys.argv[1:])]),
        "device": torch.cuda.get_device_name(0)
        if not cpu
        else f"CPU ({platform.processor() or 'x86_64'})",
        "planDevice": "cpu" if cpu else "single-h200 topology",
        "precision": "fp32" if cpu else "bf16",
        "torch": torch.__version__,
        "model": m,
        "rounds": rounds,
        "medianLauncherTokensPerSecond": statistics.median(lau) if lau else None,
        "medianDirectTokensPerSecond": statistics.median(dire) if dire else None,
        "launcherPrefixed": all(r["launcher"]["prefixedLines"] > 0 for r in rounds),
        "logs": str(work),
    }
    res["ratio"] = (
        round(res["medianLauncherTokensPerSecond"] / res["medianDirectTokensPerSecond"], 4)
        if ok
        else None
    )
    (out / f"launcher_{tag}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"launcher_{tag}.md").write_text(markdown(res))
    print(
        f"launcher / direct tokens/s: {res['ratio']} (median of {len(ok)} rounds; "
        f"{res['medianLauncherTokensPerSecond']} vs {res['medianDirectTokensPerSecond']})"
    )
    print(f"wrote {out / f'launcher_{tag}.json'} and .md")
    return 0 if len(ok) == a.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
