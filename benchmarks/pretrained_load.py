"""Host memory of loading a pretrained checkpoint: 2 CPU ranks, a >= 4 GB safetensors checkpoint.

Writes a Mixtral-style checkpoint (fp32, ~5.2 GB, shards of at most 1 GiB, the per-expert
tensor names ``save_pretrained`` uses) tensor by tensor, then starts 2 gloo ranks that each
build the model the way the trainer does for a plan with ``model.path``
(``moe_trainer.model.model_setup.prepare``: ZeRO-3 ``zero.Init`` without initialisation, the
checkpoint streamed into the partitions with a non-identity placement) and record

* ``rssBeforeBytes``: resident memory after the imports and the process group (the baseline),
* ``peakRssBytes``: the process's peak resident memory (``ru_maxrss``) once loading is done,
* ``partitionBytes``: the rank's ZeRO-3 partitions (what it must hold),
* ``boundBytes`` = partition + the largest shard + 2 GiB, and whether the peak stays under it.

The checkpoint is deleted afterwards (``--keep`` keeps it). ``deepspeed.initialize`` (the
optimizer's fp32 master and Adam states: training memory, not loading) is not part of it.

    python benchmarks/pretrained_load.py --out benchmarks/results/pretrained_load_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "trainer_image")]

GiB = 1 << 30
HF_CONFIG = {
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.0,
}
WORLD = 2
SHARD_BYTES = 1 << 30


def write_checkpoint(out: Path) -> dict:
    """The checkpoint, one tensor in memory at a time (seeded values)."""
    import torch

    from moe_trainer import families
    from moe_trainer.model import models
    from moe_trainer.model.export import _disk_tensors, _ShardWriter, hf_tensor_names

    fam = families.get("mixtral")
    out.mkdir(parents=True)
    writer = _ShardWriter(out, torch.float32, SHARD_BYTES)
    g = torch.Generator().manual_seed(0)
    params = 0
    for name, shape in hf_tensor_names(HF_CONFIG):
        t = torch.randn(shape, generator=g) * 0.02
        params += t.numel()
        for disk, x in _disk_tensors(fam, name, t):
            writer.add(disk, x.clone())
        del t
    writer.finish()
    models.build_hf_config(HF_CONFIG).save_pretrained(out)
    files = sorted(out.glob("*.safetensors"))
    return {
        "parameters": params,
        "bytes": sum(f.stat().st_size for f in files),
        "shards": len(files),
        "largestShardBytes": max(f.stat().st_size for f in files),
    }


def plan_doc(path: Path) -> dict:
    E, L = HF_CONFIG["num_local_experts"], HF_CONFIG["num_hidden_layers"]
    perm = [[(s + layer + 1) % E for s in range(E)][::-1] for layer in range(L)]
    return {
        "kind": "MoEPlan",
        "version": 1,
        "device": "cpu",
        "model": {"family": "mixtral", "path": str(path), "hfConfig": HF_CONFIG},
        "worldSize": WORLD,
        "epSize": WORLD,
        "ranks": [
            {"rank": r, "node": f"n{r}", "nodeRank": r, "localRank": 0, "gpu": None}
            for r in range(WORLD)
        ],
        "placement": {
            "strategy": "bench",
            "numLayers": L,
            "numExperts": E,
            "epSize": WORLD,
            "permutation": perm,
        },
        "deepspeed": {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "expert_parallel": {"enabled": True, "autoep_size": WORLD, "preset_model": "mixtral"},
        },
        "training": {"steps": 1, "seqLen": 32, "microBatch": 1, "gradAccum": 1},
    }


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_worker(plan_path: str, out_dir: str) -> None:
    """One rank: build + stream (the trainer's code), then report memory."""
    from moe_contracts.plan import load_plan
    from moe_trainer import distenv
    from moe_trainer.model import model_setup
    from moe_trainer.trainer import deepspeed_config

    plan = load_plan(plan_path)
    env = distenv.read_env(plan.world_size, [None] * plan.world_size, force_cpu=True)
    distenv.init_distributed(env)
    before = rss_now()
    t0 = time.perf_counter()
    prepared = model_setup.prepare(plan, deepspeed_config(plan), env.rank, lambda: None)
    seconds = time.perf_counter() - t0
    partition = sum(
        p.ds_tensor.numel() * p.ds_tensor.element_size() for p in prepared.model.parameters()
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    doc = {
        "rank": env.rank,
        "rssBeforeBytes": before,
        "peakRssBytes": peak,
        "rssAfterBytes": rss_now(),
        "partitionBytes": partition,
        "loadSeconds": round(seconds, 2),
        "bytesReadByRank": prepared.load_report["bytesRead"],
    }
    Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(doc))
    import torch.distributed as dist

    dist.barrier()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/pretrained_load_cpu.json"))
    ap.add_argument("--work", help="where to write the checkpoint (default: a temporary dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--rank-worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        rank_worker(*args.rank_worker)
        return
    from moe_trainer.launch import local_world_envs

    own_work = args.work is None
    work = Path(args.work or tempfile.mkdtemp(prefix="pretrained_load_"))
    ckpt = work / "checkpoint"
    try:
        t0 = time.perf_counter()
        info = write_checkpoint(ckpt)
        info["writeSeconds"] = round(time.perf_counter() - t0, 1)
        plan = work / "plan.json"
        plan.write_text(json.dumps(plan_doc(ckpt)))
        path = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_image")])
        envs = local_world_envs(WORLD, dict(os.environ, PYTHONPATH=path))
        cmd = [sys.executable, __file__, "--rank-worker", str(plan), str(work)]
        procs = [subprocess.Popen(cmd, env=envs[r]) for r in range(WORLD)]
        codes = [p.wait(timeout=1800) for p in procs]
        if codes != [0] * WORLD:
            raise SystemExit(f"rank workers failed: {codes}")
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)]
    finally:
        if not args.keep:
            shutil.rmtree(work if own_work else ckpt, ignore_errors=True)
    info["gib"] = round(info["bytes"] / GiB, 2)
    info["largestShardGiB"] = round(info["largestShardBytes"] / GiB, 2)
    info["parametersBillions"] = round(info["parameters"] / 1e9, 2)
    for r in ranks:
        r["boundBytes"] = r["partitionBytes"] + info["largestShardBytes"] + 2 * GiB
        r["withinBound"] = r["peakRssBytes"] <= r["boundBytes"]
        for key in ("peakRss", "partition", "bound", "rssBefore", "rssAfter"):
            r[f"{key}GiB"] = round(r[f"{key}Bytes"] / GiB, 2)
        r["peakMinusPartitionGiB"] = round((r["peakRssBytes"] - r["partitionBytes"]) / GiB, 2)
    result = {
        "benchmark": "pretrained_load",
        "command": "python benchmarks/pretrained_load.py",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model": HF_CONFIG,
        "worldSize": WORLD,
        "checkpoint": info,
        "ranks": ranks,
        "allWithinBound": all(r["withinBound"] for r in ranks),
        "checkpointDeleted": not args.keep,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in ranks:
        print(
            f"rank {r['rank']}: peak RSS {r['peakRssBytes'] / GiB:.2f} GiB, partition "
            f"{r['partitionBytes'] / GiB:.2f} GiB, bound {r['boundBytes'] / GiB:.2f} GiB "
            f"({'ok' if r['withinBound'] else 'OVER'}), load {r['loadSeconds']} s"
        )
    print(f"checkpoint {info['bytes'] / GiB:.2f} GiB in {info['shards']} shards; wrote {args.out}")


if __name__ == "__main__":
    main()
