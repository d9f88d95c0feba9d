"""Hugging Face safetensors checkpoints, read one tensor (or a few rows of one) at a time.

What the loader (``moe_trainer.model.pretrained``) and the export (``moe_trainer.model.export``)
share:

* :class:`ShardReader`: ``safe_open`` handles, at most one shard open at a time (a shard's
  memory map is released before the next one is opened), rows of a tensor read through
  ``get_slice`` so a rank reads only the rows its partition needs;
* :func:`sources`: for every parameter and per-expert buffer of the model, a :class:`Source` that
  produces any row range of the *model-side* tensor from the disk tensors: names mapped by the
  model's family (``moe_trainer.families``: module renames, per-expert tensors stacked into
  ``gate_up_proj[E, 2F, H]`` / ``down_proj[E, H, F]``) and expert rows taken in the order of the
  plan's permutation (slot ``s`` holds original expert ``permutation[l][s]``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moe_trainer import families
from moe_trainer.model import models

log = logging.getLogger("moe_trainer.model.hf_checkpoint")

INDEX = "model.safetensors.index.json"


class CheckpointError(models.ModelError):
    """The model directory does not hold the tensors the model needs (exit 78)."""


def weight_map(path: str | Path) -> dict[str, str]:
    """Disk tensor name -> safetensors file name (relative to ``path``)."""
    from safetensors import safe_open

    root = Path(path)
    index = root / INDEX
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"model.path: {index} is not a safetensors index: {exc}"
            ) from None
        missing = sorted({f for f in wm.values() if not (root / f).is_file()})
        if missing:
            raise CheckpointError(f"model.path: {index} names missing shard(s) {missing[:5]}")
        return dict(wm)
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        extra = (
            " (pytorch_model*.bin is not read: save it with safetensors)"
            if any(root.glob("pytorch_model*.bin"))
            else ""
        )
        raise CheckpointError(f"model.path: {str(root)!r} holds no *.safetensors file{extra}")
    out: dict[str, str] = {}
    for name in files:
        try:
            with safe_open(str(root / name), framework="pt") as f:
                out.update(dict.fromkeys(f.keys(), name))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(
                f"model.path: {root / name} is not a safetensors file: {exc}"
            ) from None
    return out


class ShardReader:
    """Reads tensors of one checkpoint directory; keeps at most one shard open."""

    def __init__(self, path: str | Path, wmap: dict[str, str]):
        self.root, self.wmap = Path(path), wmap
        self._name: str | None = None
        self._file = None
        self._ctx = None
        self.bytes_read = 0

    def _open(self, key: str):
        from safetensors import safe_open

        name = self.wmap[key]
        if name != self._name:
            self.close()
            self._ctx = safe_open(str(self.root / name), framework="pt")
            self._file = self._ctx.__enter__()
            self._name = name
        return self._file

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(key).get_slice(key).get_shape())

    def rows(self, key: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` of dim 0 (a 0-d tensor: the tensor itself)."""
        sl = self._open(key).get_slice(key)
        t = sl[:] if not sl.get_shape() else sl[r0:r1]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
        self._ctx = self._file = self._name = None


@dataclass
class Source:
    """The model-side tensor of one parameter or buffer: ``shape`` and ``rows(r0, r1)``."""

    name: str
    shape: tuple[int, ...]
    rows: Callable[[int, int], torch.Tensor]
    first_key: str  # the disk tensor read first (orders the loading by shard)


def _direct(reader: ShardReader, name: str, key: str) -> Source:
    return Source(name, reader.shape(key), lambda a, b: reader.rows(key, a, b), key)


def _stacked(reader: ShardReader, name: str, key: str, perm: Sequence[int]) -> Source:
    """A disk tensor whose dim 0 is the expert: model row s = disk row perm[s]."""

    def rows(a: int, b: int) -> torch.Tensor:
        return torch.cat([reader.rows(key, perm[s], perm[s] + 1) for s in range(a, b)])

    return Source(name, reader.shape(key), rows, key)


def _per_expert(
    reader: ShardReader, name: str, keys: list[list[str]], perm: Sequence[int]
) -> Source:
    """One disk tensor (or a gate/up pair, concatenated on dim 0) per original expert."""
    part_shapes = [reader.shape(k) for k in keys[0]]
    rows_per_expert = sum(s[0] for s in part_shapes)
    shape = (len(keys), rows_per_expert, *part_shapes[0][1:])

    def rows(a: int, b: int) -> torch.Tensor:
        out = []
        for s in range(a, b):
            parts = [reader.rows(k, 0, reader.shape(k)[0]) for k in keys[perm[s]]]
            out.append(torch.cat(parts)[None])
        return torch.cat(out)

    return Source(name, shape, rows, keys[0][0])


@dataclass(frozen=True)
class MoENames:
    """Model-side names of one MoE block's per-expert tensors, and its MoE-layer index."""

    layer: int
    gate_up: str
    down: str
    router: tuple[str, ...]  # router weight, then router buffers


def moe_names(model: nn.Module, fam: families.Family) -> dict[str, MoENames]:
    """MoE block module name -> its per-expert tensor names (in the model's naming)."""
    out = {}
    for ref in models.find_moe_layers(model):
        b = ref.name
        out[b] = MoENames(
            ref.index,
            f"{b}.{fam.experts}.gate_up_proj",
            f"{b}.{fam.experts}.down_proj",
            (f"{b}.{fam.router}.weight", *(f"{b}.{fam.router}.{x}" for x in fam.router_buffers)),
        )
    return out


def _expert_re(fam: families.Family) -> re.Pattern[str] | None:
    if fam.per_expert is None:
        return None
    g, u, d = (re.escape(x) for x in fam.per_expert)
    return re.compile(
        rf"^(?P<block>.+)\.{re.escape(fam.experts)}\.(?P<e>\d+)\.(?P<p>{g}|{u}|{d})\.weight$"
    )


def sources(
    model: nn.Module,
    fam: families.Family,
    reader: ShardReader,
    permutation: Sequence[Sequence[int]] | None,
    tensors: Sequence[tuple[str, tuple[int, ...]]],
) -> tuple[list[Source], list[str]]:
    """A Source for each model tensor in ``tensors`` (name, shape), in shard order, and the disk
    tensors nothing reads. Raises CheckpointError for a missing tensor, a missing expert or a
    shape that differs."""
    blocks = moe_names(model, fam)
    num_experts = models.num_experts_of(model)
    perm_of: dict[str, Sequence[int]] = {}
    identity = list(range(num_experts))
    for names in blocks.values():
        row = identity if permutation is None else list(permutation[names.layer])
        for n in (names.gate_up, names.down, *names.router):
            perm_of[n] = row
    direct: dict[str, str] = {}
    experts: dict[tuple[str, str], dict[int, str]] = {}
    ere = _expert_re(fam)
    for key in reader.wmap:
        name = fam.from_disk(key)
        m = ere.match(name) if ere is not None else None
        if m is not None:
            experts.setdefault((m["block"], m["p"]), {})[int(m["e"])] = key
        else:
            direct[name] = key
    used: set[str] = set()
    out: list[Source] = []
    missing: list[str] = []
    for name, shape in tensors:
        perm = perm_of.get(name)
        src = None
        if name in direct:
            key = direct[name]
            used.add(key)
            src = (
                _stacked(reader, name, key, perm)
                if perm is not None
                else _direct(reader, name, key)
            )
        elif (
            perm is not None
            and fam.per_expert is not None
            and name.endswith(("gate_up_proj", "down_proj"))
        ):
            block = name.rsplit(".", 2)[0]
            g, u, d = fam.per_expert
            parts = (g, u) if name.endswith("gate_up_proj") else (d,)
            by_part = [experts.get((block, p), {}) for p in parts]
            absent = [
                f"{fam.to_disk(block)}.{fam.experts}.{e}.{p}.weight"
                for p, have in zip(parts, by_part, strict=True)
                for e in range(num_experts)
                if e not in have
            ]
            if absent and len(absent) < len(parts) * num_experts:
                raise CheckpointError(
                    f"model.path: {len(absent)} expert tensor(s) missing, e.g. {absent[:3]}"
                )
            if not absent:
                keys = [[have[e] for have in by_part] for e in range(num_experts)]
                used.update(k for ks in keys for k in ks)
                src = _per_expert(reader, name, keys, perm)
        if src is None:
            missing.append(fam.to_disk(name))
            continue
        if tuple(src.shape) != tuple(shape):
            raise CheckpointError(
                f"model.path: tensor {fam.to_disk(name)!r} has shape {list(src.shape)}, the "
                f"model built from hfConfig needs {list(shape)}"
            )
        out.append(src)
    if missing:
        raise CheckpointError(
            f"model.path: {len(missing)} tensor(s) the model needs are not in the checkpoint, "
            f"e.g. {missing[:5]}"
        )
    order = {name: i for i, name in enumerate(sorted(set(reader.wmap.values())))}
    out.sort(key=lambda s: (order[reader.wmap[s.first_key]], s.first_key))
    unused = sorted(set(reader.wmap) - used)
    return out, unused


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1
