"""Multi-GPU validation on one host: AutoEP + ZeRO-3 across all GPUs (EP size = GPUs), placement
strategies side by side, ZeRO-3 memory vs the memory model as the GPU count grows, NVML discovery.

    PYTHONPATH=operator:trainer_image python3 benchmarks/multigpu_bench.py --out DIR [--steps 60]

Order (one process per rank, `moe_trainer.launch`, NCCL with NVLink multicast off):
1. `moe-discover` on this host -> DIR/topology.json (+ the NVML recording);
2. the planning core plans a contiguous job on all GPUs; the trainer runs it on real text (the
   corpus) and records RoutingStats -> DIR/routing_stats.json;
3. plans with `contiguous`, `balanced`, `topology_aware` from those statistics; each trains the
   same model, seed and data for the same steps (so routing matches the recording: the scores are
   in-sample); per run: steady tokens/s, all-to-all time per step (host-side), bytes each GPU sent
   (measured in `all_to_all_single`), max/mean expert load per GPU (from the run's own routing
   statistics under its placement), peak memory per GPU; next to the planner's predictions;
4. the contiguous plan on 1 GPU: ZeRO-3 memory per GPU vs the memory model for 1 and N GPUs.

Model: Mixtral-style, hidden 1024, 64 experts (width 1024) top-8, 4 layers, 16 heads / 4 KV heads,
byte vocabulary (320), seq 1024, micro-batch 8 per GPU, bf16, per-layer balancing loss 0.01.
Writes DIR/multigpu.{json,md}, DIR/logs.tar.gz.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for sub in ("operator", "trainer_image"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from moe_contracts.routing import RoutingStats, read_routing_stats
from moejob_operator.core import cost, models
from moejob_operator.core import plan as plan_mod
from moejob_operator.core.placement import Placement
from moejob_operator.core.topology import ClusterTopology, load_topology, nvlink_groups

MODEL = {
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
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "router_aux_loss_coef": 0.01,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
}
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
STEP_LINE = re.compile(r"step (\d+)/\d+ loss (\S+) aux \S+ (\d+) tok/s a2a ([\d.]+)s ag ([\d.]+)s")
GiB = 2**30


def discover(out: Path, env: dict) -> tuple[Path, str]:
    topo = out / "topology.json"
    cmd = [
        sys.executable,
        "-m",
        "moe_trainer.discovery.main",
        "--output",
        str(topo),
        "--no-stdout",
        "--record",
        str(out / "topology.recording.json"),
    ]
    r = subprocess.run(
        cmd,
        env=dict(env, NODE_NAME=env.get("NODE_NAME", "h200-host")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        raise SystemExit(f"moe-discover exited {r.returncode}: {r.stderr[-2000:]}")
    return topo, r.stderr


def make_plan(
    path: Path,
    model_path: Path,
    topo_path: Path,
    gpus: int,
    strategy: str,
    stats: RoutingStats | None,
    a,
    micro_batch: int | None = None,
) -> dict:
    micro = micro_batch or a.micro_batch
    report = load_topology(str(topo_path))
    training = plan_mod.TrainingOptions(
        steps=a.steps,
        lr=3e-4,
        warmup_steps=5,
        seed=1234,
        checkpoint_every_steps=a.steps,
        grad_clip=1.0,
        data={"kind": "corpus"},
    )
    result = plan_mod.build_plan(
        plan_mod.PlanRequest(
            f"mgpu-{strategy}-{gpus}",
            "bench",
            models.resolve_model(str(model_path)),
            [report],
            gpus_per_node=gpus,
            strategy=strategy,
            routing_stats=stats,
            global_batch=micro * gpus,
            micro_batch=micro,
            seq_len=a.seq_len,
            ep_size=gpus,
            training=training,
        )
    )
    plan_mod.write_plan(result, str(path))
    return json.loads(path.read_text())


def train(plan_path: Path, nproc: int, work: Path, tag: str, env: dict, timeout: float) -> dict:
    from moe_trainer.launch import launch

    ckpt = work / f"ckpt-{tag}"
    t0 = time.monotonic()
    codes = launch(
        nproc,
        ["--plan", str(plan_path), "--checkpoint-dir", str(ckpt)],
        env=env,
        timeout=timeout,
        log_prefix=str(work / f"log-{tag}"),
    )
    wall = time.monotonic() - t0
    log = (work / f"log-{tag}.rank0.log").read_text(errors="replace")
    steps = [
        (int(m[0]), float(m[1]), float(m[2]), float(m[3]), float(m[4]))
        for m in STEP_LINE.findall(log)
    ]
    out = {"codes": codes, "wallSeconds": round(wall, 1), "steps": len(steps)}
    if codes != [0] * nproc or not steps:
        out["logTail"] = log[-3000:]
        return out
    steady = [
        s for s in steps if s[0] > max(10, len(steps) // 3)
    ]  # after allocator warm-up / first compiles
    out["tokensPerSecond"] = round(statistics.median(s[2] for s in steady))
    out["allToAllSecondsPerStep"] = round(statistics.mean(s[3] for s in steady), 5)
    out["allGatherSecondsPerStep"] = round(statistics.mean(s[4] for s in steady), 5)
    out["finalLoss"] = steps[-1][1]
    prog = json.loads((ckpt / "progress.json").read_text())
    moe = prog.get("moe") or {}
    out["allToAllBytesPerStepByRank"] = moe.get("allToAllBytesPerStepByRank")
    out["peakAllocatedBytesByRank"] = moe.get("peakMemoryAllocatedBytesByRank")
    out["peakReservedBytesByRank"] = moe.get("peakMemoryReservedBytesByRank")
    out["routingStats"] = str(ckpt / "routing_stats.json")
    return out


def measured_gpu_load(plan: dict, stats_path: str) -> float:
    """Mean over layers of max/mean tokens received per GPU, this run's routing under its
    placement."""
    st = read_routing_stats(stats_path)
    pl = plan["placement"]
    world = plan["worldSize"]
    p = Placement(pl["strategy"], np.array(pl["permutation"]), np.arange(world), plan["epSize"])
    loads = cost.gpu_load(p, st.load.astype(float))
    return float((loads.max(axis=1) / loads.mean(axis=1)).mean())


def predicted(plan: dict, topo: ClusterTopology) -> dict:
    q = plan["placement"]["quality"]
    fwd = q.get("autoEpMaxGpuBytesPerStep", 0)
    bw = (
        float(topo.nvlink_gbps[0])
        if topo.num_gpus > 1 and topo.nvlink_gbps[0] > 0
        else topo.pcie_gbps
    )
    return {
        "maxMeanLoad": q.get("maxMeanLoad"),
        "maxGpuAllToAllBytesPerStep": 2 * fwd,  # forward + backward
        "allToAllSecondsPerStep": 2 * fwd / (bw * 1e9) if fwd else 0.0,
        "linkGBps": bw,
        "peakBytes": plan["memory"]["estimatedPeakBytes"],
        "basis": q.get("basis"),
    }


def markdown(r: dict) -> str:
    rows = []
    for name, run in r["runs"].items():
        pr, ms = run.get("predicted", {}), run.get("measured", {})
        if "tokensPerSecond" not in ms:
            rows.append(f"| {name} | failed: exit codes {ms.get('codes')} | | | | | | | |")
            continue
        mb = max(ms["allToAllBytesPerStepByRank"] or [0])
        peak = max(ms["peakReservedBytesByRank"] or [0])
        rows.append(
            f"| {name} | {ms['tokensPerSecond']:,} | {ms.get('vsContiguous', '')} | "
            f"{ms['allToAllSecondsPerStep'] * 1e3:.1f} / {pr['allToAllSecondsPerStep'] * 1e3:.1f} "
            "| "
            f"{mb / 2**20:.0f} / {pr['maxGpuAllToAllBytesPerStep'] / 2**20:.0f} | "
            f"{ms['maxMeanLoad']:.3f} / {pr['maxMeanLoad']:.3f} | "
            f"{peak / GiB:.2f} / {pr['peakBytes'] / GiB:.2f} "
            f"({(pr['peakBytes'] / peak - 1) * 100:+.0f}%) | "
            f"{ms['finalLoss']:.3f} |"
        )
    gpus = r["gpus"]
    return "\n".join(
        [
            f"# Multi-GPU validation: AutoEP + ZeRO-3 on {gpus} x {r['gpuName']} (one host)",
            "",
            (
                f"Command: `{r['command']}`. Model: {r['modelNote']}. {r['steps']} steps per run, "
                "same seed and "
                "data; measured / predicted side by side (predicted = the planning core, from the "
                "recorded "
                "statistics of the first run: in-sample). Bytes = what the busiest GPU sent in "
                "all-to-alls per "
                "step (forward + backward); a2a time is host-side time in the collective "
                "(includes waiting "
                "for the slower rank). Memory = peak reserved (caching allocator) vs the memory "
                "model."
            ),
            "",
            f"Topology (discovered): {r['topologyNote']}",
            "",
            (
                "| run | tokens/s | vs contiguous | a2a ms/step meas / pred | a2a MiB/step "
                "busiest GPU meas / pred | "
                "max/mean GPU load meas / pred | peak GiB/GPU meas / model | final loss |"
            ),
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument(
        "--cases",
        default="contiguous:N,balanced:N,topology_aware:N,contiguous:1",
        help="STRATEGY:GPUS[@MICRO_BATCH], comma-separated, run in this order (N = all GPUs)",
    )
    ap.add_argument(
        "--stats",
        help="RoutingStats of an earlier recording run of this model, seed and "
        "data (skips the recording run)",
    )
    ap.add_argument("--timeout", type=float, default=240, help="seconds per training run")
    a = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"needs a host with 2+ GPUs, this one has {gpus}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mgpu-"))
    env = dict(os.environ, **NO_MULTICAST, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "trainer_image"), str(ROOT / "operator"), env.get("PYTHONPATH", "")]
    )
    model_path = work / "config.json"
    model_path.write_text(json.dumps(MODEL))
    result = {
        "gpus": gpus,
        "gpuName": torch.cuda.get_device_name(0),
        "steps": a.steps,
        "command": "PYTHONPATH=operator:trainer_image python3 benchmarks/multigpu_bench.py "
        "--out DIR",
        "modelNote": "Mixtral-style, hidden 1024, 64 experts x width 1024, top-8, 4 layers, "
        "byte vocab, "
        f"seq {a.seq_len}, micro-batch {a.micro_batch}/GPU, bf16, real text",
        "runs": {},
    }

    def save():
        (out / "multigpu.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "multigpu.md").write_text(markdown(result))

    t0 = time.monotonic()
    topo_path, result["discoveryStderr"] = discover(out, env)
    report = load_topology(str(topo_path))
    topo = ClusterTopology.from_reports([report])
    result["topologyNote"] = (
        f"{len(report.gpus)} GPUs, NVLink groups {nvlink_groups(report)}, "
        f"NVLink {float(topo.nvlink_gbps[0]):.0f} GB/s per GPU (0 = none), "
        f"driver {report.driver_version}"
    )
    result["discoverySeconds"] = round(time.monotonic() - t0, 1)
    save()

    # 2. record routing statistics on real text (or take those of an earlier run)
    if a.stats:
        shutil.copy(a.stats, out / "routing_stats.json")
        result["recordRun"] = {"statsFrom": a.stats}
    else:
        rec_plan = work / "plan-record.json"
        make_plan(rec_plan, model_path, topo_path, gpus, "contiguous", None, a)
        rec = train(rec_plan, gpus, work, "record", env, a.timeout)
        result["recordRun"] = {k: v for k, v in rec.items() if k != "routingStats"}
        save()
        if "routingStats" not in rec:
            raise SystemExit(f"recording run failed: {rec.get('logTail', '')[-1500:]}")
        shutil.copy(rec["routingStats"], out / "routing_stats.json")
    stats = read_routing_stats(str(out / "routing_stats.json"))

    # 3. placements side by side, 4. fewer GPUs / other micro-batches for the memory model
    for i, case in enumerate(a.cases.split(",")):
        strategy, _, rest = case.partition(":")
        n_text, _, micro_text = rest.partition("@")
        n = gpus if n_text in ("", "N") else int(n_text)
        micro = int(micro_text) if micro_text else a.micro_batch
        name = f"{strategy} ({n} GPU{'s' if n > 1 else ''}, mb {micro})"
        tag = f"{i}-{strategy}-{n}-mb{micro}"  # own checkpoint dir: a repeat must not resume
        path = work / f"plan-{tag}.json"
        doc = make_plan(
            path, model_path, topo_path, n, strategy, stats if n > 1 else None, a, micro
        )
        pred = predicted(doc, topo)
        run = train(path, n, work, tag, env, a.timeout)
        if "routingStats" in run:
            run["maxMeanLoad"] = measured_gpu_load(doc, run.pop("routingStats"))
        name = (
            name
            if name not in result["runs"]
            else f"{name} #{sum(k.startswith(name) for k in result['runs']) + 1}"
        )
        result["runs"][name] = {
            "predicted": pred,
            "measured": run,
            "permutationLayer0": doc["placement"]["permutation"][0],
        }
        save()
    base = next(
        (
            r["measured"].get("tokensPerSecond")
            for k, r in result["runs"].items()
            if k.startswith(f"contiguous ({gpus} GPUs, mb {a.micro_batch})")
        ),
        None,
    )
    for run in result["runs"].values():
        m = run["measured"]
        if base and "tokensPerSecond" in m:
            m["vsContiguous"] = round(m["tokensPerSecond"] / base, 3)
    result["totalSeconds"] = round(time.monotonic() - t0, 1)
    save()
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for f in sorted(work.glob("log-*.log")) + sorted(work.glob("plan-*.json")):
            tar.add(f, arcname=f.name)
    print(markdown(result))


if __name__ == "__main__":
    main()
