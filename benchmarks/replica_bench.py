"""Cross-group bytes of the dedup dispatcher with replicated experts vs memory overhead.

    R=benchmarks/results/routing_stats_real_text_e64
    .venv/bin/python benchmarks/replica_bench.py \\
        ${R}_top2_fit.json:${R}_top2_test.json ${R}_top4_fit.json:${R}_top4_test.json \\
        ${R}_top8_fit.json:${R}_top8_test.json --out benchmarks/results/replicas_bytes

One EP group of 2 NVLink groups x 2 ranks (``ClusterTopology.synthetic(nodes=2, gpus_per_node=2,
group_size=2)``, EP 4, 16 experts per rank), token t on rank t % 4, as in dispatch_bench.py. For
each pair FIT:TEST (two disjoint windows of one training run) and each home layout (contiguous,
topology_aware solved on FIT), ``core.placement.replicas`` places copies on FIT's token samples
with ``maxExpertMemoryOverhead`` = 0, 6, 12, 25, 50 % (``floor(overhead x 16)`` copies per rank
and layer: 0, 0, 1, 4, 8); bytes are ``moe_contracts.dispatch.tier_bytes`` (the byte model the
trainer's counters are checked against) with the serve table, forward + backward, on FIT
("in sample") and on TEST ("held out"). Ratios are against dedup + contiguous (single copy) and
AutoEP (contiguous) on the same tokens; load = max / mean (token, expert) assignments per rank,
worst layer. Copies may not push a rank above max(1.05 x mean, the single-copy max) on FIT; the
reference rows drop that limit (what the bytes alone could give). "counting bound": the fewest
cross-group bytes *any* placement with that many experts per group could send on those tokens,
as a ratio to dedup + contiguous (``counting_bound``: a token stays home only if all K experts are
there, so a group keeps at most the load of its most-loaded experts / K tokens). "joint sets"
(25 % only): both groups' expert sets chosen together by a local search, as any home layout with
those copies could hold them (``joint_sets``), to see what the fixed home layout costs.
"exact optimum" (top-2 only, at 12, 25 and 50 %; ``exact_sets_optimum``): with 2 groups the dedup
dispatcher's cross-group bytes are d_row x the stage-A rows, and a token sends one row iff one of
its experts is not held in its own group, so the fewest rows *any* placement with
``2 x (16 + copies per rank)`` distinct experts per group (every expert held somewhere, no load
limit) can send on a window is T minus the optimum of a per-layer integer programme (which
experts each group holds; which of its tokens' expert sets stay whole), solved exactly with HiGHS
through ``scipy.optimize.milp`` (300 s per layer and window; the bound is the solver's dual bound,
valid even if the limit stops it, and "proven" says it met the best layout found). It holds for
every placement, even one fitted on those very tokens, so a held-out ratio above a target proves
the target out of reach on that recording. Top-4/8 are left out: there the relaxation is too weak
to bound anything within minutes. Threads pinned to 1.
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
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from moe_contracts.dispatch import tier_bytes
from moe_contracts.routing import read_routing_stats
from moejob_operator.core.placement import replicas, solve
from moejob_operator.core.topology import ClusterTopology

OVERHEADS = (0, 6, 12, 25, 50)
HOMES = ("contiguous", "topology_aware")
UNLIMITED = "topology_aware, no load limit (reference)"  # what the bytes alone could give
HIDDEN_BYTES = 2048  # bytes of one hidden row (ratios do not depend on it)
TARGETS = {2: ("dedup", 0.45), 4: ("dedup", 0.60), 8: ("autoep", 0.15)}  # at <= 25 % overhead
LOAD_TARGET = 1.05
JOINT_AT = 25  # overhead of the joint-sets reference (joint_sets)
EXACT_AT = (12, 25, 50)  # overheads of the exact optimum (exact_sets_optimum), top-2 only
EXACT_TOP_K = 2  # for top-4/8 the MILP's relaxation is too weak to prove anything in minutes
EXACT_TIME_LIMIT = 300.0  # s per layer and window


def topology() -> ClusterTopology:
    return ClusterTopology.synthetic(nodes=2, gpus_per_node=2, group_size=2)


def _bytes(serve: np.ndarray, te: np.ndarray, topo: ClusterTopology, pl) -> dict:
    T = te.shape[1]
    return tier_bytes(
        serve,
        te,
        np.arange(T) % pl.world_size,
        topo.group_of[pl.rank2gpu],
        topo.node_of[pl.rank2gpu],
        pl.ep_size,
        hidden_bytes=HIDDEN_BYTES,
    )


def _load(serve: np.ndarray, te: np.ndarray, P: int) -> float:
    """Worst layer's max / mean load per EP rank under ``serve[L, P, E]``."""
    L, T, _ = te.shape
    src = np.arange(T) % P
    worst = 0.0
    for layer in range(L):
        pairs = replicas.pair_load(te[layer], src, P, serve.shape[2])
        load = replicas.rank_load(serve[layer], pairs)
        worst = max(worst, float(load.max() / load.mean()))
    return worst


def counting_bound(te: np.ndarray, P: int, group_size: int, per_group: int) -> int:
    """Fewest stage-A rows any placement with ``per_group`` distinct experts per NVLink group can
    send for ``te[L, T, K]`` (tokens on EP rank t % P, 2 or more groups): a token stays in its
    group only if all K of its experts are there, so the group keeps at most (the loads of its
    ``per_group`` most-loaded experts, counted on its own tokens) / K tokens; every other token
    sends at least one row."""
    L, T, K = te.shape
    src_group = (np.arange(T) % P) // group_size
    rows = 0
    for layer in range(L):
        for g in range(P // group_size):
            mine = te[layer][src_group == g]
            load = np.sort(np.bincount(mine.ravel(), minlength=int(te.max()) + 1))[::-1]
            rows += len(mine) - min(len(mine), int(load[:per_group].sum()) // K)
    return rows


def exact_sets_optimum(
    te: np.ndarray,
    P: int,
    group_size: int,
    per_group: int,
    time_limit: float,
    num_experts: int | None = None,
) -> dict:
    """Fewest stage-A rows *any* placement holding at most ``per_group`` distinct experts per
    NVLink group (and every expert somewhere) can send for ``te[L, T, K]``, tokens on EP rank
    t % P, exactly 2 groups (``ValueError`` otherwise). With 2 groups a token sends one row iff one
    of its experts is not in its own group, so per layer the fewest rows are ``T`` minus the
    optimum of

        max  sum_g sum_c w[g, c] z[g, c]   (c: distinct expert sets of group g's tokens, w: count)
        s.t. z[g, c] <= x[g, e] for e in c;  sum_e x[g, e] <= per_group;  x[0, e] + x[1, e] >= 1;
             x binary, 0 <= z <= 1

    solved with HiGHS (``scipy.optimize.milp``, at most ``time_limit`` s per layer). ``lowerRows``
    is ``T`` minus the solver's dual bound (rounded up: the objective is integral), valid even when
    the time limit stops the search; ``bestRows`` is the best layout found; ``proven``: the two
    meet on every layer. Useful for top-2: for top-4/8 the LP relaxation is too weak to say anything
    within minutes (on a top-4 layer the dual bound stayed far below the best layout found)."""
    L, T, K = te.shape
    if P % group_size or P // group_size != 2:
        raise ValueError(f"exact_sets_optimum needs exactly 2 groups, got {P} ranks / {group_size}")
    E = int(num_experts if num_experts is not None else te.max() + 1)
    src_group = (np.arange(T) % P) // group_size
    lower = best = 0
    proven = True
    t0 = time.perf_counter()
    for layer in range(L):
        classes = [
            np.unique(np.sort(te[layer][src_group == g], axis=1), axis=0, return_counts=True)
            for g in (0, 1)
        ]
        nz = sum(len(w) for _, w in classes)
        n = 2 * E + nz
        cost = np.zeros(n)
        rows, cols, vals = [], [], []
        r = off = 0
        for g, (sets, w) in enumerate(classes):
            m = len(w)
            cost[2 * E + off : 2 * E + off + m] = -w
            ri = r + np.arange(m * K)  # z[g, c] - x[g, e] <= 0, one row per (c, e)
            rows += [ri, ri]
            cols += [2 * E + off + np.repeat(np.arange(m), K), g * E + sets.ravel()]
            vals += [np.ones(m * K), -np.ones(m * K)]
            r += m * K
            off += m
        lb = [np.full(r, -np.inf)]
        ub = [np.zeros(r)]
        for g in (0, 1):  # at most per_group experts in group g
            rows.append(np.full(E, r))
            cols.append(g * E + np.arange(E))
            vals.append(np.ones(E))
            lb.append([-np.inf])
            ub.append([per_group])
            r += 1
        rows += [r + np.arange(E)] * 2  # every expert has a holder
        cols += [np.arange(E), E + np.arange(E)]
        vals += [np.ones(E)] * 2
        lb.append(np.ones(E))
        ub.append(np.full(E, np.inf))
        r += E
        A = sp.csr_matrix(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r, n)
        )
        res = milp(
            cost,
            constraints=LinearConstraint(A, np.concatenate(lb), np.concatenate(ub)),
            integrality=np.r_[np.ones(2 * E), np.zeros(nz)],
            bounds=Bounds(0, 1),
            options={"time_limit": time_limit, "mip_rel_gap": 0},
        )
        if res.mip_dual_bound is None or res.fun is None:
            raise RuntimeError(f"layer {layer}: HiGHS gave no bound ({res.message})")
        low = int(np.ceil(T + res.mip_dual_bound - 1e-6 * max(1.0, abs(res.mip_dual_bound))))
        found = round(T + res.fun)
        lower += low
        best += found
        proven = proven and found == low
    return {
        "lowerRows": lower,
        "bestRows": best,
        "proven": proven,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def joint_sets(fit_te: np.ndarray, test_te: np.ndarray, layers, P: int, base_rows: dict) -> dict:
    """Reference beyond a fixed home layout (2 groups, no load limit): start from the copies'
    per-group expert sets and swap one expert of a group's set for one it lacks (the removed one
    must stay in the other group's set, so every expert keeps a holder) while that keeps more of
    the group's fit tokens whole, best swap first. Any two such sets are realisable by some home
    layout plus the same number of copies. Returns the ratios to dedup + contiguous."""
    L, T, _ = fit_te.shape
    E = int(max(fit_te.max(), test_te.max())) + 1
    out = {"inSample": 0, "heldOut": 0}
    for layer in range(L):
        c = layers[layer]
        sets = [{e for e in range(E) if any(h // 2 == g for h in c.holders[e])} for g in (0, 1)]
        fit_g = [fit_te[layer][(np.arange(T) % P) // 2 == g] for g in (0, 1)]
        test_g = [test_te[layer][(np.arange(test_te.shape[1]) % P) // 2 == g] for g in (0, 1)]

        def whole(S: set, te: np.ndarray) -> int:
            return int(np.isin(te, list(S)).all(1).sum())

        for _ in range(200):
            moved = False
            for g in (0, 1):
                cur, best = whole(sets[g], fit_g[g]), None
                for x in sorted(sets[g] & sets[1 - g]):
                    for y in sorted(set(range(E)) - sets[g]):
                        v = whole((sets[g] - {x}) | {y}, fit_g[g])
                        if v > cur and (best is None or v > best[0]):
                            best = (v, x, y)
                if best is not None:
                    sets[g] = (sets[g] - {best[1]}) | {best[2]}
                    moved = True
            if not moved:
                break
        for g in (0, 1):
            out["inSample"] += len(fit_g[g]) - whole(sets[g], fit_g[g])
            out["heldOut"] += len(test_g[g]) - whole(sets[g], test_g[g])
    return {w: round(v / base_rows[w], 4) for w, v in out.items()}


def run_pair(fit_path: str, test_path: str) -> dict:
    fit, test = read_routing_stats(fit_path), read_routing_stats(test_path)
    topo = topology()
    P = 4
    n = fit.num_experts // P
    windows = {"inSample": fit.token_experts, "heldOut": test.token_experts}
    kw = dict(ep_size=P, num_experts=fit.num_experts, num_layers=fit.num_layers, seed=0)
    contiguous = solve("contiguous", topo, None, **kw)
    base = {}
    for w, te in windows.items():
        e2r = np.stack([contiguous.expert2rank(layer) for layer in range(fit.num_layers)])
        b = _bytes(e2r, te, topo, contiguous)
        base[w] = {"dedup": b["dedup"]["crossGroup"], "autoep": b["autoep"]["crossGroup"]}
    base_rows = {}  # dedup + contiguous: the stage-A rows the bytes above are made of
    for w, te in windows.items():
        one = replicas.single_copy(np.arange(fit.num_experts) // n, P)
        src = np.arange(te.shape[1]) % P
        base_rows[w] = sum(
            replicas.cross_rows(one, te[layer], src, np.array([0, 0, 1, 1]))
            for layer in range(fit.num_layers)
        )
    rows = []
    joint: dict = {}
    for home in (*HOMES, UNLIMITED):
        pl = contiguous if home == "contiguous" else solve("topology_aware", topo, fit, **kw)
        limit = float("inf") if home == UNLIMITED else replicas.LOAD_LIMIT
        rank_group = topo.group_of[pl.rank2gpu[:P]]
        for pct in OVERHEADS:
            slots = replicas.copy_slots(n, pct)
            t0 = time.perf_counter()
            layers = replicas.solve(
                pl.permutation,
                rank_group,
                fit.token_experts,
                np.arange(fit.token_experts.shape[1]) % P,
                slots=slots,
                load_limit=limit,
            )
            secs = time.perf_counter() - t0
            serve = replicas.serve_table(layers)
            row = {
                "home": home,
                "overheadPercent": pct,
                "copiesPerRankPerLayer": slots,
                "extraCopies": sum(c.extra_copies for c in layers),
                "solveSeconds": round(secs, 3),
            }
            for w, te in windows.items():
                cross = _bytes(serve, te, topo, pl)["dedup"]["crossGroup"]
                bound = counting_bound(te, P, 2, 2 * (n + slots)) / base_rows[w]
                row[w] = {
                    "countingBoundVsDedupContiguous": round(bound, 4),
                    "crossGroupBytes": cross,
                    "vsDedupContiguous": round(cross / base[w]["dedup"], 4),
                    "vsAutoEp": round(cross / base[w]["autoep"], 4),
                    "loadMaxOverMean": round(_load(serve, te, P), 4),
                }
            rows.append(row)
            if home == HOMES[1] and pct == JOINT_AT:
                joint = joint_sets(fit.token_experts, test.token_experts, layers, P, base_rows)
    exact = []
    if fit.top_k == EXACT_TOP_K:
        for pct in EXACT_AT:
            per_group = 2 * (n + replicas.copy_slots(n, pct))
            entry: dict = {"overheadPercent": pct, "expertsPerGroup": per_group}
            for w, te in windows.items():
                opt = exact_sets_optimum(
                    te, P, 2, per_group, EXACT_TIME_LIMIT, num_experts=fit.num_experts
                )
                entry[w] = {
                    "vsDedupContiguous": round(opt["lowerRows"] / base_rows[w], 4),
                    "bestFoundVsDedupContiguous": round(opt["bestRows"] / base_rows[w], 4),
                    "lowerRows": opt["lowerRows"],
                    "bestRows": opt["bestRows"],
                    "dedupContiguousRows": int(base_rows[w]),
                    "proven": opt["proven"],
                    "seconds": opt["seconds"],
                }
            entry["proven"] = all(entry[w]["proven"] for w in windows)
            exact.append(entry)
    return {
        "fit": Path(fit_path).name,
        "test": Path(test_path).name,
        "numExperts": fit.num_experts,
        "topK": fit.top_k,
        "numLayers": fit.num_layers,
        "fitTokens": int(fit.token_experts.shape[1]),
        "testTokens": int(test.token_experts.shape[1]),
        "baseline": base,
        "rows": rows,
        "jointSetsReference": {"overheadPercent": JOINT_AT, "vsDedupContiguous": joint},
        "exactOptimum": exact,
        "targets": _targets(fit.top_k, rows, exact),
    }


def _targets(top_k: int, rows: list[dict], exact: list[dict]) -> dict:
    """The issue's targets at <= 25 % overhead (topology_aware home), held out; with the exact
    optimum of any placement at the largest such overhead (fewer experts per group only raise it)
    where it was computed."""
    if top_k not in TARGETS:
        return {}
    against, limit = TARGETS[top_k]
    key = "vsDedupContiguous" if against == "dedup" else "vsAutoEp"
    best = min(
        (r for r in rows if r["home"] == "topology_aware" and r["overheadPercent"] <= 25),
        key=lambda r: r["heldOut"][key],
    )
    got = best["heldOut"]
    out = {
        "against": key,
        "target": limit,
        "heldOut": got[key],
        "met": got[key] <= limit,
        "overheadPercent": best["overheadPercent"],
        "loadMaxOverMean": got["loadMaxOverMean"],
        "loadMet": got["loadMaxOverMean"] <= LOAD_TARGET,
    }
    at = [e for e in exact if e["overheadPercent"] <= 25]
    if at and against == "dedup":
        e = max(at, key=lambda e: e["overheadPercent"])
        out["exactOptimum"] = {
            "overheadPercent": e["overheadPercent"],
            "expertsPerGroup": e["expertsPerGroup"],
            "heldOut": e["heldOut"]["vsDedupContiguous"],
            "proven": e["heldOut"]["proven"],
            "reachable": e["heldOut"]["vsDedupContiguous"] <= limit,
        }
    return out


def markdown(result: dict) -> str:
    lines = [f"Command: `{result['command']}`", ""]
    lines.append(
        "Cross-group bytes of the dedup dispatcher (forward + backward, exact byte model) with "
        "replicated experts, 2 NVLink groups x 2 ranks (EP 4); copies placed on the fit window, "
        "bytes on the fit window (in sample) and the next window (held out)."
    )
    for pair in result["pairs"]:
        lines += [
            "",
            (
                f"### {pair['numExperts']} experts top-{pair['topK']}, {pair['numLayers']} layers: "
                f"fit {pair['fit']} ({pair['fitTokens']} tokens), held out {pair['test']} "
                f"({pair['testTokens']} tokens)"
            ),
            "",
            (
                "| home layout | overhead | copies/rank/layer | vs dedup+contiguous in sample | "
                "held out | vs AutoEP held out | load max/mean in sample | held out | "
                "counting bound held out |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in pair["rows"]:
            i, h = r["inSample"], r["heldOut"]
            lines.append(
                f"| {r['home']} | {r['overheadPercent']}% | {r['copiesPerRankPerLayer']} | "
                f"{i['vsDedupContiguous']:.3f} | {h['vsDedupContiguous']:.3f} | "
                f"{h['vsAutoEp']:.3f} | {i['loadMaxOverMean']:.3f} | {h['loadMaxOverMean']:.3f} | "
                f"{h['countingBoundVsDedupContiguous']:.3f} |"
            )
        j = pair["jointSetsReference"]
        lines += [
            "",
            (
                f"Reference, expert sets of both groups chosen jointly (any home layout, no load "
                f"limit) at {j['overheadPercent']}%: vs dedup+contiguous "
                f"{j['vsDedupContiguous']['inSample']:.3f} in sample, "
                f"{j['vsDedupContiguous']['heldOut']:.3f} held out."
            ),
        ]
        for e in pair.get("exactOptimum", []):
            i, h = e["inSample"], e["heldOut"]
            state = (
                "proven optimal"
                if e["proven"]
                else (
                    "time limit hit: a lower bound; best found "
                    f"{i['bestFoundVsDedupContiguous']:.4f} / {h['bestFoundVsDedupContiguous']:.4f}"
                )
            )
            lines += [
                "",
                (
                    f"Exact optimum of any placement with {e['expertsPerGroup']} experts per group "
                    f"(no load limit, HiGHS MILP) at {e['overheadPercent']}%: vs dedup+contiguous "
                    f"{i['vsDedupContiguous']:.4f} in sample ({i['lowerRows']} of "
                    f"{i['dedupContiguousRows']} rows), {h['vsDedupContiguous']:.4f} held out "
                    f"({h['lowerRows']} of {h['dedupContiguousRows']} rows); {state}, "
                    f"{i['seconds'] + h['seconds']:.0f} s."
                ),
            ]
        t = pair["targets"]
        if t:
            line = (
                f"Target ({t['against']} <= {t['target']} held out at <= 25 % overhead): "
                f"{t['heldOut']:.3f} at {t['overheadPercent']}% -> "
                f"{'met' if t['met'] else 'not met'}; load {t['loadMaxOverMean']:.3f} "
                f"({'met' if t['loadMet'] else 'not met'} <= {LOAD_TARGET})."
            )
            x = t.get("exactOptimum")
            if x:
                line += (
                    f" Exact optimum of any placement with {x['expertsPerGroup']} experts per "
                    f"group on the held-out tokens: {x['heldOut']:.4f} -> "
                    + (
                        "the target is below it: no placement reaches it."
                        if not x["reachable"]
                        else "some placement reaches the target."
                        if x["proven"]
                        else "a lower bound only (time limit hit): the target is not ruled out."
                    )
                )
            lines += ["", line]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", nargs="+", help="FIT.json:TEST.json (RoutingStats v2 with samples)")
    ap.add_argument("--out", default="benchmarks/results/replicas_bytes")
    args = ap.parse_args(argv)
    pairs = []
    for spec in args.pairs:
        fit, _, test = spec.partition(":")
        pairs.append(run_pair(fit, test or fit))
        print(json.dumps({k: pairs[-1][k] for k in ("fit", "targets")}), flush=True)
    cmd = "benchmarks/replica_bench.py " + " ".join(args.pairs) + f" --out {args.out}"
    result = {"command": cmd, "overheads": list(OVERHEADS), "pairs": pairs}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
