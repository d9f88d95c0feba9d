"""`moe-prepare-data`: tokenize a job's JSONL or Parquet data once into memory-mapped shards the
workers share (docs/contracts.md "Prepared data").

Reads ``--data`` (a file or a directory: ``*.jsonl`` / ``*.json`` lines; ``*.parquet`` files or a
Hugging Face ``datasets`` ``save_to_disk`` directory, read with the ``datasets`` library), takes
the text in ``--field`` (format text) or renders the conversation in it with the tokenizer's chat
template (format chat: loss on the assistant's tokens only), tokenizes with ``--tokenizer`` (a
local Hugging Face tokenizer directory; byte-level without one), packs the token stream into rows
of ``seqLen + 1`` tokens (consecutive rows share one token, as the trainer's windows do; the last
row is padded and its padding masked) and writes ``tokens-<n>.npy`` (uint32), ``mask-<n>.npy``
(uint8, chat) and ``manifest.json`` (DataManifest v1) into ``<out-root>/<key>``. ``key`` hashes the
data files' identity (relative path, size, mtime), the tokenizer files, seqLen, source, format and
field: a directory that exists with a matching manifest is reused without tokenizing anything.
The directory appears whole (written under a temporary name, then renamed).

Progress and the outcome go into ConfigMap ``--configmap`` (DataPrepReport v1). A bad row stops
the run with a report naming the file and the 0-based row: exit 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from moe_contracts import env as E
from moe_contracts.data import (
    MANIFEST_FILE,
    MANIFEST_KIND,
    MANIFEST_VERSION,
    REPORT_KIND,
    REPORT_VERSION,
    parse_manifest,
)
from moe_contracts.errors import DocumentError
from moe_contracts.progress import now_iso
from moe_trainer.inputs.data import ByteTokenizer
from moe_trainer.inspect_model import TOKENIZER_FILES

log = logging.getLogger("moe_trainer.prepare")

PREP_VERSION = 1  # bump when the packing changes: old directories get a new key
ROWS_PER_SHARD = 8192
REPORT_EVERY_SECONDS = 5.0


class Bad(Exception):
    """A refusal: the code (moe_contracts.data.ERROR_CODES), where, and why."""

    def __init__(self, code: str, message: str, file: str | None = None, row: int | None = None):
        super().__init__(message)
        self.code, self.file, self.row, self.message = code, file, row, message


# ---- sources ---------------------------------------------------------------------------------
def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and any(
        (p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def list_files(source: str, data: Path) -> list[Path]:
    if not data.exists():
        raise Bad("NotFound", f"{data} does not exist")
    if data.is_file():
        return [data]
    if source == "parquet" and _is_saved_dataset(data):
        return sorted(p for p in data.rglob("*") if p.is_file())
    suffixes = (".jsonl", ".json") if source == "jsonl" else (".parquet",)
    files = sorted(p for p in data.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not files:
        raise Bad("NotFound", f"{data} holds no {' / '.join('*' + s for s in suffixes)} file")
    return files


def _jsonl_rows(path: Path, rel: str) -> Iterator[tuple[int, Any]]:
    seen = False
    with path.open("rb") as f:
        for row, line in enumerate(f):
            if not line.strip():
                continue
            seen = True
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise Bad(
                    "Undecodable", f"not UTF-8 ({exc.reason} at byte {exc.start})", rel, row
                ) from None
            except ValueError as exc:
                raise Bad("Undecodable", f"not JSON ({exc})", rel, row) from None
            yield row, obj
    if not seen:
        raise Bad("EmptyFile", "the file has no rows", rel)


def _dataset_rows(ds: Any, rel: str) -> Iterator[tuple[int, Any]]:
    row = -1
    it = iter(ds)
    while True:
        try:
            obj = next(it)
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - whatever the reader throws is a bad row
            raise Bad(
                "Undecodable",
                f"datasets could not read it ({type(exc).__name__}: {exc})",
                rel,
                row + 1,
            ) from None
        row += 1
        yield row, obj
    if row < 0:
        raise Bad("EmptyFile", "the dataset has no rows", rel)


def iter_rows(source: str, data: Path, files: list[Path]) -> Iterator[tuple[str, int, Any]]:
    """(file relative to ``data``, row, record) in a fixed order."""
    base = data if data.is_dir() else data.parent
    if source == "jsonl":
        for f in files:
            rel = str(f.relative_to(base))
            for row, obj in _jsonl_rows(f, rel):
                yield rel, row, obj
        return
    import datasets

    datasets.disable_progress_bars()
    if _is_saved_dataset(data):
        ds = datasets.load_from_disk(str(data))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[min(ds)]
        for row, obj in _dataset_rows(ds, data.name):
            yield data.name, row, obj
        return
    for f in files:
        rel = str(f.relative_to(base))
        try:
            ds = datasets.load_dataset("parquet", data_files=str(f), split="train", streaming=True)
        except Exception as exc:  # noqa: BLE001 - an unreadable file is a bad file
            raise Bad(
                "Undecodable", f"datasets could not open it ({type(exc).__name__}: {exc})", rel
            ) from None
        for row, obj in _dataset_rows(ds, rel):
            yield rel, row, obj


# ---- tokenizing ------------------------------------------------------------------------------
class Tokenizer:
    """The model's tokenizer (``path``) or the trainer's byte-level one."""

    def __init__(self, path: str | None):
        self.path = path
        if path is None:
            b = ByteTokenizer()
            self.tok, self.vocab_size, self.eos, self.pad = None, b.vocab_size, b.EOS, b.PAD
            self._byte = b
            return
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos

    def identity(self) -> str:
        if self.path is None:
            return "byte"
        h = hashlib.sha256()
        for name in TOKENIZER_FILES:
            f = Path(self.path) / name
            if f.is_file():
                h.update(name.encode() + b"\0" + f.read_bytes())
        return h.hexdigest()

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tok, "chat_template", None) if self.tok is not None else None

    def text(self, text: str) -> list[int]:
        if self.tok is None:
            return [*self._byte.encode(text).tolist(), self.eos]
        return [*self.tok(text, add_special_tokens=False)["input_ids"], self.eos]

    def chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(ids, mask): the rendered conversation, mask 1 on the assistant turns' tokens (their
        content and end-of-turn markers, not the prompt that opens them)."""
        tok = self.tok

        def render(msgs: list[dict[str, Any]], gen: bool = False) -> str:
            return str(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))

        full = render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, through = render(messages[:i], gen=True), render(messages[: i + 1])
            if not (full.startswith(through) and through.startswith(before)):
                raise ValueError(
                    "the chat template does not render a conversation's prefix as a prefix of "
                    "the whole; the assistant's tokens cannot be told apart"
                )
            spans.append((len(before), len(through)))
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
        return ids, mask


def _text_of(obj: Any, field: str, rel: str, row: int) -> str:
    if not isinstance(obj, dict):
        raise Bad("BadField", f"the row is a {type(obj).__name__}, not an object", rel, row)
    if field not in obj:
        raise Bad("MissingField", f"no field {field!r} (fields: {sorted(obj)[:10]})", rel, row)
    value = obj[field]
    if not isinstance(value, str):
        raise Bad(
            "BadField", f"field {field!r} is a {type(value).__name__}, not a string", rel, row
        )
    return value


def _messages_of(obj: Any, field: str, rel: str, row: int) -> list[dict[str, Any]]:
    if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
        raise Bad("MissingField", f"no field {field!r} (fields: {keys})", rel, row)
    msgs = obj[field]
    ok = isinstance(msgs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in msgs
    )
    if not ok:
        raise Bad(
            "BadField", f"field {field!r} is not a list of {{role, content}} messages", rel, row
        )
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


# ---- packing ---------------------------------------------------------------------------------
class Packer:
    """Token stream -> rows[n, seq_len + 1] (stride seq_len), written in shards."""

    def __init__(self, out: Path, seq_len: int, pad: int, masked: bool, rows_per_shard: int):
        self.out, self.L, self.stride, self.pad = out, seq_len + 1, seq_len, pad
        self.masked, self.rows_per_shard = masked, rows_per_shard
        self.buf: list[int] = []
        self.mbuf: list[int] = []
        self.rows: list[list[int]] = []
        self.mrows: list[list[int]] = []
        self.shards: list[dict[str, Any]] = []
        self.n_rows = self.loss_tokens = 0

    def add(self, ids: list[int], mask: list[int]) -> None:
        self.buf += ids
        self.mbuf += mask
        while len(self.buf) >= self.L:
            self._row(self.buf[: self.L], self.mbuf[: self.L])
            del self.buf[: self.stride], self.mbuf[: self.stride]

    def _row(self, ids: list[int], mask: list[int]) -> None:
        self.rows.append(ids)
        self.mrows.append(mask)
        self.n_rows += 1
        self.loss_tokens += sum(mask[1:])
        if len(self.rows) >= self.rows_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self.rows:
            return
        n = len(self.shards)
        entry: dict[str, Any] = {"tokens": f"tokens-{n:05d}.npy", "rows": len(self.rows)}
        np.save(self.out / entry["tokens"], np.asarray(self.rows, dtype=np.uint32))
        if self.masked:
            entry["mask"] = f"mask-{n:05d}.npy"
            np.save(self.out / entry["mask"], np.asarray(self.mrows, dtype=np.uint8))
        self.shards.append(entry)
        self.rows, self.mrows = [], []

    def close(self) -> None:
        if len(self.buf) > 1:  # a last partial row: padded, the padding masked
            pad = self.L - len(self.buf)
            self._row(self.buf + [self.pad] * pad, self.mbuf + [0] * pad)
        self.buf, self.mbuf = [], []
        self._flush()


# ---- the run ---------------------------------------------------------------------------------
class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.publisher = None
        if args.configmap:
            from moe_trainer.telemetry.progress import ConfigMapPublisher

            self.publisher = ConfigMapPublisher(args.configmap)
        self.report: dict[str, Any] = {
            "kind": REPORT_KIND,
            "version": REPORT_VERSION,
            "phase": "Preparing",
        }
        self._last = 0.0

    def publish(self, force: bool = False, **fields: Any) -> None:
        self.report.update(fields, updatedAt=now_iso())
        now = time.monotonic()
        if not force and now - self._last < REPORT_EVERY_SECONDS:
            return
        self._last = now
        text = json.dumps(self.report, sort_keys=True)
        if self.publisher is not None:
            ok = self.publisher.send({"data": {E.DATA_REPORT_KEY: text}})
            if not ok and force:
                raise OSError(
                    f"cannot publish to ConfigMap {self.args.configmap}: "
                    f"{self.publisher.last_error}"
                )
        if self.args.report:
            Path(self.args.report).write_text(text)

    def key(self, files: list[Path], tok: Tokenizer) -> tuple[str, list[dict[str, Any]]]:
        a = self.args
        data = Path(a.data)
        base = data if data.is_dir() else data.parent
        entries = [
            {
                "path": str(f.relative_to(base)),
                "bytes": f.stat().st_size,
                "mtimeNs": f.stat().st_mtime_ns,
            }
            for f in files
        ]
        ident = {
            "v": PREP_VERSION,
            "source": a.source,
            "format": a.format,
            "field": a.field,
            "seqLen": a.seq_len,
            "files": entries,
            "tokenizer": tok.identity(),
        }
        blob = json.dumps(ident, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:24], entries

    def run(self) -> int:
        a = self.args
        data, root = Path(a.data), Path(a.out_root)
        try:
            files = list_files(a.source, data)
            tok = Tokenizer(a.tokenizer)
            if a.format == "chat" and not tok.chat_template:
                where = (
                    f"the tokenizer at {a.tokenizer}"
                    if a.tokenizer
                    else "byte-level tokens (the model has no tokenizer)"
                )
                raise Bad("NoChatTemplate", f"format Chat needs a chat template; {where} has none")
            key, entries = self.key(files, tok)
            out = root / key
            self.publish(force=True, key=key, path=str(out), files=len(files))
            existing = self._existing(out, key)
            if existing is not None:
                log.info("%s: prepared earlier (key %s); reused", out, key)
                self.publish(
                    force=True, phase="Done", reused=True, filesDone=len(files), **existing
                )
                return 0
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".{key}.tmp-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                manifest = self.prepare(files, entries, tok, key, tmp)
                (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
                try:
                    os.rename(tmp, out)
                except OSError:  # another run finished the same key first: use it
                    shutil.rmtree(tmp, ignore_errors=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            final = self._existing(out, key) or {}
            self.publish(force=True, phase="Done", reused=False, filesDone=len(files), **final)
            return 0
        except Bad as exc:
            log.error(
                "%s%s: %s (%s)",
                f"{exc.file} " if exc.file else "",
                f"row {exc.row}" if exc.row is not None else "",
                exc.message,
                exc.code,
            )
            error = {"code": exc.code, "file": exc.file, "row": exc.row, "message": exc.message}
            self.publish(force=True, phase="Failed", error=error)
            return 1

    def _existing(self, out: Path, key: str) -> dict[str, Any] | None:
        try:
            m = parse_manifest(json.loads((out / MANIFEST_FILE).read_text()))
        except (OSError, ValueError, DocumentError):
            return None
        if m.key != key or not all((out / s.tokens).is_file() for s in m.shards):
            return None
        return {
            "documents": m.documents,
            "tokens": m.tokens,
            "lossTokens": m.loss_tokens,
            "rows": m.rows,
        }

    def prepare(
        self, files: list[Path], entries: list[dict[str, Any]], tok: Tokenizer, key: str, tmp: Path
    ) -> dict[str, Any]:
        a = self.args
        chat = a.format == "chat"
        packer = Packer(tmp, a.seq_len, tok.pad, chat, a.rows_per_shard)
        docs = tokens = skipped = 0
        done_files: set[str] = set()
        last_file = None
        for rel, row, obj in iter_rows(a.source, Path(a.data), files):
            if rel != last_file and last_file is not None:
                done_files.add(last_file)
            last_file = rel
            if chat:
                msgs = _messages_of(obj, a.field, rel, row)
                if not any(m["role"] == "assistant" for m in msgs):
                    skipped += 1
                    continue
                try:
                    ids, mask = tok.chat(msgs)
                except Exception as exc:  # noqa: BLE001 - a template error names the row
                    raise Bad(
                        "BadTemplate",
                        f"the chat template fails: {type(exc).__name__}: {exc}",
                        rel,
                        row,
                    ) from None
            else:
                text = _text_of(obj, a.field, rel, row)
                if not text.strip():
                    skipped += 1
                    continue
                ids = tok.text(text)
                mask = [1] * len(ids)
            top = max(ids, default=0)
            if top >= a.vocab_size:
                raise Bad(
                    "TokenOutOfRange",
                    f"token id {top} >= the model's vocab_size {a.vocab_size}",
                    rel,
                    row,
                )
            packer.add(ids, mask)
            docs += 1
            tokens += len(ids)
            self.publish(
                filesDone=len(done_files),
                documents=docs,
                tokens=tokens,
                lossTokens=packer.loss_tokens,
                rows=packer.n_rows,
            )
        packer.close()
        if packer.n_rows == 0 or packer.loss_tokens == 0:
            raise Bad(
                "NoTokens",
                f"{docs} documents gave nothing to train on ({skipped} rows skipped: empty "
                "or no assistant turn)",
            )
        return {
            "kind": MANIFEST_KIND,
            "version": MANIFEST_VERSION,
            "key": key,
            "source": a.source,
            "format": a.format,
            "field": a.field,
            "seqLen": a.seq_len,
            "files": entries,
            "tokenizer": {
                "kind": "byte" if tok.path is None else "hf",
                "path": tok.path,
                "vocabSize": tok.vocab_size,
                "eosId": tok.eos,
                "padId": tok.pad,
                "sha256": None if tok.path is None else tok.identity(),
            },
            "documents": docs,
            "skippedRows": skipped,
            "tokens": tokens,
            "lossTokens": packer.loss_tokens,
            "rows": packer.n_rows,
            "shards": packer.shards,
            "createdAt": now_iso(),
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moe-prepare-data", description=__doc__.splitlines()[0])
    ap.add_argument("--source", choices=("jsonl", "parquet"), required=True)
    ap.add_argument("--data", required=True, help="a file or directory (the data mount)")
    ap.add_argument("--format", choices=("text", "chat"), default="text")
    ap.add_argument("--field", default=None, help="default: text, or messages with --format chat")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--out-root", required=True, help="prepared directories go to <out-root>/<key>")
    ap.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory")
    ap.add_argument("--vocab-size", type=int, required=True, help="the model's vocab_size")
    ap.add_argument("--rows-per-shard", type=int, default=ROWS_PER_SHARD)
    ap.add_argument("--configmap", help="publish DataPrepReport v1 here (key data_report.json)")
    ap.add_argument("--report", help="also write the report to this file")
    args = ap.parse_args(argv)
    if args.field is None:
        args.field = "messages" if args.format == "chat" else "text"
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(message)s")
    code = Run(parse_args(argv)).run()
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
