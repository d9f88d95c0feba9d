"""Fine-tune a pretrained checkpoint on one GPU machine through the user's entry points, and
export it; the same run from random initialisation beside it.

1. ``moe-discover`` (real NVML) -> ``topology.json``;
2. a multi-GB checkpoint of the 3.4 B benchmark model (preset ``bench-mixtral-3b``: hidden 2048,
   expert FFN 4096, 16 experts top-2, 8 layers; bf16, 6.8 GB) written with transformers'
   ``save_pretrained`` (seeded initialisation, in a subprocess so its GPU memory is released);
3. training text: real text from this machine (the repository's docs and the installed Python
   packages' sources, ``--text-mb`` MB) as ``data.kind: text`` with the byte tokenizer. (The
   issue asks for a JSONL dataset; the data-prepare program for JSONL/Parquet is another change
   and was not on main when this was written, so the existing text kind is used);
4. ``moectl plan --model <checkpoint dir> --export <dir>`` and ``moe-train`` (the node launcher,
   one rank per GPU): load the checkpoint (partitioned, streamed), ``--steps`` optimizer steps,
   export at the end;
5. ``moectl plan --model bench-mixtral-3b`` and ``moe-train``: the same shape and data from a
   seeded random initialisation;
6. optionally (``--verify``, default on) the export is loaded with
   ``AutoModelForCausalLM.from_pretrained`` on the GPU and its logits compared with the trained
   model's (the trainer's ``MOE_TEST_LOGITS_DIR`` hook; bf16, so the difference is reported, not
   asserted).

No checkpoint directory is given to ``moe-train`` (a 3.4 B model's ZeRO-3 checkpoint with Adam
states is ~48 GB; the machine's disk is 64 GiB), so neither run writes checkpoints.

Writes ``--out`` (default ``benchmarks/results/finetune_h200.json``): time to the first step
(from the launcher's start to the trainer's "step 1/N" log line) and the median tokens/s after
step 10 of both runs and their ratio, the checkpoint's load time and bytes, the export's time,
bytes and files, exit codes, versions. The work directory (checkpoint, export, logs) is deleted
unless ``--keep``.

    python benchmarks/finetune_gpu.py                        # ~7 min on one H200
    python benchmarks/finetune_gpu.py --steps 40 --keep --work /data/ft
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = "bench-mixtral-3b"
STAMP = "%Y-%m-%d %H:%M:%S,%f"


def env_with_path() -> dict[str, str]:
    pp = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_image")])
    return dict(os.environ, PYTHONPATH=pp + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 1800) -> dict:
    t0, wall0 = time.perf_counter(), dt.datetime.now()
    with open(log, "w") as f:
        code = subprocess.call(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env or env_with_path(), timeout=timeout
        )
    return {"exit": code, "seconds": round(time.perf_counter() - t0, 1), "start": wall0}


MAKE_CHECKPOINT = """
import sys, time, torch
sys.path[:0] = sys.argv[3:5]
from moejob_operator.core.models import preset_hf_config
from moe_trainer.model import models
cfg = preset_hf_config(sys.argv[1])
t0 = time.perf_counter()
m = models.build_model(cfg, seed=1234, dtype=torch.bfloat16, device="cuda")
t1 = time.perf_counter()
m.save_pretrained(sys.argv[2], max_shard_size="2GB")
print(f"built {t1 - t0:.1f}s saved {time.perf_counter() - t1:.1f}s")
"""


def write_text(path: Path, megabytes: int) -> int:
    """Real text available offline: the repository's docs, then Python sources of site-packages."""
    import site

    roots = [ROOT / "docs", ROOT / "README.md", *map(Path, site.getsitepackages())]
    budget, written = megabytes << 20, 0
    with open(path, "w") as out:
        for root in roots:
            files = (
                [root]
                if root.is_file()
                else sorted(root.rglob("*.md")) + sorted(root.rglob("*.py"))
            )
            for f in files:
                try:
                    text = f.read_text(errors="ignore")
                except OSError:
                    continue
                out.write(text + "\n\n")
                written += len(text)
                if written >= budget:
                    return written
    return written


def parse_log(log: Path, start: dt.datetime) -> dict:
    text = log.read_text(errors="replace")
    rates = {
        int(n): float(r) for n, r in re.findall(r"step (\d+)/\d+ loss .*? ([\d.]+) tok/s", text)
    }
    losses = [float(x) for x in re.findall(r"step \d+/\d+ loss ([\d.]+)", text)]
    steady = sorted(r for n, r in rates.items() if n > 10)
    first = re.search(r"^(?:\[rank\d+\] )?(\S+ \S+) rank0 INFO step 1/", text, re.MULTILINE)
    loaded = re.search(
        r"loaded (\d+) tensors from .*?: ([\d.]+) MiB read by rank 0 in ([\d.]+)s", text
    )
    exported = re.search(
        r"exported step (\d+) to .*?: ([\d.]+) MiB in (\d+) file\(s\), ([\d.]+)s", text
    )
    return {
        "timeToFirstStepSeconds": (
            round((dt.datetime.strptime(first.group(1), STAMP) - start).total_seconds(), 1)
            if first
            else None
        ),
        "stepsLogged": len(rates),
        "medianTokensPerSecondAfterStep10": steady[len(steady) // 2] if steady else None,
        "firstLoss": losses[0] if losses else None,
        "lastLoss": losses[-1] if losses else None,
        "performanceOptions": re.findall(r"performance options: (.*)", text),
        "load": (
            {
                "tensors": int(loaded.group(1)),
                "mibRead": float(loaded.group(2)),
                "seconds": float(loaded.group(3)),
            }
            if loaded
            else None
        ),
        "export": (
            {
                "step": int(exported.group(1)),
                "mib": float(exported.group(2)),
                "files": int(exported.group(3)),
                "seconds": float(exported.group(4)),
            }
            if exported
            else None
        ),
        "errors": re.findall(r"ERROR (.*)", text)[-3:],
    }


def train(plan: Path, log: Path, gpus: int, logits: Path | None = None) -> dict:
    env = env_with_path()
    env.update(
        NODE_RANK="0",
        NNODES="1",
        NPROC_PER_NODE=str(gpus),
        WORLD_SIZE=str(gpus),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29531",
    )
    env.pop("MOE_CHECKPOINT_DIR", None)
    if logits is not None:
        logits.mkdir(exist_ok=True)
        env["MOE_TEST_LOGITS_DIR"] = str(logits)
    r = run([sys.executable, "-m", "moe_trainer.train", "--plan", str(plan)], log, env)
    r.update(parse_log(log, r.pop("start")))
    return r


def verify(export: Path, logits: Path) -> dict:
    """The export's logits (transformers, GPU, bf16) against the trainer's final ones."""
    code = """
import sys, torch
from transformers import AutoModelForCausalLM
want = torch.load(sys.argv[2])
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map="cuda")
m.eval()
with torch.no_grad():
    got = m(input_ids=want["input_ids"].cuda()).logits.float().cpu()
print((got - want["logits"]).abs().max().item() / want["logits"].abs().max().item())
"""
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", code, str(export), str(logits / "final.pt")],
        capture_output=True,
        text=True,
        env=env_with_path(),
        timeout=900,
    )
    out = p.stdout.strip().splitlines()
    return {
        "exit": p.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "maxRelativeLogitDifferenceBf16": float(out[-1]) if p.returncode == 0 and out else None,
        "stderrTail": p.stderr[-1500:] if p.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/finetune_h200.json"))
    ap.add_argument("--work", help="working directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--text-mb", type=int, default=64)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep checkpoint, export and logs")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="finetune_"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    result: dict = {
        "benchmark": "finetune_gpu",
        "command": "python benchmarks/finetune_gpu.py",
        "preset": PRESET,
        "steps": args.steps,
        "seqLen": args.seq_len,
        "microBatch": args.micro_batch,
        "data": "text (byte tokenizer; JSONL data preparation was not on main when written)",
    }
    t_all = time.perf_counter()
    try:
        r = run(
            [
                py,
                "-m",
                "moe_trainer.discovery.main",
                "--no-stdout",
                "-o",
                str(work / "topology.json"),
            ],
            work / "discover.log",
        )
        result["discover"] = {k: r[k] for k in ("exit", "seconds")}
        topo = json.loads((work / "topology.json").read_text())
        gpus = len(topo["gpus"])
        result["gpus"], result["gpu"] = gpus, topo["gpus"][0].get("name")
        ckpt = work / "checkpoint"
        r = run(
            [
                py,
                "-c",
                MAKE_CHECKPOINT,
                PRESET,
                str(ckpt),
                str(ROOT / "operator"),
                str(ROOT / "trainer_image"),
            ],
            work / "checkpoint.log",
        )
        files = sorted(ckpt.glob("*.safetensors"))
        result["checkpoint"] = {
            "exit": r["exit"],
            "seconds": r["seconds"],
            "bytes": sum(f.stat().st_size for f in files),
            "shards": len(files),
            "log": (work / "checkpoint.log").read_text()[-300:],
        }
        text = work / "train.txt"
        result["textBytes"] = write_text(text, args.text_mb)
        data = json.dumps({"kind": "text", "path": str(text)})
        common = [
            "--topology",
            str(work / "topology.json"),
            "--steps",
            str(args.steps),
            "--seq-len",
            str(args.seq_len),
            "--global-batch",
            str(args.micro_batch * gpus),
            "--micro-batch",
            str(args.micro_batch),
            "--checkpoint-every",
            str(10 * args.steps),
            "--data",
            data,
        ]
        plans = {}
        for name, model, extra in (
            ("pretrained", str(ckpt), ["--export", str(work / "export")]),
            ("random", PRESET, []),
        ):
            plans[name] = work / f"plan-{name}.json"
            r = run(
                [
                    py,
                    "-m",
                    "moejob_operator.cli",
                    "plan",
                    "--model",
                    model,
                    *common,
                    *extra,
                    "-o",
                    str(plans[name]),
                ],
                work / f"plan-{name}.txt",
            )
            result.setdefault("plan", {})[name] = r["exit"]
        result["pretrained"] = train(
            plans["pretrained"], work / "train-pretrained.log", gpus, work / "logits"
        )
        if (work / "export" / "export.json").is_file():
            doc = json.loads((work / "export" / "export.json").read_text())
            result["export"] = {k: doc[k] for k in ("bytes", "sha256", "step")} | {
                "files": len(doc["files"])
            }
        if not args.no_verify and (work / "logits" / "final.pt").is_file():
            result["verify"] = verify(work / "export", work / "logits")
        shutil.rmtree(work / "export", ignore_errors=True)  # room on the disk
        result["random"] = train(plans["random"], work / "train-random.log", gpus)
        a = result["pretrained"]["medianTokensPerSecondAfterStep10"]
        b = result["random"]["medianTokensPerSecondAfterStep10"]
        result["tokensPerSecondPretrainedVsRandom"] = round(a / b, 3) if a and b else None
    finally:
        result["totalSeconds"] = round(time.perf_counter() - t_all, 1)
        result["ok"] = bool(
            result.get("pretrained", {}).get("exit") == 0
            and result.get("random", {}).get("exit") == 0
            and result.get("export")
        )
        try:
            import deepspeed
            import torch
            import transformers

            result["versions"] = {
                "torch": torch.__version__,
                "deepspeed": deepspeed.__version__,
                "transformers": transformers.__version__,
            }
        except ImportError:
            pass
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                k: result.get(k)
                for k in ("ok", "totalSeconds", "export", "tokensPerSecondPretrainedVsRandom")
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
