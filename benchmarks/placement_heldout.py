"""Held-out placement evaluation on routing the trainer recorded on real text.

    R=benchmarks/results/routing_stats_real_text_e64
    .venv/bin/python benchmarks/placement_heldout.py \
        ${R}_top8_fit.json:${R}_top8_test.json ${R}_top2_fit.json:${R}_top2_test.json \
        ${R}_top8_fit_steps.json:${R}_top8_test_steps.json \
        ${R}_top2_fit_steps.json:${R}_top2_test_steps.json ${R}_top4_fit.json:${R}_top4_test.json

Each pair is two disjoint windows of one training run (``benchmarks/record_routing.py --test-out``).
Every solver places on the *fit* window; placements are scored on the *test* window's token
samples (exact cost model: a token is sent once per remote NVLink group / node holding any of
its experts). "in sample" is the placement scored on the fit window (exactly, from its token
samples), "predicted" what the plan reports as its held-out estimate
(``quality.crossGroupVsContiguousHeldOut``: ``placement.heldout_estimate``, the in-sample ratio
raised by the mean optimism measured here for its top-k), "pair bound" what the plan would
report without samples (pair counts only). Two reference rows: ``topology_aware`` with no load
limit (what co-activation alone gives) and fitted on the pair counts only (without the exact
refinement on the token samples). ``optimism`` = measured / in sample for the fitted strategies; its
mean per top-k is what ``placement.HELDOUT_OPTIMISM`` is set from, and ``leaveOneRecordingOut``
predicts each recording from the *other* recordings only (their per-top-k means, interpolated as
the plan does by ``placement.heldout_optimism``): how well the correction carries to a run it was
not calibrated on. ``singleConstantLeaveOneOut`` does the same with one mean for every top-k.
Writes ``benchmarks/results/placement-heldout.{json,md}``; threads pinned to 1.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse
import json
import time
from pathlib import Path

from moe_contracts.routing import read_routing_stats
from moejob_operator.core.cost import score
from moejob_operator.core.placement import (
    FITTED_STRATEGIES,
    HELDOUT_OPTIMISM,
    heldout_estimate,
    heldout_optimism,
    solve,
)
from moejob_operator.core.topology import ClusterTopology

# (name, topology, EP size): EP spanning 2 and 8 NVLink groups
CASES = (
    ("2 nodes x 8 (NVSwitch), EP 16 = 2 groups", dict(nodes=2, gpus_per_node=8, group_size=8), 16),
    ("8 nodes x 4 (NVLink 4), EP 32 = 8 groups", dict(nodes=8, gpus_per_node=4, group_size=4), 32),
    ("8 nodes x 8 (NVSwitch), EP 64 = 8 groups", dict(nodes=8, gpus_per_node=8, group_size=8), 64),
    (
        "1 node x 16 (NVLink pairs), EP 16 = 8 groups",
        dict(nodes=1, gpus_per_node=16, group_size=2),
        16,
    ),
)
STRATEGIES = ("contiguous", "round_robin", "balanced", "topology_aware")
UNLIMITED = "topology_aware, no load limit (reference)"  # what co-activation alone can give
# topology_aware fitted without the token samples (pair objective only, no exact refinement)
PAIRS_ONLY = "topology_aware, pair objective only (reference)"
TARGETS = {"vs_contiguous": 0.70, "load_vs_balanced": 1.05, "prediction_error": 0.03}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 1.0


def run_pair(fit_path: str, test_path: str) -> list[dict]:
    fit, test = read_routing_stats(fit_path), read_routing_stats(test_path)
    if fit.token_experts is None or test.token_experts is None:
        raise SystemExit(
            f"{fit_path} / {test_path}: both windows need tokenSamples (RoutingStats v2)"
        )
    rows = []
    for name, kw, ep in CASES:
        topo = ClusterTopology.synthetic(**kw)
        out, secs = {}, {}
        for strategy in (*STRATEGIES, UNLIMITED, PAIRS_ONLY):
            t = time.process_time()
            p = solve(
                strategy.split(",")[0],
                topo,
                fit.without_tokens() if strategy == PAIRS_ONLY else fit,
                ep_size=ep,
                num_experts=fit.num_experts,
                num_layers=fit.num_layers,
                **({"tol": 10.0} if strategy == UNLIMITED else {}),
            )
            secs[strategy] = time.process_time() - t
            out[strategy] = (
                p,
                score(p, topo, test, hidden_size=1, bytes_per_elem=1),
                score(p, topo, fit, hidden_size=1, bytes_per_elem=1),
                score(p, topo, fit.without_tokens(), hidden_size=1, bytes_per_elem=1),
            )
        c_test, c_fit, c_pair = (out["contiguous"][i].cross_group_bytes_per_step for i in (1, 2, 3))
        b_test = out["balanced"][1]
        for strategy, (p, s_test, s_fit, s_pair) in out.items():
            measured = s_test.cross_group_bytes_per_step / c_test
            in_sample = s_fit.cross_group_bytes_per_step / c_fit
            predicted = heldout_estimate(p, in_sample, fit.top_k)
            rows.append(
                {
                    "input": f"{Path(fit_path).name} -> {Path(test_path).name}",
                    "topK": fit.top_k,
                    "case": name,
                    "strategy": strategy,
                    "measuredVsContiguous": measured,
                    "predictedVsContiguous": predicted,
                    "predictionError": predicted / measured - 1,
                    "inSampleVsContiguous": in_sample,
                    "inSampleError": in_sample / measured - 1,
                    "optimism": measured / in_sample - 1,
                    "pairBoundVsContiguous": s_pair.cross_group_bytes_per_step / c_pair,
                    "measuredCrossNodeVsContiguous": _ratio(
                        s_test.cross_node_bytes_per_step,
                        out["contiguous"][1].cross_node_bytes_per_step,
                    ),
                    "loadVsBalanced": s_test.max_mean_load / b_test.max_mean_load,
                    "fitWorstLayerLoad": s_fit.worst_layer_max_mean_load,
                    "testWorstLayerLoad": s_test.worst_layer_max_mean_load,
                    "worstLayerLoadDrift": s_test.worst_layer_max_mean_load
                    / s_fit.worst_layer_max_mean_load,
                    "fitModel": fit.model,
                    "testModel": test.model,
                    "fitSamples": int(fit.token_experts.shape[1]),
                    "testSamples": int(test.token_experts.shape[1]),
                    "solveSeconds": secs[strategy],
                }
            )
    return rows


def _leave_one_out(fitted: list[dict], per_top_k: bool) -> list[dict]:
    """Per recording (fit/test pair): predict its fitted rows from the other recordings only,
    with their per-top-k mean optimisms interpolated as the plan does (``per_top_k``), or with one
    mean over all of them."""
    out = []
    for rec in dict.fromkeys(r["input"] for r in fitted):
        mine = [r for r in fitted if r["input"] == rec]
        others = [r for r in fitted if r["input"] != rec]
        if not others:
            continue
        k = mine[0]["topK"]
        if per_top_k:
            table = {}
            for kk in {r["topK"] for r in others}:
                vals = [r["optimism"] for r in others if r["topK"] == kk]
                table[kk] = sum(vals) / len(vals)
            mean = heldout_optimism(k, table)
        else:
            mean = sum(r["optimism"] for r in others) / len(others)
        out.append(
            {
                "recording": rec,
                "topK": k,
                "calibratedOptimism": mean,
                "errors": [
                    r["inSampleVsContiguous"] * (1 + mean) / r["measuredVsContiguous"] - 1
                    for r in mine
                ],
            }
        )
    return out


def markdown(result: dict) -> str:
    out = [
        "# Held-out placement evaluation (fit on one window, scored on the next)",
        "",
        (
            "| routing (fit -> test) | case | strategy | measured vs contiguous | in sample | "
            "predicted "
            "| error | pair bound | load vs balanced | worst-layer load fit -> test | solve s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out.extend(
        f"| {r['input']} | {r['case']} | {r['strategy']} | {r['measuredVsContiguous']:.3f} | "
        f"{r['inSampleVsContiguous']:.3f} | {r['predictedVsContiguous']:.3f} | "
        f"{r['predictionError']:+.1%} | "
        f"{r['pairBoundVsContiguous']:.3f} | {r['loadVsBalanced']:.3f} | "
        f"{r['fitWorstLayerLoad']:.3f} -> {r['testWorstLayerLoad']:.3f} | {r['solveSeconds']:.2f} |"
        for r in result["rows"]
    )
    out += [
        "",
        "Targets (topology_aware): " + ", ".join(f"{k} {v}" for k, v in TARGETS.items()),
        "",
    ]
    out += [f"- {v}" for v in result["verdicts"]]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "pairs", nargs="+", help="FIT.json:TEST.json (RoutingStats v2 with tokenSamples)"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    rows = []
    for pair in args.pairs:
        fit, _, test = pair.partition(":")
        rows += run_pair(fit, test)
    verdicts = []
    ta = [r for r in rows if r["strategy"] == "topology_aware"]
    for r in ta:
        ok = (
            r["measuredVsContiguous"] <= TARGETS["vs_contiguous"],
            r["loadVsBalanced"] <= TARGETS["load_vs_balanced"],
            abs(r["predictionError"]) <= TARGETS["prediction_error"],
        )
        verdicts.append(
            f"top-{r['topK']}, {r['case']}: vs contiguous {r['measuredVsContiguous']:.3f} "
            f"({'ok' if ok[0] else 'MISS'}), load vs balanced {r['loadVsBalanced']:.3f} "
            f"({'ok' if ok[1] else 'MISS'}), prediction error {r['predictionError']:+.1%} "
            f"({'ok' if ok[2] else 'MISS'})"
        )
    fitted = [r for r in rows if r["strategy"] in FITTED_STRATEGIES]
    by_k: dict[int, float] = {}
    for k in sorted({r["topK"] for r in fitted}):
        own = [r["optimism"] for r in fitted if r["topK"] == k]
        by_k[k] = sum(own) / len(own)
        verdicts.append(
            f"fitted strategies, top-{k}: in sample / held out optimism "
            f"{min(own):+.1%} to {max(own):+.1%}, mean {by_k[k]:+.2%} "
            f"(placement.HELDOUT_OPTIMISM[{k}] = {HELDOUT_OPTIMISM.get(k, float('nan')):.3f} "
            "must match it)"
        )
    loro = _leave_one_out(fitted, per_top_k=True)
    single = _leave_one_out(fitted, per_top_k=False)
    for name, res in (("per top-k", loro), ("one constant for all", single)):
        errs = [e for c in res for e in c["errors"]]
        if errs:
            verdicts.append(
                f"leave one recording out, {name}: worst prediction error "
                f"{max(errs, key=abs):+.1%}, mean |error| {sum(map(abs, errs)) / len(errs):.1%}, "
                f"{sum(abs(e) <= TARGETS['prediction_error'] for e in errs)} of {len(errs)} "
                f"within {TARGETS['prediction_error']:.0%}"
            )
    drift = max(r["worstLayerLoadDrift"] for r in rows if r["strategy"] in STRATEGIES[1:])
    verdicts.append(
        f"worst-layer max/mean load, test / fit, largest over non-contiguous placements: "
        f"{drift:.3f} (the plan's capacity margin must cover it)"
    )
    result = {
        "rows": rows,
        "verdicts": verdicts,
        "targets": TARGETS,
        "maxWorstLayerLoadDrift": drift,
        "meanOptimismByTopK": {str(k): v for k, v in by_k.items()},
        "meanOptimismByRecording": {
            rec: sum(r["optimism"] for r in fitted if r["input"] == rec)
            / sum(r["input"] == rec for r in fitted)
            for rec in dict.fromkeys(r["input"] for r in fitted)
        },
        "leaveOneRecordingOut": loro,
        "singleConstantLeaveOneOut": single,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "placement-heldout.json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    (out / "placement-heldout.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
