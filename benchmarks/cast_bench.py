"""bf16 -> fp32 gradient casts on the GPU: which way of writing the one-rank hand-off's copy runs at
memory bandwidth (``moe_trainer.model.perf.install_single_rank_grads``; docs/performance.md).

    python3 benchmarks/cast_bench.py --out $OUT        (CUDA only)

The 3.4 B benchmark model's parameter shapes (``bench-mixtral-3b``, one tensor per parameter, in
their order), each cast from a bf16 tensor into a slice of one flat fp32 buffer, as the hand-off
does it; per variant the median of 5 timed passes over all tensors (CUDA events), and the
effective bandwidth (2 B read + 4 B written per element).
Variants: ``copy_`` (``Tensor.copy_``), ``foreach_copy`` (``torch._foreach_copy_`` per tensor),
``foreach_copy_all`` (one ``_foreach_copy_`` over every tensor), ``compiled`` (``torch.compile``
of the copy, dynamic shapes), ``add_`` (into a zeroed buffer, the accumulation path).
Writes ``cast_h200.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def shapes() -> list[int]:
    from moejob_operator.core import models
    from moejob_operator.core.memory import _param_tensors

    return _param_tensors(models.resolve_model("bench-mixtral-3b").spec, 1)


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sizes = shapes()
    total = sum(sizes)
    dev = torch.device("cuda")
    srcs = [torch.randn(n, device=dev).to(torch.bfloat16) for n in sizes]
    flat = torch.empty(total, device=dev, dtype=torch.float32)
    parts, off = [], 0
    for n in sizes:
        parts.append(flat.narrow(0, off, n))
        off += n

    @torch.compile(dynamic=True)
    def compiled_copy(dst, src):
        dst.copy_(src)

    variants = {
        "copy_": lambda: [d.copy_(s) for d, s in zip(parts, srcs, strict=True)],
        "foreach_copy": lambda: [
            torch._foreach_copy_([d], [s]) for d, s in zip(parts, srcs, strict=True)
        ],
        "foreach_copy_all": lambda: torch._foreach_copy_(parts, srcs),
        "compiled": lambda: [compiled_copy(d, s) for d, s in zip(parts, srcs, strict=True)],
        "add_": lambda: [d.add_(s) for d, s in zip(parts, srcs, strict=True)],
    }
    results = {"tensors": len(sizes), "elements": total, "device": torch.cuda.get_device_name()}
    for name, fn in variants.items():
        fn()
        fn()
        torch.cuda.synchronize()
        ms = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        ok = torch.equal(flat.narrow(0, 0, sizes[0]), srcs[0].float()) or name == "add_"
        med = statistics.median(ms)
        results[name] = {"ms": med, "tbPerS": 6 * total / med / 1e9, "exact": bool(ok)}
        print(f"{name:18s} {med:8.2f} ms  {6 * total / med / 1e9:6.2f} TB/s  exact={ok}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cast_h200.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
