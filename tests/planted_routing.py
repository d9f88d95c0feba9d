"""A tiny MoE whose routing depends on the data's domain, as a pretrained MoE's does and a randomly
initialised one's does not (``benchmarks/domain_drift.py``): the model and the texts the
re-placement cluster tests (tests/test_replan_drift_cluster.py,
tests/test_replan_trainer_cluster.py) train it on.

:func:`planted_model` writes a ``save_pretrained`` tiny-mixtral: each byte token's embedding
carries one of 8 orthonormal directions, by domain (arithmetic symbols or not) and one of 4
classes, and every MoE router maps the prose directions to the expert pairs (0, 1), (2, 3),
(4, 5), (6, 7) and the arithmetic ones to (1, 2), (3, 4), (5, 6), (7, 0), the classes balanced by
the texts' byte counts. A layout in 2 groups of 4 experts keeps either all the prose pairs in one
group (the contiguous layout does) or all the arithmetic ones, never both. The rest of the model
is the preset's random init. Training moves the deeper layers' routing over a few dozen steps
(their routers see more than the embedding): a layout fitted early can be re-fitted later for a
few percent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def prose_text(n_docs_bytes: int) -> str:
    """ASCII English prose (the trainer's corpus: standard-library docstrings)."""
    from moe_trainer.inputs.corpus import DOC_SEPARATOR, iter_texts

    text = " ".join(iter_texts(n_docs_bytes)).replace(DOC_SEPARATOR, " ")
    return text.encode("ascii", "ignore").decode()


def arithmetic_text(n: int) -> str:
    rng = np.random.default_rng(0)
    lines = []
    while sum(map(len, lines)) < n:
        a, b = (int(x) for x in rng.integers(0, 10_000, 2))
        lines.append(f"{a} * {b} = {a * b}; {a} + {b} = {a + b}\n")
    return "".join(lines)


ARITHMETIC_SYMBOLS = frozenset(b"0123456789*+=;")
ROUTER_SCALE = 8.0  # router logits of the planted pairs (the other experts' are about 0)


def _classes(text: str, symbols) -> dict[int, int]:
    """Byte -> class 0..3 for the bytes of ``symbols``: heaviest first into the lightest class
    (by their counts in ``text``), so that each class routes about a quarter of the tokens."""
    counts = np.bincount(np.frombuffer(text.encode(), dtype=np.uint8), minlength=1 + max(symbols))
    load = [0] * 4
    out = {}
    for t in sorted(symbols, key=lambda t: (-counts[t], t)):
        k = int(np.argmin(load))
        out[t] = k
        load[k] += int(counts[t])
    return out


def planted_model(where: Path, prose: str, arithmetic: str) -> Path:
    """``save_pretrained`` of tiny-mixtral (seed 0) with domain-dependent routing (module
    docstring), readable by the pods."""
    import torch

    from moe_trainer.model.models import build_model
    from moejob_operator.core import models

    model = build_model(dict(models.resolve_model("tiny-mixtral").hf_config), seed=0)
    cfg = model.config
    H, E = cfg.hidden_size, cfg.num_local_experts
    assert E == 8 and cfg.num_experts_per_tok == 2
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(H, 8, generator=gen))
    direction = q.T  # [8, H]: prose class k = 0..3, arithmetic class 4 + k
    router = torch.zeros(E, H)
    for k in range(4):
        router[[2 * k, 2 * k + 1]] += direction[k]  # prose: (0, 1), (2, 3), (4, 5), (6, 7)
        router[[2 * k + 1, (2 * k + 2) % E]] += direction[4 + k]  # (1, 2), (3, 4), (5, 6), (7, 0)
    others = set(range(cfg.vocab_size)) - ARITHMETIC_SYMBOLS
    cls = _classes(prose, others)
    cls.update({t: 4 + k for t, k in _classes(arithmetic, ARITHMETIC_SYMBOLS).items()})
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        for t in range(cfg.vocab_size):
            emb[t] = direction[cls[t]] + 0.1 * emb[t]
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.copy_(ROUTER_SCALE * router + 0.01 * torch.randn(w.shape, generator=gen))
    model.save_pretrained(where)
    for f in where.iterdir():
        f.chmod(0o644)
    return where
