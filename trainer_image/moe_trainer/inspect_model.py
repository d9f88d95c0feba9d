"""`moe-inspect`: read a Hugging Face model directory without loading a tensor and publish a
ModelReport v1 (docs/contracts.md).

What it reads: ``config.json``; the safetensors index (``*.safetensors.index.json``) and every
shard's header (the 8-byte little-endian header length, then that many bytes of JSON: each
tensor's dtype, shape and byte range), so parameter counts, dtypes and truncation come from the
headers alone; the tokenizer files (``tokenizer.json``'s vocabulary and added tokens,
``tokenizer_config.json``'s added tokens and chat template). The content hash covers
``config.json``, the index, each shard's name, size and header, and the tokenizer files: a
different checkpoint, or one edited after planning, hashes differently (a bit flip inside tensor
data does not). The inspection pod mounts the directory read-only; the program never writes
there.

The report states facts; ``errors`` lists what could not be read. Whether the operator can train
the model is its decision (``moejob_operator.core.model_report``). Exit code: 0 when a report was
written (whatever it says), 1 when it could not be published.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import struct
import sys
from math import prod
from pathlib import Path
from typing import Any

from moe_contracts import env as E
from moe_contracts.model import MODEL_REPORT_KIND, MODEL_REPORT_VERSION, parse_model_report
from moe_contracts.progress import now_iso

log = logging.getLogger("moe_trainer.inspect")

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


class _Report:
    def __init__(self, root: Path):
        self.root = root
        self.errors: list[dict[str, Any]] = []
        self.hash = hashlib.sha256()

    def error(self, code: str, message: str, file: str | None = None) -> None:
        self.errors.append({"code": code, "file": file, "message": message})

    def feed(self, label: str, data: bytes) -> None:
        self.hash.update(f"{label}\0{len(data)}\0".encode())
        self.hash.update(data)


def read_header(path: Path) -> tuple[dict[str, Any], bytes, int]:
    """(header, its raw bytes, data end = 8 + header + the largest data offset) of a shard;
    ValueError when the header is not a safetensors header."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"header length {n} exceeds {MAX_HEADER_BYTES}")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"header of {n} bytes cut off at {len(raw)}")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and isinstance(t.get("shape"), list)
        ):
            raise ValueError(f"tensor {name!r}: no dtype/shape/data_offsets")
        end = max(end, int(offsets[1]))
    return header, raw, 8 + n + end


def _weights(rep: _Report, out: dict[str, Any]) -> None:
    root = rep.root
    indexes = sorted(root.glob("*.safetensors.index.json"))
    weight_map: dict[str, str] = {}
    if indexes:
        raw = indexes[0].read_bytes()
        rep.feed(f"index:{indexes[0].name}", raw)
        try:
            weight_map = json.loads(raw)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            rep.error("BadIndex", f"{indexes[0].name}: {exc}", indexes[0].name)
            weight_map = {}
        files = sorted(set(map(str, weight_map.values()))) or [
            p.name for p in sorted(root.glob("*.safetensors"))
        ]
    else:
        files = [p.name for p in sorted(root.glob("*.safetensors"))]
    if not files:
        bins = sorted(p.name for p in root.glob("pytorch_model*.bin"))
        out["weightFormat"] = "pytorch" if bins else "none"
        what = f"only {bins[0]}" if bins else "no weights"
        rep.error(
            "NoWeights",
            f"{what}: the trainer loads *.safetensors (save_pretrained writes them by default)",
        )
        return
    out["weightFormat"] = "safetensors"
    shards, dtypes, examples, names = [], {}, {}, {}
    params = total = 0
    for name in files:
        path = root / name
        if not path.is_file():
            rep.error("MissingShard", f"{name}: named by the index, not in the directory", name)
            continue
        size = path.stat().st_size
        total += size
        try:
            header, raw, end = read_header(path)
        except (ValueError, OSError) as exc:
            rep.error("BadShard", f"{name}: {exc}", name)
            shards.append({"file": name, "bytes": size, "dataEndBytes": None, "tensors": 0})
            continue
        rep.feed(f"shard:{name}:{size}", raw)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        names[name] = set(tensors)
        for tname, t in tensors.items():
            n = prod(int(d) for d in t["shape"])
            params += n
            dtype = str(t.get("dtype"))
            dtypes[dtype] = dtypes.get(dtype, 0) + n
            examples.setdefault(dtype, tname)
        if end > size:
            rep.error(
                "TruncatedShard",
                f"{name}: the header declares {end} bytes, the file has {size}",
                name,
            )
        shards.append({"file": name, "bytes": size, "dataEndBytes": end, "tensors": len(tensors)})
    for tname, fname in sorted(weight_map.items()):
        if fname in names and tname not in names[fname]:
            rep.error(
                "MissingTensor", f"{fname}: the index maps {tname!r} here; no such tensor", fname
            )
            break
    out.update(
        parameters=params,
        dtypes=dtypes,
        dtypeExamples=examples,
        shards=shards,
        totalBytes=total,
    )


def tokenizer_vocab(root: Path) -> int | None:
    """Highest token id + 1 of the tokenizer in ``root`` (vocabulary and added tokens), from
    ``tokenizer.json`` / ``tokenizer_config.json`` / ``vocab.json``; None when no file says."""
    ids: list[int] = []
    tj = root / "tokenizer.json"
    if tj.is_file():
        doc = json.loads(tj.read_text(encoding="utf-8"))
        vocab = (doc.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and vocab:
            ids.append(max(int(v) for v in vocab.values()))
        elif isinstance(vocab, list) and vocab:
            ids.append(len(vocab) - 1)
        ids += [int(t["id"]) for t in doc.get("added_tokens") or () if "id" in t]
    vj = root / "vocab.json"
    if not ids and vj.is_file():
        vocab = json.loads(vj.read_text(encoding="utf-8"))
        if isinstance(vocab, dict) and vocab:
            ids.append(max(int(v) for v in vocab.values()))
    tc = root / "tokenizer_config.json"
    if tc.is_file():
        decoder = json.loads(tc.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
        ids += [int(k) for k in decoder]
    return max(ids) + 1 if ids else None


def _tokenizer(rep: _Report, out: dict[str, Any]) -> None:
    root = rep.root
    files = [f for f in TOKENIZER_FILES if (root / f).is_file()]
    info: dict[str, Any] = {"present": False, "files": files, "vocabSize": None}
    info["chatTemplate"] = any(f.startswith("chat_template") for f in files)
    for f in files:
        rep.feed(f"tokenizer:{f}", (root / f).read_bytes())
    try:
        if "tokenizer_config.json" in files:
            cfg = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
            info["chatTemplate"] = info["chatTemplate"] or bool(cfg.get("chat_template"))
        info["vocabSize"] = tokenizer_vocab(root)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        rep.error("BadTokenizer", f"tokenizer files: {exc}", "tokenizer.json")
    # a tokenizer needs its vocabulary, not only a config
    info["present"] = any(f in files for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    out["tokenizer"] = info


def inspect(model_dir: str | Path) -> dict[str, Any]:
    """The ModelReport v1 document for ``model_dir`` (checked with the contract's reader)."""
    root = Path(model_dir)
    rep = _Report(root)
    out: dict[str, Any] = {
        "kind": MODEL_REPORT_KIND,
        "version": MODEL_REPORT_VERSION,
        "path": str(root),
        "config": None,
    }
    if not root.is_dir():
        rep.error("NotFound", f"{root} is not a directory")
    elif not (root / "config.json").is_file():
        rep.error("NoConfig", f"{root} has no config.json", "config.json")
    else:
        raw = (root / "config.json").read_bytes()
        rep.feed("config", raw)
        try:
            cfg = json.loads(raw)
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
            out["config"] = cfg
            out["modelType"] = (
                cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None
            )
            archs = cfg.get("architectures") or []
            out["architectures"] = [a for a in archs if isinstance(a, str)]
        except (ValueError, UnicodeDecodeError) as exc:
            rep.error("BadConfig", f"config.json: {exc}", "config.json")
    if root.is_dir():
        _weights(rep, out)
        _tokenizer(rep, out)
    out["contentHash"] = "sha256:" + rep.hash.hexdigest()
    out["errors"] = rep.errors
    out["inspectedAt"] = now_iso()
    parse_model_report(out)
    return out


def content_hash(model_dir: str | Path) -> str:
    """``contentHash`` of a directory as :func:`inspect` computes it (the trainer's re-check)."""
    return str(inspect(model_dir)["contentHash"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="moe-inspect", description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", help="the Hugging Face model directory")
    ap.add_argument("--configmap", help="publish into this ConfigMap (key model_report.json)")
    ap.add_argument("--key", default=E.MODEL_REPORT_KEY, help="the ConfigMap key to write")
    ap.add_argument("--output", help="also write the report to this file")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(message)s")
    doc = inspect(args.model_dir)
    text = json.dumps(doc, sort_keys=True)
    for e in doc["errors"]:
        log.warning("%s: %s", e["code"], e["message"])
    log.info(
        "%s: %s, %d parameters, dtypes %s, %d shard(s), content %s",
        args.model_dir,
        doc.get("modelType"),
        doc.get("parameters", 0),
        doc.get("dtypes"),
        len(doc.get("shards", [])),
        doc["contentHash"],
    )
    if args.output:
        Path(args.output).write_text(text)
    if args.configmap:
        from moe_trainer.telemetry.progress import ConfigMapPublisher

        pub = ConfigMapPublisher(args.configmap)
        if not pub.send({"data": {args.key: text}}):
            log.error("could not publish to ConfigMap %s: %s", args.configmap, pub.last_error)
            sys.exit(1)
    else:
        print(text)
    sys.exit(0)


if __name__ == "__main__":
    main()
