"""Prepared training data (docs/contracts.md): ``DataPrepReport`` v1 and ``DataManifest`` v1.

The data-prepare pod (``moe-prepare-data``, trainer image) tokenizes a job's JSONL or Parquet
data once, packs it into rows of ``seqLen + 1`` tokens and writes memory-mapped shards plus a
``manifest.json`` (DataManifest) into ``<cache>/prepared-data/<key>/``. ``key`` hashes what the
tokens depend on (the data files' identity, the tokenizer, seqLen, kind, format, field), so a
restart or another job with the same inputs finds the directory and does no work. While it runs
and when it ends the pod writes a DataPrepReport into ConfigMap ``<job>-data`` (key
``data_report.json``): progress for ``status.data``, the prepared directory, or the first bad row
(file and row), which the operator turns into a refusal before any worker pod exists. The
workers memory-map the shards (plan ``training.data.kind: "prepared"``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ._base import Bool, Doc, Int, Str, read_document

REPORT_KIND, REPORT_VERSION = "DataPrepReport", 1
MANIFEST_KIND, MANIFEST_VERSION = "DataManifest", 1
MANIFEST_FILE = "manifest.json"
PREPARED_DIR = "prepared-data"  # under the cache mount
SOURCE_KINDS = ("jsonl", "parquet")
FORMATS = ("text", "chat")
# ``error.code`` of a refused data set
ERROR_CODES = (
    "NotFound",  # data.path does not exist / holds no file of the kind
    "EmptyFile",  # a file with no rows
    "Undecodable",  # a row that is not UTF-8 / not JSON / not readable by datasets
    "MissingField",  # a row without data.field
    "BadField",  # the field has the wrong type (text: a string; chat: a list of messages)
    "NoChatTemplate",  # format Chat, the tokenizer has no chat template (or there is none)
    "BadTemplate",  # the chat template fails on a row, or is not prefix-stable
    "TokenOutOfRange",  # the tokenizer produced an id >= the model's vocab_size
    "NoTokens",  # nothing to train on after tokenizing
)


class FileEntry(Doc):
    path: Str = Field(min_length=1)  # relative to the data mount
    bytes: Int = Field(ge=0)
    mtime_ns: Int = Field(ge=0)


class ShardEntry(Doc):
    tokens: Str = Field(min_length=1)  # tokens-<n>.npy: uint32[rows, seqLen + 1]
    mask: Str | None = None  # mask-<n>.npy: uint8[rows, seqLen + 1] (1 = a loss target); chat
    rows: Int = Field(ge=1)


class TokenizerEntry(Doc):
    kind: Literal["hf", "byte"]
    path: Str | None = None
    vocab_size: Int = Field(ge=1)
    eos_id: Int = Field(ge=0)
    pad_id: Int = Field(ge=0)
    sha256: Str | None = None  # of the tokenizer files (hf)


class DataManifest(Doc):
    kind: Literal["DataManifest"] = "DataManifest"
    version: Literal[1] = 1
    key: Str = Field(min_length=1)
    source: Literal["jsonl", "parquet"]
    format: Literal["text", "chat"] = "text"
    field: Str = Field(min_length=1)
    seq_len: Int = Field(ge=1)
    files: tuple[FileEntry, ...] = ()
    tokenizer: TokenizerEntry
    documents: Int = Field(ge=0)
    skipped_rows: Int = Field(default=0, ge=0)  # empty texts / conversations
    tokens: Int = Field(ge=0)  # tokens of the documents (EOS included), before padding
    loss_tokens: Int = Field(ge=0)  # target positions that count in the loss
    rows: Int = Field(ge=1)
    shards: tuple[ShardEntry, ...] = Field(min_length=1)
    created_at: Str | None = None


class DataError(Doc):
    code: Str = Field(min_length=1)
    file: Str | None = None
    row: Int | None = Field(default=None, ge=0)  # 0-based row (JSONL: line - 1)
    message: Str = ""


class DataPrepReport(Doc):
    kind: Literal["DataPrepReport"] = "DataPrepReport"
    version: Literal[1] = 1
    phase: Literal["Preparing", "Done", "Failed"]
    key: Str | None = None
    path: Str | None = None  # the prepared directory (as mounted in the pods)
    reused: Bool = False  # an earlier run had prepared it: nothing tokenized
    files: Int = Field(default=0, ge=0)
    files_done: Int = Field(default=0, ge=0)
    documents: Int = Field(default=0, ge=0)
    tokens: Int = Field(default=0, ge=0)
    loss_tokens: Int = Field(default=0, ge=0)
    rows: Int = Field(default=0, ge=0)
    error: DataError | None = None
    updated_at: Str | None = None


def parse_data_report(text: str | bytes | dict[str, Any]) -> DataPrepReport:
    """A DataPrepReport v1 (JSON text or decoded); raises DocumentError naming the field."""
    return read_document(REPORT_KIND, (REPORT_VERSION,), DataPrepReport, text)[1]


def parse_manifest(text: str | bytes | dict[str, Any]) -> DataManifest:
    """A DataManifest v1 (JSON text or decoded); raises DocumentError naming the field."""
    return read_document(MANIFEST_KIND, (MANIFEST_VERSION,), DataManifest, text)[1]
