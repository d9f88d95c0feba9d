"""Placement benchmark: every solver scored side by side on the same traces.

    .venv/bin/python benchmarks/placement_bench.py            # synthetic traces (the README table)
    .venv/bin/python benchmarks/placement_bench.py --stats routing_stats.json

Writes ``benchmarks/results/placement.{json,md}`` (``--out`` to change). Threads are pinned to 1
so the solve times are single-core numbers.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse
import json
import time
from pathlib import Path

import numpy as np

from moe_contracts.routing import RoutingStats, read_routing_stats
from moejob_operator.core.cost import score
from moejob_operator.core.placement import Placement, solve
from moejob_operator.core.routing import synthetic_trace
from moejob_operator.core.topology import ClusterTopology

STRATEGIES = ("contiguous", "round_robin", "balanced", "topology_aware")
CLUSTERS = {
    "32gpu-8x4nvl": dict(nodes=8, gpus_per_node=4, group_size=4),
    "64gpu-8x8nvswitch": dict(nodes=8, gpus_per_node=8, group_size=8),
}
SYNTH = dict(zipf_s=0.4, cluster_affinity=0.4)  # clusters: num_experts // 8 experts each
TARGETS = {"vs_contiguous": 0.55, "vs_balanced": 0.8, "load_vs_balanced": 1.05, "time_s": 1.0}


def planted_placement(topo: ClusterTopology, stats: RoutingStats, ep: int) -> Placement:
    """Reference only: the generator's planted clusters packed into NVLink groups, load ignored."""
    base = solve("round_robin", topo, None, ep_size=ep, num_experts=stats.num_experts, num_layers=1)
    groups = len(np.unique(topo.group_of[base.rank2gpu[:ep]]))
    perm = np.stack(
        [np.lexsort((np.arange(stats.num_experts), c, c % groups)) for c in stats.planted_clusters]
    )
    return Placement("planted (reference)", perm, base.rank2gpu, ep).validate(topo)


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if not a else float("inf"))


def run_case(name, topo, stats, ep, hidden):
    rows, scores = [], {}
    placements = []
    for strategy in STRATEGIES:
        t = time.perf_counter()
        p = solve(
            strategy,
            topo,
            stats,
            ep_size=ep,
            num_experts=stats.num_experts,
            num_layers=stats.num_layers,
        )
        placements.append((p, time.perf_counter() - t))
    if stats.planted_clusters is not None:
        placements.append((planted_placement(topo, stats, ep), float("nan")))
    for p, secs in placements:
        scores[p.strategy] = (score(p, topo, stats, hidden_size=hidden), secs)
    c, b = scores["contiguous"][0], scores["balanced"][0]
    for strategy, (s, secs) in scores.items():
        rows.append(
            {
                "case": name,
                "strategy": strategy,
                "method": s.method,
                "crossGroupVsContiguous": _ratio(
                    s.cross_group_bytes_per_step, c.cross_group_bytes_per_step
                ),
                "crossGroupVsBalanced": _ratio(
                    s.cross_group_bytes_per_step, b.cross_group_bytes_per_step
                ),
                "crossNodeVsContiguous": _ratio(
                    s.cross_node_bytes_per_step, c.cross_node_bytes_per_step
                ),
                "crossNodeVsBalanced": _ratio(
                    s.cross_node_bytes_per_step, b.cross_node_bytes_per_step
                ),
                "crossGroupBytesPerStep": s.cross_group_bytes_per_step,
                "maxMeanLoad": s.max_mean_load,
                "loadVsBalanced": _ratio(s.max_mean_load, b.max_mean_load),
                "allToAllSecondsPerStep": s.all_to_all_seconds_per_step,
                "solveSeconds": secs,
            }
        )
    return rows


# every 64-GPU fixture shape: NVSwitch nodes, 4-GPU NVLink groups, 2-GPU NVLink pairs
TIMING_SHAPES = {
    "8x8 NVSwitch": dict(nodes=8, gpus_per_node=8, group_size=8),
    "16x4 NVLink-4": dict(nodes=16, gpus_per_node=4, group_size=4),
    "8x8 NVLink pairs": dict(nodes=8, gpus_per_node=8, group_size=2),
}


def timing_run(shape, layers=64, experts=256, tokens=8192, seed=0):
    topo = ClusterTopology.synthetic(**shape)
    stats = synthetic_trace(
        layers, experts, 8, tokens, num_clusters=experts // 8, seed=seed, keep_tokens=False, **SYNTH
    )
    wall, cpu = time.perf_counter(), time.process_time()
    solve("topology_aware", topo, stats, ep_size=64, num_experts=experts, num_layers=layers)
    return time.process_time() - cpu, time.perf_counter() - wall


def markdown(result) -> str:
    out = [
        f"# Placement benchmark ({result['input']})",
        "",
        f"Synthetic trace parameters: {result['synthetic']}",
        "",
        (
            "| case | strategy | cross-group vs contiguous | vs balanced | cross-node vs "
            "contiguous "
            "| vs balanced | max/mean load | load vs balanced | all-to-all ms/step | solve s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    out.extend(
        f"| {r['case']} | {r['strategy']} | {r['crossGroupVsContiguous']:.3f} | "
        f"{r['crossGroupVsBalanced']:.3f} | {r['crossNodeVsContiguous']:.3f} | "
        f"{r['crossNodeVsBalanced']:.3f} | {r['maxMeanLoad']:.3f} | {r['loadVsBalanced']:.3f} | "
        f"{r['allToAllSecondsPerStep'] * 1e3:.3f} | {r['solveSeconds']:.3f} |"
        for r in result["rows"]
    )
    for t in result.get("timings", []):
        out += [
            "",
            (
                f"topology_aware, {t['experts']} experts x {t['gpus']} GPUs ({t['shape']}) x "
                f"{t['layers']} "
                f"layers, 1 thread: **{t['seconds']:.2f} s CPU** ({t['wallSeconds']:.2f} s wall "
                "on a shared "
                f"machine; target <= {TARGETS['time_s']} s)"
            ),
        ]
    out += [
        "",
        "Targets (topology_aware): " + ", ".join(f"{k} {v}" for k, v in TARGETS.items()),
        "",
    ]
    for line in result.get("verdicts", []):
        out.append(f"- {line}")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stats", help="RoutingStats v1 file to use instead of synthetic traces")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--tokens", type=int, default=16384, help="sampled tokens per layer (synthetic)"
    )
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument(
        "--affinity",
        type=float,
        default=SYNTH["cluster_affinity"],
        help="planted cluster_affinity (sensitivity runs; the default is the reported one)",
    )
    args = ap.parse_args(argv)
    rows, verdicts = [], []
    SYNTH["cluster_affinity"] = args.affinity
    if args.stats:
        stats = read_routing_stats(args.stats)
        result = {
            "input": f"recorded RoutingStats {args.stats} ({stats.model})",
            "synthetic": "n/a",
        }
        for cname, kw in CLUSTERS.items():
            topo = ClusterTopology.synthetic(**kw)
            ep = max(
                d
                for d in range(1, topo.num_gpus + 1)
                if topo.num_gpus % d == 0 and stats.num_experts % d == 0
            )
            rows += run_case(
                f"{cname} E{stats.num_experts} top{stats.top_k} ep{ep}",
                topo,
                stats,
                ep,
                args.hidden,
            )
    else:
        result = {
            "input": "synthetic traces",
            "synthetic": dict(
                SYNTH, clusters="num_experts // 8", tokens=args.tokens, layers=args.layers
            ),
        }
        for cname, kw in CLUSTERS.items():
            topo = ClusterTopology.synthetic(**kw)
            for experts in (64, 256):
                for top_k in (2, 8):
                    stats = synthetic_trace(
                        args.layers,
                        experts,
                        top_k,
                        args.tokens,
                        num_clusters=experts // 8,
                        seed=args.seed,
                        **SYNTH,
                    )
                    case = f"{cname} E{experts} top{top_k}"
                    case_rows = run_case(case, topo, stats, topo.num_gpus, args.hidden)
                    rows += case_rows
                    ta = next(r for r in case_rows if r["strategy"] == "topology_aware")
                    ok = (
                        ta["crossGroupVsContiguous"] <= TARGETS["vs_contiguous"],
                        ta["crossGroupVsBalanced"] <= TARGETS["vs_balanced"],
                        ta["loadVsBalanced"] <= TARGETS["load_vs_balanced"],
                    )
                    pl = next(r for r in case_rows if r["strategy"].startswith("planted"))
                    verdicts.append(
                        f"{case}: vs contiguous {ta['crossGroupVsContiguous']:.3f} "
                        f"({'ok' if ok[0] else 'MISS'}; planted reference "
                        f"{pl['crossGroupVsContiguous']:.3f}), "
                        f"vs balanced {ta['crossGroupVsBalanced']:.3f} "
                        f"({'ok' if ok[1] else 'MISS'}), "
                        f"load vs balanced {ta['loadVsBalanced']:.3f} ({'ok' if ok[2] else 'MISS'})"
                    )
    result["rows"] = rows
    if not args.no_timing:
        result["timings"] = []
        for shape, kw in TIMING_SHAPES.items():
            secs, wall = timing_run(kw, seed=args.seed)
            result["timings"].append(
                {
                    "shape": shape,
                    "experts": 256,
                    "gpus": 64,
                    "layers": 64,
                    "threads": 1,
                    "seconds": secs,
                    "wallSeconds": wall,
                }
            )
            verdicts.append(
                f"timing {shape} {secs:.2f} s CPU ({'ok' if secs <= TARGETS['time_s'] else 'MISS'})"
            )
    result["verdicts"] = verdicts
    result["targets"] = TARGETS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (
        "placement-recorded"
        if args.stats
        else "placement"
        if args.affinity == 0.4
        else f"placement-affinity{args.affinity:g}"
    )
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    md = markdown(result)
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
