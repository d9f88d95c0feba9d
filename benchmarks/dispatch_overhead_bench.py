"""The dedup dispatcher's cost where nothing is sent: EP = 1 unchanged, its extra work per layer.

    .venv/bin/python benchmarks/dispatch_overhead_bench.py \\
        --out benchmarks/results/dispatch_overhead_h200.json
    .venv/bin/python benchmarks/dispatch_overhead_bench.py --device cpu --tokens 2048 \\
        --hidden 256 --out benchmarks/results/dispatch_overhead_cpu.json

One process, one device (GPU if present). Two measurements, each against a baseline in the same run:

1. **EP = 1 unchanged.** A Mixtral MoE layer replaced by DeepSpeed AutoEP at EP = 1 (today's path),
   forward + backward tokens/s, then the same layer swapped to ``DedupEPMoELayer`` (the trainer's
   class swap; at EP = 1 it must fall through to AutoEP's own forward). Alternating rounds; the
   ratio should be 1 within noise (medians of alternating rounds; a shared CPU is noisy).
2. **Extra work per layer** of the dedup path that AutoEP's path does not have: building the
   de-duplicated count vector, its device-to-host copy (the one sync), and the stage A / stage B /
   expert index building (``nonzero_static``, masks, the stable sort by local expert) for an EP
   group of 2 groups x 4 ranks, with the routing this rank produced standing in for what the
   peers send (no collectives on one device). Reported in microseconds per layer next to the
   layer's own forward + backward time.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "trainer_image")]


def sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, iters: int) -> float:
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per layer call")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import os

    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if dev.type == "cuda" else "gloo")
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from transformers import MixtralConfig, MixtralForCausalLM

    from moe_trainer.dispatch import dedup_ep

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=a.experts,
        num_experts_per_tok=a.topk,
        max_position_embeddings=64,
    )
    model = MixtralForCausalLM(cfg).to(dtype)
    ae = AutoEP(
        model, parse_autoep_config({"enabled": True, "autoep_size": 1, "preset_model": "mixtral"})
    )
    ae.replace_moe_layers(ae.ep_parser(), ep_size=1, ep_rank=0)
    layer = model.model.layers[0].mlp.to(dev)
    autoep_cls = type(layer)
    x = torch.randn(1, a.tokens, a.hidden, device=dev, dtype=dtype, requires_grad=True)

    def step():
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()

    # 1. EP = 1: today's class vs the swapped class, alternating
    swapped = dedup_ep.layer_class()
    times = {"autoep": [], "dedup_class": []}
    for _ in range(a.rounds):
        for name, cls in (("autoep", autoep_cls), ("dedup_class", swapped)):
            layer.__class__ = cls
            times[name].append(timed(step, dev, a.iters))
    layer.__class__ = autoep_cls
    tps = {k: a.tokens / sorted(v)[len(v) // 2] for k, v in times.items()}  # median round

    # 2. the dedup path's extra per-layer work, 2 groups x 4 ranks
    P, E, K, T = 8, a.experts, a.topk, a.tokens
    layout = dedup_ep.contiguous_layout(E, P, [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1])
    plan = dedup_ep.Plan(layout, 0, None, None, None, dev)
    with torch.no_grad():
        sel = layer.router(x.reshape(-1, a.hidden).detach())[1]

    def index_work():
        return dedup_ep.index_work(plan, sel)

    extra = sorted(timed(index_work, dev, a.iters) for _ in range(a.rounds))[a.rounds // 2]
    layer_s = sorted(times["autoep"])[a.rounds // 2]
    doc = {
        "command": " ".join(["benchmarks/dispatch_overhead_bench.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or "cpu",
        "dtype": str(dtype),
        "tokens": T,
        "hidden": a.hidden,
        "ffn": a.ffn,
        "experts": E,
        "topK": K,
        "ep1TokensPerSecondMedianRound": {k: round(v, 1) for k, v in tps.items()},
        "ep1Ratio": round(tps["dedup_class"] / tps["autoep"], 4),
        "ep1SecondsPerRound": times,
        "extraIndexWorkMicrosecondsPerLayer": round(extra * 1e6, 1),
        "layerForwardBackwardMicroseconds": round(layer_s * 1e6, 1),
        "extraVsLayer": round(extra / layer_s, 4),
        "extraLayout": "2 groups x 4 ranks, this rank's routing standing in for the peers'",
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
