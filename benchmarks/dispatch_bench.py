"""Bytes (and, emulated, time) of AutoEP's dispatch vs the dedup dispatcher on recorded routing.

    .venv/bin/python benchmarks/dispatch_bench.py \\
        --stats benchmarks/results/routing_stats_real_text_top8_tokens.json \\
        --stats benchmarks/results/routing_stats_real_text_top2_tokens.json \\
        --out benchmarks/results/dispatch_bytes

Four real gloo processes on CPU form one EP group of 2 NVLink groups x 2 ranks (the synthetic
topology ``2 nodes x 2 GPUs, group size 2``). For every routing file (RoutingStats with
``tokenExperts``: the experts real-text tokens chose) and every placement (contiguous, balanced,
topology_aware, solved by ``core.placement`` on the same file), each rank feeds its share of the
recorded tokens (token t on rank t % 4) through one AutoEP layer per MoE layer, forward and
backward, once with DeepSpeed AutoEP's own all-to-all and once with
``moe_trainer.dispatch.dedup_ep``. The router is replaced by the recorded choices; the placement
reaches AutoEP by renaming experts to slots and reaches dedup through its expert -> rank table, so
no weights move (outputs are not the trained model's; bytes do not depend on weights). Bytes per
tier are counted in the collectives (``moe_trainer.telemetry.commtime.CommTimer`` with the plan's
tiers) and set beside ``core.dispatch.dispatch_bytes`` for the same tokens.

A fifth variant, "dedup + topology_aware + copies", adds replicated experts to the topology_aware
placement: ``core.placement.replicas.solve`` (the function the planner uses) places extra copies
of hot experts on the FIT token samples at ``--overhead`` percent of expert memory (default 25:
``floor(overhead x experts per rank)`` copies per rank and layer, 1 with 16 experts on EP 4), and
the dedup ``Layout`` gets its ``holders`` / ``serve`` tables (``moe_trainer.dispatch.
dedup_replicas``: copies receive the home's weights in the forward and send their gradients back
in the backward). Its dispatch bytes are counted as the other rows' and predicted by
``moe_contracts.dispatch.tier_bytes`` with the serve table; the copies' weight + gradient bytes
are counted in ``dedup_replicas.sync_counters`` and predicted by ``dedup_replicas.sync_bytes``;
both are reported separately and in total.

``--netns`` runs the same four processes as two "nodes" in Linux network namespaces joined by a
veth pair shaped with ``tc ... tbf rate 200mbit`` (loopback inside a node): an *emulation* of a
slow inter-node link on one machine, not a cluster. It reports step time per variant beside the
cost model's prediction (the measured unshaped step time + predicted cross-node bytes over the
link rate; for the copies variant the cross-node bytes include the copies' sync bytes). Needs
root; creates and deletes its own namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "trainer_image")]

STRATEGIES = ("contiguous", "balanced", "topology_aware")
COPIES = "topology_aware + copies"  # topology_aware with replicated experts (dedup only)
RATE_MBIT = 200


def topology():
    from moejob_operator.core.topology import ClusterTopology

    return ClusterTopology.synthetic(nodes=2, gpus_per_node=2, group_size=2)


def split(spec: str) -> tuple[str, str]:
    """``FIT[:TEST]``: placements solved on FIT, tokens routed from TEST (held out when
    different)."""
    fit, _, test = spec.partition(":")
    return fit, test or fit


def placements(stats):
    from moejob_operator.core import placement

    topo = topology()
    return {
        s: placement.solve(
            s,
            topo,
            stats,
            ep_size=4,
            num_experts=stats.num_experts,
            num_layers=stats.num_layers,
            seed=0,
        )
        for s in STRATEGIES
    }


def copies(fit, pl, overhead: int):
    """``core.placement.replicas`` on FIT's token samples for the home placement ``pl`` (as the
    planner): one ``LayerCopies`` per layer, ``copy_slots(E / P, overhead)`` copies per rank."""
    import numpy as np

    from moejob_operator.core.placement import replicas

    topo = topology()
    P = pl.ep_size
    te = fit.token_experts
    return replicas.solve(
        pl.permutation,
        topo.group_of[pl.rank2gpu[:P]],
        te,
        np.arange(te.shape[1]) % P,
        slots=replicas.copy_slots(fit.num_experts // P, overhead),
    )


def copy_layouts(pl, layers, group_of: list[int], node_of: list[int]):
    """The dedup ``Layout`` of every layer with the copies' ``holders`` / ``serve`` (router id =
    original expert id, as the bench feeds the dedup dispatcher)."""
    from moe_trainer.dispatch import dedup_ep

    out = []
    for layer, c in enumerate(layers):
        slot = pl.expert2slot(layer)
        n = len(slot) // pl.ep_size
        out.append(
            dedup_ep.Layout(
                tuple(int(s) // n for s in slot),
                tuple(int(s) % n for s in slot),
                tuple(tuple(g) for g in _groups(group_of)),
                tuple(group_of),
                tuple(node_of),
                holders=tuple(tuple(int(h) for h in hs) for hs in c.holders),
                serve=tuple(tuple(int(r) for r in row) for row in c.serve),
            )
        )
    return out


# ---------------------------------------------------------------- worker (one rank)


def worker() -> None:
    import copy

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from transformers import MixtralConfig, MixtralForCausalLM

    from moe_contracts.routing import read_routing_stats
    from moe_trainer.dispatch import dedup_ep, dedup_replicas
    from moe_trainer.telemetry.commtime import CommTimer

    job = json.loads(os.environ["DISPATCH_JOB"])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    topo = topology()
    results = []
    for spec in job["stats"]:
        fit_path, path = split(spec)
        stats, fit = read_routing_stats(path), read_routing_stats(fit_path)
        te = stats.token_experts[:, : job["tokens"]] if job["tokens"] else stats.token_experts
        L, _T, K = te.shape
        E, H = stats.num_experts, job["hidden"]
        torch.manual_seed(0)
        cfg = MixtralConfig(
            vocab_size=64,
            hidden_size=H,
            intermediate_size=job["ffn"],
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=E,
            num_experts_per_tok=K,
            max_position_embeddings=64,
        )
        model = MixtralForCausalLM(cfg).float()
        ae = AutoEP(
            model,
            parse_autoep_config({"enabled": True, "autoep_size": W, "preset_model": "mixtral"}),
        )
        ae.replace_moe_layers(ae.ep_parser(), ep_size=W, ep_rank=rank)
        base_layer = model.model.layers[0].mlp
        base_layer.ep_group = dist.new_group(list(range(W)))
        variants = placements(fit)
        variants[COPIES] = variants["topology_aware"]
        for strategy, pl in variants.items():
            group_of = topo.group_of[pl.rank2gpu].tolist()
            node_of = topo.node_of[pl.rank2gpu].tolist()
            timer = CommTimer().set_tiers(group_of, node_of).install()
            row = {"stats": _label(fit_path, path), "strategy": strategy}
            with_copies = None
            if strategy == COPIES:
                with_copies = copy_layouts(pl, copies(fit, pl, job["overhead"]), group_of, node_of)
            for dispatcher in ("dedup",) if with_copies else ("autoep", "dedup"):
                layers = []
                for layer in range(L):
                    blk = copy.copy(base_layer)  # shares parameters and the group; own class/attrs
                    blk._modules = dict(base_layer._modules)
                    slot = pl.expert2slot(layer)
                    ids = te[layer, rank::W]
                    if with_copies:
                        # own experts module (same parameters): it carries this layer's copies
                        blk._modules["experts"] = copy.copy(base_layer.experts)
                        dedup_ep.install([blk], [with_copies[layer]])
                        chosen = torch.as_tensor(ids)
                    elif dispatcher == "dedup":
                        n = E // W
                        lay = dedup_ep.Layout(
                            tuple(int(s) // n for s in slot),
                            tuple(int(s) % n for s in slot),
                            tuple(tuple(g) for g in _groups(group_of)),
                            tuple(group_of),
                            tuple(node_of),
                        )
                        dedup_ep.install([blk], [lay])
                        chosen = torch.as_tensor(ids)
                    else:
                        chosen = torch.as_tensor(slot[ids])
                    layers.append((blk, chosen))
                timer.take()
                dedup_ep.counters.take()
                dedup_replicas.sync_counters.take()
                t0 = time.perf_counter()
                for _ in range(job["repeat"]):
                    x = torch.randn(1, layers[0][1].shape[0], H, requires_grad=True)
                    h = x
                    for blk, chosen in layers:
                        h = _fixed_router(blk, chosen, E)(h)
                        h = h[0] if isinstance(h, tuple) else h
                    h.float().square().mean().backward()
                dist.barrier()
                secs = (time.perf_counter() - t0) / job["repeat"]
                took = timer.take()
                tiers = {k: v / job["repeat"] for k, v in took["allToAllTierBytes"].items()}
                row[dispatcher] = {
                    "tierBytes": tiers,
                    "seconds": secs,
                    "dedupCounters": {
                        k: v / job["repeat"] for k, v in dedup_ep.counters.take().items()
                    },
                    "syncCounters": {
                        k: v / job["repeat"] for k, v in dedup_replicas.sync_counters.take().items()
                    },
                }
            timer.uninstall()
            results.append(row)
    out = Path(os.environ["DISPATCH_OUT"]) / f"rank{rank}.json"
    out.write_text(json.dumps(results))
    dist.barrier()


def _label(fit_path: str, path: str) -> str:
    name = Path(path).name
    return name if fit_path == path else f"{name} (placement fit on {Path(fit_path).name})"


def _groups(group_of: list[int]) -> list[list[int]]:
    ids = list(dict.fromkeys(group_of))
    return [[r for r, g in enumerate(group_of) if g == i] for i in ids]


def _fixed_router(blk, chosen, num_experts):
    """The layer with its router's choice replaced by ``chosen[T, K]`` (scores from the gate, so
    router gradients still flow)."""
    import torch

    gate = blk.router.gate

    def route(x, bias=None):
        scores = torch.softmax(gate(x).float(), dim=-1).gather(1, chosen)
        scores = scores / scores.sum(-1, keepdim=True)
        counts = torch.zeros(num_experts, dtype=torch.int32).scatter_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=torch.int32)
        )
        return scores, chosen, counts

    blk.router.forward = route
    return blk


# ---------------------------------------------------------------- coordinator


def launch(job: dict, out: Path, netns: bool) -> list[list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    port = 29000 + os.getpid() % 1000
    env = dict(
        os.environ,
        DISPATCH_JOB=json.dumps(job),
        DISPATCH_OUT=str(out),
        WORLD_SIZE="4",
        LOCAL_WORLD_SIZE="2",
        MASTER_PORT=str(port),
        DISPATCH_WORKER="1",
        OMP_NUM_THREADS="1",
    )
    procs = []
    for r in range(4):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r % 2))
        cmd = [sys.executable, __file__]
        if netns:
            e.update(MASTER_ADDR=NS_ADDR[0], GLOO_SOCKET_IFNAME=f"veth{r // 2}")
            cmd = ["ip", "netns", "exec", NS_NAME[r // 2], *cmd]
        else:
            e["MASTER_ADDR"] = "127.0.0.1"
        with open(out / f"log{r}.txt", "w") as log:  # the child keeps its own copy
            procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=3600) for p in procs]
    if codes != [0] * 4:
        raise SystemExit(f"workers failed {codes}: {(out / 'log0.txt').read_text()[-2000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


NS_NAME = ("w15node0", "w15node1")
NS_ADDR = ("10.215.0.1", "10.215.0.2")


def netns_up(rate_mbit: int | None) -> None:
    sh = [
        "ip netns add w15node0",
        "ip netns add w15node1",
        "ip link add veth0 type veth peer name veth1",
        "ip link set veth0 netns w15node0",
        "ip link set veth1 netns w15node1",
    ]
    for i in range(2):
        ns = f"ip netns exec w15node{i} "
        sh += [
            ns + f"ip addr add {NS_ADDR[i]}/24 dev veth{i}",
            ns + f"ip link set veth{i} up",
            ns + "ip link set lo up",
        ]
        if rate_mbit:
            sh.append(
                ns
                + f"tc qdisc add dev veth{i} root tbf rate {rate_mbit}mbit burst 64kb latency 50ms"
            )
    for c in sh:
        subprocess.run(c.split(), check=True)


def netns_down() -> None:
    for ns in NS_NAME:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def summarize(stats_paths, ranks: list[list[dict]], job: dict) -> list[dict]:
    import numpy as np

    from moe_contracts.dispatch import tier_bytes
    from moe_contracts.routing import read_routing_stats
    from moe_trainer.dispatch.dedup_replicas import sync_bytes
    from moejob_operator.core import dispatch
    from moejob_operator.core.placement import replicas

    topo = topology()
    rows = []
    for i, res in enumerate(ranks[0]):
        fit_path, path = next(split(p) for p in stats_paths if _label(*split(p)) == res["stats"])
        stats = read_routing_stats(path)
        te = stats.token_experts[:, : job["tokens"]] if job["tokens"] else stats.token_experts
        fit = read_routing_stats(fit_path)
        strategy = res["strategy"]
        pl = placements(fit)["topology_aware" if strategy == COPIES else strategy]
        pred = dispatch.dispatch_bytes(pl, topo, te, hidden_size=job["hidden"], bytes_per_elem=4)
        extra = {}
        if strategy == COPIES:
            layers = copies(fit, pl, job["overhead"])
            group_of = topo.group_of[pl.rank2gpu].tolist()
            node_of = topo.node_of[pl.rank2gpu].tolist()
            pred = tier_bytes(
                replicas.serve_table(layers),
                te,
                np.arange(te.shape[1]) % pl.world_size,
                group_of,
                node_of,
                pl.ep_size,
                hidden_bytes=job["hidden"] * 4,
            )
            row_bytes = 3 * job["hidden"] * job["ffn"] * 4  # one expert's w1 + w2 + w3, fp32
            sync_pred = dict.fromkeys(dispatch.TIERS, 0)
            for lay in copy_layouts(pl, layers, group_of, node_of):
                for t, v in sync_bytes(lay, row_bytes).items():
                    sync_pred[t] += v
            sync = {t: sum(r[i]["dedup"]["syncCounters"][t] for r in ranks) for t in dispatch.TIERS}
            extra = {
                "overheadPercent": job["overhead"],
                "copiesPerRankPerLayer": replicas.copy_slots(fit.num_experts // 4, job["overhead"]),
                "extraCopies": sum(c.extra_copies for c in layers),
                "syncMeasured": sync,
                "syncPredicted": sync_pred,
            }
        for d in ("dedup",) if strategy == COPIES else ("autoep", "dedup"):
            measured = {t: sum(r[i][d]["tierBytes"][t] for r in ranks) for t in dispatch.TIERS}
            if extra:
                extra["totalMeasured"] = {t: measured[t] + sync[t] for t in dispatch.TIERS}
                extra["totalPredicted"] = {t: pred[d][t] + sync_pred[t] for t in dispatch.TIERS}
            rows.append(
                {
                    "stats": res["stats"],
                    "topK": stats.top_k,
                    "experts": stats.num_experts,
                    "tokens": int(te.shape[1]),
                    "layers": int(te.shape[0]),
                    "strategy": res["strategy"],
                    "dispatcher": d,
                    "measured": measured,
                    "predicted": pred[d],
                    "seconds": max(r[i][d]["seconds"] for r in ranks),
                    **extra,
                }
            )
    return rows


def table(rows: list[dict], title: str, timed: dict | None = None) -> str:
    out = [f"## {title}", ""]
    for stats in dict.fromkeys(r["stats"] for r in rows):
        rs = [r for r in rows if r["stats"] == stats]
        base = next(r for r in rs if r["dispatcher"] == "autoep" and r["strategy"] == "contiguous")
        dc = next(r for r in rs if r["dispatcher"] == "dedup" and r["strategy"] == "contiguous")
        out += [
            (
                f"### {stats}: {rs[0]['experts']} experts top-{rs[0]['topK']}, {rs[0]['layers']} "
                "layers, "
                f"{rs[0]['tokens']} recorded tokens, 2 groups x 2 ranks"
            ),
            "",
            (
                "| variant | cross-group bytes measured | predicted | measured/predicted | vs "
                "AutoEP | "
                "vs dedup+contiguous | intra-group bytes measured |"
            ),
            "|---|---|---|---|---|---|---|",
        ]
        variants = []
        for r in [base] + [r for r in rs if r["dispatcher"] == "dedup"]:
            name = "AutoEP (contiguous)" if r is base else f"dedup + {r['strategy']}"
            if r["strategy"] != COPIES:
                variants.append((name, r["measured"], r["predicted"]))
                continue
            name += f" ({r['overheadPercent']}% overhead)"
            variants += [
                (f"{name}: dispatch", r["measured"], r["predicted"]),
                (f"{name}: copy weight + gradient sync", r["syncMeasured"], r["syncPredicted"]),
                (f"{name}: total", r["totalMeasured"], r["totalPredicted"]),
            ]
        for name, measured, predicted in variants:
            m, p = measured["crossGroup"], predicted["crossGroup"]
            out.append(
                f"| {name} | {m:,.0f} | {p:,.0f} | {m / p if p else 1:.4f} | "
                f"{m / base['measured']['crossGroup']:.3f} | "
                f"{m / dc['measured']['crossGroup']:.3f} | "
                f"{measured['intraGroup']:,.0f} |"
            )
        for r in rs:
            if r["strategy"] == COPIES:
                out += [
                    "",
                    (
                        f"Copies: {r['copiesPerRankPerLayer']} per rank and layer "
                        f"({r['extraCopies']} in all), placed by core.placement.replicas on the "
                        "fit tokens; sync = the copies' weights (forward) and gradients "
                        "(backward), counted in dedup_replicas.sync_counters."
                    ),
                ]
        others = [r for r in rs if r["dispatcher"] == "autoep" and r is not base]
        out.append("")
        out.append(
            "AutoEP under the other placements (cross-group measured / predicted): "
            + ", ".join(
                f"{r['strategy']} {r['measured']['crossGroup']:,.0f} / "
                f"{r['predicted']['crossGroup']:,.0f}"
                for r in others
            )
        )
        out.append("")
    return "\n".join(out)


def main() -> None:
    if os.environ.get("DISPATCH_WORKER"):
        worker()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--stats",
        action="append",
        required=True,
        metavar="FIT[:TEST]",
        help="RoutingStats with token samples; FIT:TEST solves placements on FIT and "
        "routes TEST's tokens",
    )
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=32)
    ap.add_argument(
        "--tokens", type=int, default=0, help="use the first N recorded tokens (0: all)"
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--overhead",
        type=int,
        default=25,
        help="expert memory overhead (percent) of the copies variant's replicated experts",
    )
    ap.add_argument(
        "--netns", action="store_true", help="emulate two nodes with a shaped veth (root)"
    )
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    a = ap.parse_args()
    job = {
        "stats": a.stats,
        "hidden": a.hidden,
        "ffn": a.ffn,
        "tokens": a.tokens,
        "repeat": a.repeat,
        "overhead": a.overhead,
    }
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="dispatch-bench-"))
    cmd = " ".join(["benchmarks/dispatch_bench.py", *sys.argv[1:]])
    if not a.netns:
        rows = summarize(a.stats, launch(job, work, False), job)
        doc = {"command": cmd, "job": job, "rows": rows}
        md = table(
            rows,
            "Dispatch bytes per training step (forward + backward), counted in the collectives",
        )
    else:
        runs = {}
        for label, rate in (("unshaped", None), ("shaped", RATE_MBIT)):
            netns_down()
            netns_up(rate)
            try:
                runs[label] = summarize(a.stats, launch(job, work / label, True), job)
            finally:
                netns_down()
        link = RATE_MBIT * 1e6 / 8
        rows = []
        for free, shaped in zip(runs["unshaped"], runs["shaped"], strict=True):
            # the veth carries each direction separately: the busier direction bounds the time
            cross = shaped.get("totalPredicted", shaped["predicted"])["crossNode"] / 2
            rows.append(
                {
                    **shaped,
                    "secondsUnshaped": free["seconds"],
                    "secondsPredicted": free["seconds"] + cross / link,
                }
            )
        doc = {
            "command": cmd,
            "job": job,
            "emulation": f"2 network namespaces, veth tbf {RATE_MBIT}mbit",
            "rows": rows,
        }
        md = time_table(rows)
    Path(a.out + ".json").write_text(json.dumps(doc, indent=1))
    Path(a.out + ".md").write_text(f"Command: `{cmd}`\n\n{md}\n")
    print(md)
    import shutil

    shutil.rmtree(work, ignore_errors=True)


def time_table(rows: list[dict]) -> str:
    out = [
        (
            "## Step time, EMULATED: 2 'nodes' = 2 network namespaces x 2 ranks, veth shaped to "
            f"{RATE_MBIT} "
            "Mbit/s (tc tbf), loopback inside a node; one machine, not a cluster"
        ),
        "",
    ]
    for stats in dict.fromkeys(r["stats"] for r in rows):
        out += [
            f"### {stats}",
            "",
            (
                "| variant | step s (shaped) | predicted s | step s (unshaped) | "
                "cross-node bytes measured |"
            ),
            "|---|---|---|---|---|",
        ]
        for r in rows:
            if r["stats"] != stats or (
                r["dispatcher"] == "autoep" and r["strategy"] != "contiguous"
            ):
                continue
            name = (
                "AutoEP (contiguous)" if r["dispatcher"] == "autoep" else f"dedup + {r['strategy']}"
            )
            if r["strategy"] == COPIES:  # cross-node bytes: dispatch + the copies' sync
                name += f" ({r['overheadPercent']}% overhead, incl. copy sync bytes)"
            out.append(
                f"| {name} | {r['seconds']:.3f} | {r['secondsPredicted']:.3f} | "
                f"{r['secondsUnshaped']:.3f} | "
                f"{r.get('totalMeasured', r['measured'])['crossNode']:,.0f} |"
            )
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
