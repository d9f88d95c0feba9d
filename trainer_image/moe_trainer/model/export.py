"""The trained model as a Hugging Face directory (plan ``output``; ``moe-export`` offline).

What is written (docs/contracts.md "Export"): safetensors shards of at most :data:`SHARD_BYTES`
(+ ``model.safetensors.index.json`` when there are several), ``config.json`` (the plan's
``hfConfig`` with the trained dtype), ``generation_config.json``, the tokenizer files of
``model.path`` (or of ``training.data.tokenizer``) when there are any, and ``export.json``.

How: the tensors are enumerated as transformers names them (a parameter-free "meta" copy of the
model gives the names, shapes and order), and each one is produced from the trained engine's
module *one at a time*: ZeRO-3 gathers the one parameter (``GatheredParameters``) on every rank,
AutoEP's experts of one layer and projection are gathered from their expert-data-parallel
partitions and then from the EP ranks onto rank 0, the placement's permutation is undone (rows of
expert tensors, router rows and per-expert router buffers back in original expert order), and
rank 0 converts it to the family's checkpoint layout (``moe_trainer.families``: per-expert tensors
and module names as ``save_pretrained`` writes them) and adds it to the shard it is filling. So
no GPU ever holds more than one tensor (one layer's experts of one projection) beyond training's
own memory, and rank 0's host holds at most one shard.

``path`` is usually a volume's mount point (``spec.output``), which cannot be renamed, so the
export is committed file by file inside it: rank 0 writes everything into
``<path>/.export-<step>.tmp/``, removes ``<path>/export.json`` (the directory is then "being
written"), moves each file into ``path`` with ``os.replace`` (atomic per file, same filesystem),
deletes the files the previous export listed that this one does not, and writes ``export.json``
last. An export in ``path`` is complete exactly when ``export.json`` is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_contracts import env as E
from moe_trainer import families
from moe_trainer.inspect_model import TOKENIZER_FILES  # export copies what inspection reports
from moe_trainer.model import models

log = logging.getLogger("moe_trainer.model.export")

SHARD_BYTES = 2 << 30
MANIFEST, MANIFEST_KIND = "export.json", "MoEExport"


class ExportError(RuntimeError):
    pass


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gathered(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly ZeRO-3 partitioned) parameter, on every rank of its
    partition group, detached and on the CPU."""
    if not hasattr(param, "ds_id"):
        return param.detach().cpu()
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.detach().cpu().clone()


class _ModelView:
    """The trained module seen under transformers' tensor names (original expert order)."""

    def __init__(self, module: nn.Module, fam: families.Family, permutation):
        self.module, self.fam = module, fam
        self.params = dict(module.named_parameters())
        self.buffers = dict(module.named_buffers())
        self.blocks = {ref.name: ref for ref in models.find_moe_layers(module)}
        self.inverse = {
            name: torch.argsort(torch.as_tensor(list(permutation[ref.index])))
            for name, ref in self.blocks.items()
        }

    def _block_of(self, name: str) -> str | None:
        for b in self.blocks:
            if name.startswith(b + "."):
                return b
        return None

    def _plain(self, name: str) -> torch.Tensor:
        if name in self.params:
            return _gathered(self.params[name])
        if name in self.buffers:
            return self.buffers[name].detach().cpu()
        raise ExportError(f"the trained model has no tensor {name!r}")

    def _autoep_experts(self, block: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
        """[E, ...] of AutoEP experts ``names`` (w1/w3 concatenated on dim 1), slot order, on
        global rank 0 (None elsewhere)."""
        from moe_trainer.dispatch.dedup_ep import ep_global_ranks

        local = torch.cat([_gathered(getattr(block.experts, n)) for n in names], dim=1)
        ranks = ep_global_ranks(block.ep_group)
        if len(ranks) == 1 or 0 not in ranks:
            return local if _rank() == 0 else None  # type: ignore[return-value]
        parts = [torch.empty_like(local) for _ in ranks] if _rank() == 0 else None
        dist.gather(local, parts, dst=0, group=block.ep_group)
        return torch.cat(parts) if parts is not None else None  # type: ignore[return-value]

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor transformers calls ``name``, original expert order; collective (every rank
        calls it for every name, in the same order); None on ranks other than 0."""
        fam, b = self.fam, self._block_of(name)
        if b is None:
            t = self._plain(name)
            return t if _rank() == 0 else None
        block = self.blocks[b].block
        autoep = hasattr(block, "router") and hasattr(block, "ep_group")
        sub = name[len(b) + 1 :]
        permuted = True
        if sub == f"{fam.experts}.gate_up_proj":
            t = (
                self._autoep_experts(block, ("w1", "w3"))
                if autoep
                else self._plain(f"{b}.{fam.experts}.gate_up_proj")
            )
        elif sub == f"{fam.experts}.down_proj":
            t = self._autoep_experts(block, ("w2",)) if autoep else self._plain(name)
        elif sub.startswith(f"{fam.router}."):
            leaf = sub[len(fam.router) + 1 :]
            t = self._plain(
                f"{b}.router.{'gate.weight' if leaf == 'weight' else leaf}" if autoep else name
            )
        else:
            permuted = False
            if autoep:
                head, _, rest = sub.partition(".")
                autoep_names = ("shared_experts", "shared_experts_gate")
                alias = dict(zip(fam.shared_modules, autoep_names, strict=False))
                sub = f"{alias.get(head, head)}.{rest}"
            t = self._plain(f"{b}.{sub}")
        if _rank() != 0 or t is None:
            return None
        if permuted:
            t = t.index_select(0, self.inverse[b])
        return t


def _disk_tensors(
    fam: families.Family, name: str, t: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of one model tensor (per-expert split, module renames)."""
    if fam.per_expert is not None and name.endswith(
        (f".{fam.experts}.gate_up_proj", f".{fam.experts}.down_proj")
    ):
        prefix = name.rsplit(".", 1)[0]
        g, u, d = fam.per_expert
        out = []
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                f = t.shape[1] // 2
                out += [
                    (f"{prefix}.{e}.{g}.weight", t[e, :f]),
                    (f"{prefix}.{e}.{u}.weight", t[e, f:]),
                ]
            else:
                out.append((f"{prefix}.{e}.{d}.weight", t[e]))
        return [(fam.to_disk(n), x.contiguous()) for n, x in out]
    return [(fam.to_disk(name), t.contiguous())]


def hf_tensor_names(hf_config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor ``save_pretrained`` would write, in its order."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skel = AutoModelForCausalLM.from_config(models.build_hf_config(hf_config))
    keep = set(skel.state_dict())
    out = [(n, tuple(p.shape)) for n, p in skel.named_parameters()]
    out += [(n, tuple(b.shape)) for n, b in skel.named_buffers() if n in keep]
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(out: Path, final: Path, step: int, family: str) -> dict[str, Any]:
    """``export.json``: every file's size and sha256, and one sha256 over ``<name>\\0<sha>\\n``
    of all files in name order."""
    files = [
        {"name": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != MANIFEST
    ]
    total = hashlib.sha256()
    for f in files:
        total.update(f"{f['name']}\0{f['sha256']}\n".encode())
    return {
        "kind": MANIFEST_KIND,
        "version": 1,
        "path": str(final),
        "step": int(step),
        "family": family,
        "bytes": sum(f["bytes"] for f in files),
        "sha256": total.hexdigest(),
        "files": files,
    }


class _ShardWriter:
    """Rank 0: fills shards of at most SHARD_BYTES and writes each when full."""

    def __init__(self, out: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES):
        self.out, self.dtype, self.limit = out, dtype, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.to(self.dtype) if t.is_floating_point() else t
        n = t.numel() * t.element_size()
        if self.pending and self.size + n > self.limit:
            self.flush()
        self.pending[name] = t
        self.size += n
        self.total += n

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        i = len(self.files)
        save_file(self.pending, str(self.out / f"part-{i}.safetensors"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        """Name the shards as transformers does; write the index when there are several."""
        self.flush()
        n = len(self.files)
        if n == 1:
            (self.out / "part-0.safetensors").rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / f"part-{i}.safetensors").rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _side_files(out: Path, hf_config: dict, dtype: torch.dtype, sources: list[str | None]) -> None:
    """config.json, generation_config.json and tokenizer files (from the first source dir that
    has them)."""
    from transformers import GenerationConfig

    config = models.build_hf_config(hf_config)
    config.use_cache = True
    config.dtype = dtype
    fam = families.for_model_type(hf_config.get("model_type"))
    config.architectures = [fam.causal_lm_class]
    config.save_pretrained(out)
    dirs = [Path(s) for s in sources if s and Path(s).is_dir()]
    gen = next(
        (d / "generation_config.json" for d in dirs if (d / "generation_config.json").is_file()),
        None,
    )
    if gen is not None:
        shutil.copy2(gen, out / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    for d in dirs:
        found = [f for f in TOKENIZER_FILES if (d / f).is_file()]
        if found:
            for f in found:
                shutil.copy2(d / f, out / f)
            return


def _commit(staging: Path, final: Path, doc: dict[str, Any]) -> None:
    """Move the staged files into ``final``, drop the previous export's leftovers, then write the
    manifest (last: its presence marks a complete export)."""
    old = final / MANIFEST
    previous: set[str] = set()
    if old.is_file():
        try:
            previous = {f["name"] for f in json.loads(old.read_text()).get("files", [])}
        except (OSError, ValueError, TypeError, KeyError):
            previous = set()
        old.unlink()
    names = {f["name"] for f in doc["files"]}
    for name in sorted(names):
        os.replace(staging / name, final / name)
    for name in sorted(previous - names):
        with contextlib.suppress(FileNotFoundError):
            (final / name).unlink()
    tmp = final / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, old)
    shutil.rmtree(staging, ignore_errors=True)


def export_model(
    module: nn.Module,
    hf_config: dict,
    permutation,
    path: str | Path,
    step: int,
    *,
    sources: list[str | None] = (),  # type: ignore[assignment]
    shard_bytes: int = SHARD_BYTES,
) -> dict[str, Any] | None:
    """Write the HF directory of ``module`` (the engine's module, every rank calls this) to
    ``path``; returns the manifest on rank 0, None elsewhere."""
    t0 = time.perf_counter()
    fam = families.for_model_type(hf_config.get("model_type"))
    final = Path(path)
    rank0 = _rank() == 0
    tmp = final / f".export-{step}.tmp"
    dtype = next(module.parameters()).dtype
    problem = [None]
    if rank0:
        try:
            final.mkdir(exist_ok=True)  # a mount point exists already; a plain path's parent must
            for stale in final.glob(".export-*.tmp"):
                shutil.rmtree(stale)
            tmp.mkdir()
        except OSError as exc:
            problem = [f"output.path: cannot write into {str(final)!r}: {exc}"]
    if dist.is_initialized():  # every rank stops together, or none does
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ExportError(problem[0])
    view = _ModelView(module, fam, permutation)
    writer = _ShardWriter(tmp, dtype, shard_bytes) if rank0 else None
    for name, shape in hf_tensor_names(hf_config):
        t = view.tensor(name)
        if writer is None or t is None:
            continue
        if tuple(t.shape) != shape:
            raise ExportError(
                f"{name}: the trained model has {list(t.shape)}, expected {list(shape)}"
            )
        for disk_name, x in _disk_tensors(fam, name, t):
            writer.add(disk_name, x)
    if not rank0 or writer is None:
        if dist.is_initialized():
            dist.barrier()
        return None
    writer.finish()
    _side_files(tmp, hf_config, dtype, list(sources))
    doc = manifest(tmp, final, step, fam.name)
    _commit(tmp, final, doc)
    doc["seconds"] = round(time.perf_counter() - t0, 3)
    log.info(
        "exported step %d to %s: %.1f MiB in %d file(s), %.1fs",
        step,
        final,
        doc["bytes"] / 2**20,
        len(doc["files"]),
        doc["seconds"],
    )
    if dist.is_initialized():
        dist.barrier()
    return doc


def progress_output(doc: dict[str, Any]) -> dict[str, Any]:
    """The TrainerProgress ``output`` object of a manifest."""
    return {k: doc[k] for k in ("path", "bytes", "sha256", "step")}


class Exporter:
    """When the trainer exports (plan ``output``): after the last step, and at every
    ``everyCheckpoints``-th checkpoint step when that is > 0. ``last``: the progress ``output``
    object of the latest export (rank 0)."""

    def __init__(self, plan, permutation):
        from moe_trainer.model.model_setup import hf_config_of

        self.output, self.permutation = plan.output, permutation
        self.hf_config = hf_config_of(plan) if plan.output is not None else {}
        self.sources = [plan.model.path, plan.training.data.tokenizer]
        self.ckpt_every = plan.training.checkpoint_every_steps
        self.last: dict[str, Any] | None = None

    def due(self, step: int, total: int) -> bool:
        if self.output is None:
            return False
        k = self.output.every_checkpoints
        at_ckpt = step % self.ckpt_every == 0
        return step == total or (k > 0 and at_ckpt and (step // self.ckpt_every) % k == 0)

    def after_step(self, engine, step: int, total: int) -> dict[str, Any] | None:
        """Export when due (collective); the latest export's progress object."""
        if self.due(step, total):
            doc = export_model(
                engine.module,
                self.hf_config,
                self.permutation,
                self.output.path,
                step,
                sources=self.sources,
            )
            if doc is not None:
                self.last = progress_output(doc)
        return self.last


def save_plan(plan, ckpt_dir: str | None) -> None:
    """The plan beside the checkpoints (``<ckpt>/plan.json``): ``moe-export`` restores from it."""
    if not ckpt_dir:
        return
    from moe_trainer.telemetry.progress import write_json_atomic

    try:
        write_json_atomic(Path(ckpt_dir) / "plan.json", plan.raw)
    except OSError as exc:  # a convenience: the checkpoint itself reports an unwritable volume
        log.warning("plan.json not written to the checkpoint dir: %s", exc)


TEST_LOGITS_ENV = E.TEST_LOGITS_DIR


def write_test_logits(trainer, tag: str) -> None:
    """Test hook (``$MOE_TEST_LOGITS_DIR``): every rank runs the engine's module on one fixed
    batch (seeded tokens), rank 0 saves the fp32 logits as ``<dir>/<tag>.pt``."""
    out = os.environ.get(TEST_LOGITS_ENV)
    if not out:
        return
    module = trainer.engine.module
    vocab = module.config.vocab_size
    batch = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))
    was_training = module.training
    module.eval()
    with torch.no_grad():
        logits = module(input_ids=batch.to(trainer.env.device)).logits.float().cpu()
    module.train(was_training)
    if _rank() == 0:
        torch.save({"input_ids": batch, "logits": logits}, Path(out) / f"{tag}.pt")
