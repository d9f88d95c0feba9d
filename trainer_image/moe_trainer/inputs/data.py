"""Token data for the trainer: byte-level tokenizer, token streams, deterministic batches.

A batch is a pure function of (seed, sample index): sample `i` of the run is window
`order[i % n_windows]` of the token stream, where `order` is a seeded permutation redrawn each
epoch (:class:`WindowOrder`), or with the plan's ``training.data.order: sequential`` the windows in
stream order (files in path order, documents in file order: a curriculum, or data whose domain
changes during the run). The global sample index of (step, micro step, data-parallel rank, row)
is fixed, so each rank reads a disjoint shard and a resumed run reads exactly what the straight
run would have read: the data position is the step, nothing else needs saving.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_trainer.inputs.corpus import DOC_SEPARATOR, build_corpus

IGNORE_INDEX = -100  # a target that does not count in the loss (cross_entropy's default)


class DataError(ValueError):
    """The data source is missing, empty or too short."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus BOS/EOS/PAD. No files, no download."""

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (HF_HUB_OFFLINE)."""

    def __init__(self, path: str):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.EOS = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def make_tokenizer(path: str | None):
    return HFTokenizer(path) if path else ByteTokenizer()


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".md", ".text", "")
        )
    raise DataError(f"training.data.path: {str(path)!r} does not exist")


def tokens_from_text(path: str | os.PathLike, tokenizer) -> np.ndarray:
    """All documents (files; in a file, parts split by DOC_SEPARATOR) joined with EOS: tokens[N]."""
    parts = []
    eos = np.asarray([tokenizer.EOS], dtype=np.int32)
    for f in _text_files(Path(path)):
        for doc in f.read_text(encoding="utf-8", errors="replace").split(DOC_SEPARATOR):
            if doc.strip():
                parts += [tokenizer.encode(doc), eos]
    if not parts:
        raise DataError(f"training.data.path: {str(path)!r} holds no text")
    return np.concatenate(parts)


def tokens_from_npy(path: str | os.PathLike) -> np.ndarray:
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.npy")) if p.is_dir() else []
    if not files:
        raise DataError(f"training.data.path: no .npy token files at {str(p)!r}")
    arrays = [np.load(f, mmap_mode="r").reshape(-1) for f in files]
    return np.concatenate(arrays).astype(np.int32)


class WindowOrder:
    """Sample index -> window index: a seeded permutation of the ``n`` windows redrawn each
    epoch, or (``sequential``) the windows in order, epoch after epoch."""

    def __init__(self, seed: int, n: int, sequential: bool = False):
        self.seed, self.n, self.sequential = seed, n, sequential
        self._epoch: tuple[int, np.ndarray] | None = None

    def __call__(self, sample: int) -> int:
        epoch, i = divmod(sample, self.n)
        if self.sequential:
            return i
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n))
        return int(self._epoch[1][i])


def is_sequential(data_spec) -> bool:
    """The plan's ``training.data.order`` (absent: shuffled)."""
    return getattr(data_spec, "order", "shuffled") == "sequential"


@dataclass
class BatchSource:
    """Deterministic [micro_batch, seq_len + 1] windows of a token stream (or synthetic tokens)."""

    tokens: np.ndarray | None  # tokens[N], None for synthetic
    seq_len: int
    micro_batch: int
    seed: int
    vocab_size: int
    sequential: bool = False  # windows in stream order (WindowOrder), not a seeded shuffle

    def __post_init__(self):
        self.n_windows = 1
        if self.tokens is not None:
            self.n_windows = (len(self.tokens) - 1) // self.seq_len
            if self.n_windows < 1:
                raise DataError(
                    f"training.data: {len(self.tokens)} tokens are fewer than seqLen+1="
                    f"{self.seq_len + 1}"
                )
            if self.tokens.max() >= self.vocab_size:
                raise DataError(
                    f"training.data: token id {int(self.tokens.max())} >= model vocab_size "
                    f"{self.vocab_size}"
                )
        self.order = WindowOrder(self.seed, self.n_windows, self.sequential)

    masked = False  # every target counts (prepared chat data has a loss mask: prepared.py)

    def inputs_targets(
        self, step: int, micro: int, grad_accum: int, dp_rank: int, dp_size: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(inputs[mb, seq_len], targets[mb, seq_len]) of :meth:`batch`."""
        b = self.batch(step, micro, grad_accum, dp_rank, dp_size)
        return b[:, :-1], b[:, 1:]

    def _window(self, sample: int) -> np.ndarray:
        if self.tokens is None:
            rng = np.random.default_rng([self.seed, sample])
            return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64)
        start = self.order(sample) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(
        self, step: int, micro: int, grad_accum: int, dp_rank: int, dp_size: int
    ) -> np.ndarray:
        """batch[micro_batch, seq_len + 1] for optimizer step `step` (0-based), micro step
        `micro`."""
        first = ((step * grad_accum + micro) * dp_size + dp_rank) * self.micro_batch
        return np.stack([self._window(first + b) for b in range(self.micro_batch)])


def make_batch_source(
    data_spec, seq_len: int, micro_batch: int, seed: int, vocab_size: int
) -> BatchSource:
    """From the plan's `training.data`: kind text | tokens | corpus | synthetic | prepared, read
    in its ``order``."""
    kind, seq = data_spec.kind, is_sequential(data_spec)
    if kind == "synthetic":
        return BatchSource(None, seq_len, micro_batch, seed, vocab_size)
    if kind == "prepared" or (
        kind == "tokens" and (Path(data_spec.path) / "manifest.json").is_file()
    ):
        from moe_trainer.inputs.prepared import PreparedSource

        return PreparedSource(data_spec.path, seq_len, micro_batch, seed, vocab_size, seq)
    if kind == "tokens":
        tokens = tokens_from_npy(data_spec.path)
    else:
        tok = make_tokenizer(data_spec.tokenizer)
        path = data_spec.path if kind == "text" else build_corpus(cache_dir=data_spec.path)
        tokens = tokens_from_text(path, tok)
    return BatchSource(tokens, seq_len, micro_batch, seed, vocab_size, seq)


def lm_loss(logits, targets, masked: bool):
    """Cross-entropy of ``logits[mb, seq, V]`` against ``targets[mb, seq]``: the mean over every
    target, or with ``masked`` over the targets that count (0 when none does, not NaN)."""
    import torch.nn.functional as F

    x, y = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if not masked:
        return F.cross_entropy(x, y)
    valid = (y != IGNORE_INDEX).sum().clamp(min=1)
    return F.cross_entropy(x, y, ignore_index=IGNORE_INDEX, reduction="sum") / valid
