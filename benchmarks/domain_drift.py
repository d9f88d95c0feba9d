"""Does a data-domain switch drift the tiny CPU model's routing enough for re-placement to pay?

    .venv/bin/python benchmarks/domain_drift.py --out benchmarks/results/domain_drift

Issue 33 asks for a cluster run whose data switches domain mid-run, re-places once, and sends
fewer cross-group bytes than staying. The cluster tests train ``tiny-mixtral`` on CPU (random
init, a few dozen steps). This measures, on that model's routing (the preset as the operator
builds it, seed 0, no training; ``--experts`` also a 32-expert variant), what such a run would
have to win: ``topology_aware`` is fitted on byte-tokenised English prose (the trainer's corpus)
for 2 NVLink groups of 1 rank (EP 2, the cluster tests' shape), then, per window of
``--window`` tokens of each domain (more prose: no switch; arithmetic lines; Python source):

- rise: the prose layout's cross-group bytes (de-duplicating dispatcher, exact byte model
  ``core.dispatch.dispatch_bytes``) on the window over its bytes on the prose it was fitted on,
  per token; what staying costs after the switch;
- held-out gain: ``topology_aware`` re-fitted on the window (what a re-plan would write),
  against the prose layout, both scored on the NEXT window of the same domain: what switching
  would have saved.

A domain switch that re-placement can exploit shows a rise and a positive held-out gain well
above the windows of more prose (sample noise). Threads pinned to 1; the model runs on CPU.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse
import glob
import json
import time
from pathlib import Path

import numpy as np

from moe_contracts.routing import RoutingStats
from moejob_operator.core import dispatch, models, placement, routing
from moejob_operator.core.topology import ClusterTopology

SEQ = 64  # examples/tiny-cpu.yaml seqLen
WINDOWS = 4
HIDDEN_BYTES = 64 * 4  # tiny-mixtral hidden 64, fp32 (ratios do not depend on it)


def _texts(n: int) -> dict[str, str]:
    from moe_trainer.inputs.corpus import DOC_SEPARATOR, iter_texts

    prose = " ".join(iter_texts(n * 4)).replace(DOC_SEPARATOR, " ").encode("ascii", "ignore")
    rng = np.random.default_rng(0)
    lines: list[str] = []
    while sum(map(len, lines)) < n:
        a, b = (int(x) for x in rng.integers(0, 10_000, 2))
        lines.append(f"{a} * {b} = {a * b}; {a} + {b} = {a + b}\n")
    code = "".join(
        Path(f).read_text(errors="ignore")
        for f in sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
        + sorted(glob.glob(os.path.join(os.path.dirname(argparse.__file__), "email", "*.py")))
    )
    return {
        "prose": prose.decode(),
        "arithmetic": "".join(lines),
        "code": code.encode("ascii", "ignore").decode(),
    }


class Router:
    """The preset's model (random init, seed 0) and the top-k experts of every token."""

    def __init__(self, experts: int):
        import torch

        from moe_trainer.inputs.data import ByteTokenizer
        from moe_trainer.model.models import build_model

        cfg = dict(models.resolve_model("tiny-mixtral").hf_config)
        cfg["num_local_experts"] = experts
        self.E, self.K = experts, int(cfg["num_experts_per_tok"])
        self.model = build_model(cfg, seed=0).eval()
        self.caught: list = []
        for layer in self.model.model.layers:
            layer.mlp.gate.register_forward_hook(self._hook)
        self.tok = ByteTokenizer()
        self.torch = torch

    def _hook(self, _mod, _inp, out) -> None:
        self.caught.append(out[0] if isinstance(out, tuple) else out)

    def __call__(self, text: str) -> np.ndarray:
        """``te[L, T, K]`` for ``text`` cut into sequences of ``SEQ`` byte tokens."""
        ids = np.asarray(self.tok.encode(text))
        ids = ids[: len(ids) // SEQ * SEQ].reshape(-1, SEQ)
        self.caught.clear()
        with self.torch.no_grad():
            self.model(input_ids=self.torch.tensor(ids, dtype=self.torch.long))
        return np.stack(
            [
                self.torch.topk(o.reshape(-1, self.E), self.K, -1).indices.numpy()
                for o in self.caught
            ]
        )


def _stats(te: np.ndarray, E: int) -> RoutingStats:
    load, coact = routing.count_routing(te, E)
    return RoutingStats(te.shape[0], E, te.shape[2], te.shape[1], load, coact, token_experts=te)


def run(experts: int, window: int) -> dict:
    topo = ClusterTopology.synthetic(nodes=2, gpus_per_node=1, group_size=1)
    route = Router(experts)
    texts = _texts(window * (WINDOWS + 2) * 2)

    def fit(te):
        return placement.solve(
            "topology_aware",
            topo,
            _stats(te, experts),
            ep_size=2,
            num_experts=experts,
            num_layers=te.shape[0],
        )

    def per_token(pl, te) -> float:
        got = dispatch.dispatch_bytes(pl, topo, te, hidden_size=HIDDEN_BYTES, bytes_per_elem=1)
        return got["dedup"]["crossGroup"] / te.shape[1]

    fit_te = route(texts["prose"][: 4 * window])
    prose_layout = fit(fit_te)
    base = per_token(prose_layout, fit_te)
    out: dict = {"fitTokens": int(fit_te.shape[1]), "domains": {}}
    for name, text in texts.items():
        start = 4 * window if name == "prose" else 0
        rows = []
        for w in range(WINDOWS):
            a = route(text[start + w * window : start + (w + 1) * window])
            b = route(text[start + (w + 1) * window : start + (w + 2) * window])
            stay_next = per_token(prose_layout, b)
            rows.append(
                {
                    "risePercent": round(100 * (per_token(prose_layout, a) / base - 1), 2),
                    "heldOutGainPercent": round(100 * (1 - per_token(fit(a), b) / stay_next), 2),
                }
            )
        out["domains"][name] = {
            "windows": rows,
            "meanRisePercent": round(float(np.mean([r["risePercent"] for r in rows])), 2),
            "meanHeldOutGainPercent": round(
                float(np.mean([r["heldOutGainPercent"] for r in rows])), 2
            ),
        }
    return out


def markdown(result: dict) -> str:
    lines = [
        f"Command: `{result['command']}`",
        "",
        (
            "tiny-mixtral routing (random init, seed 0) under a domain switch, EP 2 over 2 NVLink "
            f"groups of 1 rank, windows of {result['window']} byte tokens; layout fitted on prose. "
            "Rise: the prose layout's cross-group bytes per token on the window over on its fit "
            "prose. Held-out gain: a layout re-fitted on the window vs the prose layout, both on "
            "the next window."
        ),
        "",
        "| experts | domain | mean rise | mean held-out gain | windows (rise / gain, %) |",
        "|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        for name, d in r["domains"].items():
            ws = ", ".join(
                f"{w['risePercent']:+.1f} / {w['heldOutGainPercent']:+.1f}" for w in d["windows"]
            )
            lines.append(
                f"| {r['experts']} | {name} | {d['meanRisePercent']:+.2f}% | "
                f"{d['meanHeldOutGainPercent']:+.2f}% | {ws} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--window", type=int, default=4096, help="tokens per window")
    ap.add_argument("--out", default="benchmarks/results/domain_drift")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    runs = [{"experts": e, **run(e, args.window)} for e in args.experts]
    cmd = "benchmarks/domain_drift.py --out " + args.out
    if args.experts != [8, 32] or args.window != 4096:
        cmd += f" --experts {' '.join(map(str, args.experts))} --window {args.window}"
    result = {
        "command": cmd,
        "window": args.window,
        "shape": "EP 2, 2 NVLink groups x 1 rank, dispatcher dedup, seqLen 64",
        "seconds": round(time.perf_counter() - t0, 1),
        "runs": runs,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
