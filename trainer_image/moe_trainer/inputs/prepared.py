"""Reading prepared data (``moe-prepare-data``'s shards, DataManifest v1) without loading it:
every shard is memory-mapped, a batch copies only its rows.

Sample ``i`` of the run is row ``order[i % rows]`` with ``order`` a seeded permutation redrawn
each epoch, exactly as :class:`moe_trainer.inputs.data.BatchSource` picks windows, so resumed runs
and data-parallel ranks read what they would have read from the token stream. Chat data carries a
loss mask: target positions outside the assistant's turns become the ignore index.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moe_contracts.data import MANIFEST_FILE, parse_manifest
from moe_contracts.errors import DocumentError
from moe_trainer.inputs.data import IGNORE_INDEX, DataError, WindowOrder


class PreparedSource:
    """[micro_batch, seq_len + 1] rows of a prepared directory."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        micro_batch: int,
        seed: int,
        vocab_size: int,
        sequential: bool = False,
    ):
        self.path = Path(path)
        try:
            self.manifest = parse_manifest(json.loads((self.path / MANIFEST_FILE).read_text()))
        except FileNotFoundError:
            raise DataError(
                f"training.data.path: {str(self.path)!r} does not exist (no {MANIFEST_FILE})"
            ) from None
        except (OSError, ValueError, DocumentError) as exc:
            raise DataError(f"training.data.path: {self.path / MANIFEST_FILE}: {exc}") from None
        m = self.manifest
        if m.seq_len != seq_len:
            raise DataError(
                f"training.data: prepared for seqLen {m.seq_len}, the plan's is {seq_len}"
            )
        if m.tokenizer.vocab_size > vocab_size and m.tokenizer.kind == "byte":
            raise DataError(
                f"training.data: byte-level ids need vocab_size >= {m.tokenizer.vocab_size}, "
                f"the model has {vocab_size}"
            )
        self.seq_len, self.micro_batch, self.seed, self.vocab_size = (
            seq_len,
            micro_batch,
            seed,
            vocab_size,
        )
        self.tokens = [np.load(self.path / s.tokens, mmap_mode="r") for s in m.shards]
        self.masks = [
            np.load(self.path / s.mask, mmap_mode="r") if s.mask else None for s in m.shards
        ]
        for s, arr in zip(m.shards, self.tokens, strict=True):
            if arr.shape != (s.rows, seq_len + 1):
                raise DataError(
                    f"training.data: {s.tokens} has shape {arr.shape}, the manifest says "
                    f"({s.rows}, {seq_len + 1})"
                )
        self.starts = np.cumsum([0] + [s.rows for s in m.shards])
        self.n_windows = int(self.starts[-1])
        self.masked = any(x is not None for x in self.masks)
        self.order = WindowOrder(seed, self.n_windows, sequential)

    def _row(self, sample: int) -> tuple[np.ndarray, np.ndarray | None]:
        row = self.order(sample)
        shard = int(np.searchsorted(self.starts, row, side="right")) - 1
        local = row - int(self.starts[shard])
        mask = self.masks[shard]
        return (
            np.asarray(self.tokens[shard][local], dtype=np.int64),
            None if mask is None else np.asarray(mask[local], dtype=bool),
        )

    def _rows(self, step: int, micro: int, grad_accum: int, dp_rank: int, dp_size: int):
        first = ((step * grad_accum + micro) * dp_size + dp_rank) * self.micro_batch
        rows = [self._row(first + b) for b in range(self.micro_batch)]
        tokens = np.stack([r[0] for r in rows])
        if tokens.max() >= self.vocab_size:
            raise DataError(
                f"training.data: token id {int(tokens.max())} >= model vocab_size {self.vocab_size}"
            )
        masks = None if not self.masked else np.stack([r[1] for r in rows])
        return tokens, masks

    def batch(
        self, step: int, micro: int, grad_accum: int, dp_rank: int, dp_size: int
    ) -> np.ndarray:
        return self._rows(step, micro, grad_accum, dp_rank, dp_size)[0]

    def inputs_targets(self, step: int, micro: int, grad_accum: int, dp_rank: int, dp_size: int):
        """(inputs[mb, seq_len], targets[mb, seq_len]); targets outside the loss: IGNORE_INDEX."""
        tokens, masks = self._rows(step, micro, grad_accum, dp_rank, dp_size)
        targets = tokens[:, 1:].copy()
        if masks is not None:
            targets[~masks[:, 1:]] = IGNORE_INDEX
        return tokens[:, :-1], targets
