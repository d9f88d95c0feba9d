"""Read, validate and write the ``MoEPlan`` v1 document (docs/contracts.md).

The operator reads plans back (from its ConfigMap, from ``moectl plan -o``); everything it reads
goes through :func:`parse_plan`, which checks the invariants the trainer relies on and names the
field (``MoEPlan ranks[3].localRank: ...``). The trainer has its own reader
(``moe_trainer.plan``); tests check both against documents the other side wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import DocumentError, check_kind_version, read_json_document
from .models import FAMILIES, spec_from_hf_config

PLAN_KIND = "MoEPlan"
PLAN_VERSION = 1
DEVICES = ("cuda", "cpu")


def _err(path: str, what: str) -> DocumentError:
    return DocumentError(f"{PLAN_KIND} {path}: {what}")


def _int(obj: dict, key: str, path: str, minimum: int = 0) -> int:
    value = obj.get(key) if isinstance(obj, dict) else None
    where = f"{path}.{key}" if path else key
    if key not in obj:
        raise _err(where, "required field is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(where, f"{value!r} is not an integer")
    if value < minimum:
        raise _err(where, f"{value} must be >= {minimum}")
    return value


def _obj(obj: dict, key: str, path: str = "") -> dict:
    value = obj.get(key)
    where = f"{path}.{key}" if path else key
    if not isinstance(value, dict):
        raise _err(where, "required object is missing" if value is None
                   else f"{type(value).__name__} is not an object")
    return value


def _check_ranks(ranks: Any, world: int, device: str) -> None:
    if not isinstance(ranks, list) or len(ranks) != world:
        n = len(ranks) if isinstance(ranks, list) else ranks
        raise _err("ranks", f"has {n!r} entries, worldSize is {world}")
    seen_gpu: dict[tuple[str, int], int] = {}
    node_rank: dict[str, int] = {}
    locals_: dict[str, list[int]] = {}
    for i, r in enumerate(ranks):
        p = f"ranks[{i}]"
        if not isinstance(r, dict):
            raise _err(p, "is not an object")
        if _int(r, "rank", p) != i:
            raise _err(f"{p}.rank", f"{r['rank']} out of order (expected {i})")
        node = r.get("node")
        if not isinstance(node, str) or not node:
            raise _err(f"{p}.node", f"{node!r} is not a node name")
        nr, lr = _int(r, "nodeRank", p), _int(r, "localRank", p)
        if node_rank.setdefault(node, nr) != nr:
            raise _err(f"{p}.nodeRank", f"{nr} but node {node!r} has nodeRank {node_rank[node]}")
        locals_.setdefault(node, []).append(lr)
        group = r.get("group")
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 0):
            raise _err(f"{p}.group", f"{group!r} is not an NVLink group index")
        gpu = r.get("gpu")
        if device == "cpu":
            if gpu is not None:
                raise _err(f"{p}.gpu", f"{gpu!r} on a CPU plan (must be null)")
            continue
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise _err(f"{p}.gpu", f"{gpu!r} is not a GPU index")
        if (node, gpu) in seen_gpu:
            raise _err(f"{p}.gpu", f"{node}:{gpu} is already used by rank {seen_gpu[node, gpu]} "
                       "(ranks must map one-to-one onto GPUs)")
        seen_gpu[node, gpu] = i
    if sorted(node_rank.values()) != list(range(len(node_rank))):
        raise _err("ranks", f"nodeRanks {sorted(node_rank.values())} are not 0..{len(node_rank) - 1}")
    for node, lrs in locals_.items():
        if sorted(lrs) != list(range(len(lrs))):
            raise _err("ranks", f"localRanks of node {node!r} are {sorted(lrs)}, not "
                       f"0..{len(lrs) - 1}")


def _check_placement(pl: dict, ep: int, num_layers: int, num_experts: int) -> None:
    p = "placement"
    if not isinstance(pl.get("strategy"), str):
        raise _err(f"{p}.strategy", f"{pl.get('strategy')!r} is not a strategy name")
    L, E = _int(pl, "numLayers", p, 1), _int(pl, "numExperts", p, 1)
    if (L, E) != (num_layers, num_experts):
        raise _err(p, f"{L} layers x {E} experts, the model has {num_layers} MoE layers x "
                   f"{num_experts} experts")
    if _int(pl, "epSize", p, 1) != ep:
        raise _err(f"{p}.epSize", f"{pl['epSize']} differs from epSize {ep}")
    disp = pl.get("dispatcher", "autoep")
    if disp not in ("autoep", "dedup"):
        raise _err(f"{p}.dispatcher", f"{disp!r} is not one of ['autoep', 'dedup']")
    perm = pl.get("permutation")
    if not isinstance(perm, list) or len(perm) != L:
        raise _err(f"{p}.permutation", f"expected {L} rows (numLayers)")
    for layer, row in enumerate(perm):
        if not isinstance(row, list) or any(isinstance(x, bool) or not isinstance(x, int)
                                            for x in row) or sorted(row) != list(range(E)):
            raise _err(f"{p}.permutation[{layer}]", f"{row!r} is not a permutation of 0..{E - 1}")


def parse_plan(obj: Any) -> dict[str, Any]:
    """Validate a decoded MoEPlan v1 document and return it; raise ``DocumentError``."""
    check_kind_version(PLAN_KIND, obj)
    job = _obj(obj, "job")
    for key in ("namespace", "name"):
        if not isinstance(job.get(key), str) or not job[key]:
            raise _err(f"job.{key}", f"{job.get(key)!r} is not a name")
    device = obj.get("device", "cuda")
    if device not in DEVICES:
        raise _err("device", f"{device!r} is not one of {list(DEVICES)}")
    model = _obj(obj, "model")
    if model.get("family") not in FAMILIES:
        raise _err("model.family", f"{model.get('family')!r} is not one of {list(FAMILIES)}")
    hf = _obj(model, "hfConfig", "model")
    if hf.get("model_type") != model["family"]:
        raise _err("model.hfConfig.model_type", f"{hf.get('model_type')!r} differs from "
                   f"model.family {model['family']!r}")
    spec = spec_from_hf_config(hf, f"{PLAN_KIND} model.hfConfig")
    world = _int(obj, "worldSize", "", 1)
    ep = _int(obj, "epSize", "", 1)
    if world % ep or spec.num_experts % ep:
        raise _err("epSize", f"{ep} must divide worldSize {world} and the number of experts "
                   f"{spec.num_experts}")
    _check_ranks(obj.get("ranks"), world, device)
    _check_placement(_obj(obj, "placement"), ep, spec.num_moe_layers, spec.num_experts)

    ds = _obj(obj, "deepspeed")
    micro = _int(ds, "train_micro_batch_size_per_gpu", "deepspeed", 1)
    accum = _int(ds, "gradient_accumulation_steps", "deepspeed", 1)
    if _int(ds, "train_batch_size", "deepspeed", 1) != micro * accum * world:
        raise _err("deepspeed.train_batch_size", f"{ds['train_batch_size']} != {micro} x {accum} x "
                   f"worldSize {world}")
    ep_cfg = ds.get("expert_parallel") or {}
    if ep_cfg.get("enabled") and ep_cfg.get("autoep_size") != ep:
        raise _err("deepspeed.expert_parallel.autoep_size",
                   f"{ep_cfg.get('autoep_size')!r} differs from epSize {ep}")

    mem = _obj(obj, "memory")
    for key in ("gpuMemoryBytes", "estimatedPeakBytes"):
        _int(mem, key, "memory")
    if not isinstance(mem.get("fits"), bool):
        raise _err("memory.fits", f"{mem.get('fits')!r} is not true/false")
    for key, value in _obj(mem, "breakdown", "memory").items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _err(f"memory.breakdown.{key}", f"{value!r} is not a byte count")

    tr = _obj(obj, "training")
    _int(tr, "steps", "training", 1)
    _int(tr, "seqLen", "training", 1)
    if _int(tr, "microBatch", "training", 1) != micro:
        raise _err("training.microBatch", f"{tr['microBatch']} differs from deepspeed "
                   f"train_micro_batch_size_per_gpu {micro}")
    if _int(tr, "gradAccum", "training", 1) != accum:
        raise _err("training.gradAccum", f"{tr['gradAccum']} differs from deepspeed "
                   f"gradient_accumulation_steps {accum}")
    return obj


def read_plan(src: str | Path | dict) -> dict[str, Any]:
    """Read and validate a plan from a path or an already decoded object."""
    if isinstance(src, dict):
        return parse_plan(src)
    return parse_plan(read_json_document(PLAN_KIND, src))


def plan_json(doc: dict[str, Any]) -> str:
    """The serialised document (validated first): what goes into the ``<job>-plan`` ConfigMap."""
    return json.dumps(parse_plan(doc), indent=1, sort_keys=False) + "\n"


def write_plan(doc: Any, path: str | Path) -> None:
    """Validate and write ``doc`` (a plan document, or a ``Plan``) to ``path``."""
    doc = getattr(doc, "document", doc)
    Path(path).write_text(plan_json(doc))
