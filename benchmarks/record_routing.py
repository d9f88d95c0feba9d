"""Record real routing statistics for the placement benchmark: train a small many-expert Mixtral on
the real-text corpus and keep the RoutingStats v2 document of the last `--window` steps, with up
to `--samples` sampled token expert sets.

    python benchmarks/record_routing.py --experts 64 --top-k 8 --layers 4 --steps 300 \
        --balance per_layer_aux --out benchmarks/results/routing_stats_real_text.json

With `--test-out` two disjoint windows are kept: `--out` gets the steps (S-2W, S-W] (fit on it),
`--test-out` the last W steps (score on it): a held-out evaluation of a placement.
One process, ZeRO-3 without AutoEP (CPU friendly); the statistics are the same kind a
multi-rank run aggregates. Prints per-layer max/mean expert load of the recorded window(s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "trainer_image")]
# the rank processes it starts (python -m moe_trainer.train) import from the same tree
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (*sys.path[:2], os.environ.get("PYTHONPATH")) if p
)

from moe_contracts.routing import parse_routing_stats, routing_stats_doc
from moe_trainer.launch import launch
from moe_trainer.telemetry.routing import max_mean_per_layer


def plan_doc(a) -> dict:
    cfg = {
        "model_type": "mixtral",
        "vocab_size": 320,
        "hidden_size": a.hidden,
        "intermediate_size": a.ffn,
        "num_hidden_layers": a.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "max_position_embeddings": 1024,
        "router_aux_loss_coef": 0.0,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    return {
        "kind": "MoEPlan",
        "version": 1,
        "job": {"namespace": "bench", "name": "record-routing"},
        "model": {
            "family": "mixtral",
            "preset": f"mixtral-{a.layers}x{a.experts}e-top{a.top_k}-h{a.hidden}",
            "path": None,
            "hfConfig": cfg,
        },
        "worldSize": 1,
        "epSize": 1,
        "ranks": [{"rank": 0, "node": "local", "nodeRank": 0, "localRank": 0}],
        "deepspeed": {"zero_optimization": {"stage": 3}},
        "training": {
            "steps": a.steps,
            "seqLen": a.seq_len,
            "microBatch": a.micro_batch,
            "gradAccum": 1,
            "lr": a.lr,
            "warmupSteps": max(1, a.steps // 20),
            "checkpointEverySteps": a.window,
            "seed": a.seed,
            "moeImpl": a.impl,
            "balance": {"mode": a.balance, "coef": a.coef},
            "data": {"kind": "corpus"},
            "deadExpertSteps": 50,
            # enough that each window keeps about --samples tokens (a uniform run-wide
            # sample)
            "routingSampleTokens": a.samples * max(1, a.steps // a.window),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=100, help="record routing over the last N steps")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--balance", default="per_layer_aux", choices=["per_layer_aux", "global_aux", "none"]
    )
    ap.add_argument("--coef", type=float, default=0.01)
    ap.add_argument("--impl", default="grouped", choices=["hf", "grouped"])
    ap.add_argument("--samples", type=int, default=32768, help="token expert sets kept per window")
    ap.add_argument("--out", required=True)
    ap.add_argument("--test-out", help="also write the window before --out's as a held-out pair")
    a = ap.parse_args()
    if a.steps % a.window or a.steps < (2 if a.test_out else 1) * a.window:
        ap.error("--steps must be a multiple of --window and hold the window(s)")
    work = Path(tempfile.mkdtemp(prefix="moe-record-"))
    try:
        plan = work / "plan.json"
        plan.write_text(json.dumps(plan_doc(a)))
        t0 = time.time()
        codes = launch(
            1,
            ["--plan", str(plan), "--checkpoint-dir", str(work / "ck"), "--cpu"],
            env=dict(os.environ, MOE_CPU_THREADS=os.environ.get("MOE_CPU_THREADS", "2")),
        )
        if codes != [0]:
            raise SystemExit(f"trainer failed: {codes}")
        full = json.loads((work / "ck" / "routing_stats.json").read_text())
        losses = json.loads((work / "ck" / "losses.json").read_text())["losses"]
        outs = (
            [(a.out, a.steps)]
            if not a.test_out
            else [(a.out, a.steps - a.window), (a.test_out, a.steps)]
        )
        for out, end in outs:
            window = _window(work / "ck", full, a, end)
            parse_routing_stats(window)
            window["source"] = "trainer"
            window["model"] += (
                f" balance={a.balance} coef={a.coef} real-text corpus, steps "
                f"{end - window['steps'] + 1}-{end} of {a.steps}"
            )
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(window, separators=(",", ":")))
            mm = max_mean_per_layer(window["load"])
            print(
                json.dumps(
                    {
                        "out": out,
                        "balance": a.balance,
                        "seconds": round(time.time() - t0, 1),
                        "lossFirst": round(losses[0], 3),
                        "lossLast": round(sum(losses[-10:]) / 10, 3),
                        "samples": len(window.get("tokenSamples", {}).get("experts", [[]])[0]),
                        "maxMeanPerLayer": [round(x, 2) for x in mm],
                        "maxMeanOfSummedLoad": round(
                            max_mean_per_layer([list(map(sum, zip(*window["load"], strict=True)))])[
                                0
                            ],
                            2,
                        ),
                    }
                )
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _window(ckpt: Path, full: dict, a, end: int) -> dict:
    """Totals at step ``end`` minus those at ``end - window``; the token sample of the run's final
    checkpoint restricted to those steps (a uniform sample of the run restricted to a window is a
    uniform sample of the window), cut to ``--samples``."""
    import numpy as np
    import torch

    start = max(0, end - a.window)

    def state_at(step: int) -> dict:
        return torch.load(ckpt / "ds" / f"step-{step}" / "trainer_state.pt", weights_only=False)

    last = state_at(a.steps)
    hi = last if end == a.steps else state_at(end)
    # trainer_state keeps slot ids; with no placement the slots are the original ids
    load = np.rint(hi["routing"]["load"].numpy()).astype(np.int64)
    co = np.rint(hi["routing"]["coact"].numpy()).astype(np.int64)
    tokens, steps = hi["routing"]["tokens"], hi["routing"]["steps"]
    if start:
        lo = state_at(start)
        load = load - np.rint(lo["routing"]["load"].numpy()).astype(np.int64)
        co = co - np.rint(lo["routing"]["coact"].numpy()).astype(np.int64)
        tokens, steps = tokens - lo["routing"]["tokens"], steps - lo["routing"]["steps"]
    smp = last["samples"]  # sorted by key: any prefix is uniform
    keep = ((smp["steps"] > start) & (smp["steps"] <= end)).numpy()
    ex = smp["experts"].numpy()[keep][: a.samples].astype(np.int64)  # [S, L, k]
    sample_steps = smp["steps"].numpy()[keep][: a.samples].tolist()  # [S], same order
    samples = np.sort(ex.transpose(1, 0, 2), axis=-1).tolist()
    return routing_stats_doc(
        load,
        co,
        tokens,
        steps,
        full["topK"],
        full["model"],
        samples=samples,
        sample_steps=sample_steps,
    )


if __name__ == "__main__":
    main()
