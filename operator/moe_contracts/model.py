"""``ModelReport`` v1 (docs/contracts.md): what the inspection program read from a Hugging Face
model directory, without loading a tensor.

The inspection pod (``moe-inspect``, trainer image) mounts ``spec.model.path`` read-only and writes
the report into ConfigMap ``<job>-model`` (key ``model_report.json``); the operator reads it with
:func:`parse_model_report` and plans from ``config`` exactly as from ``spec.model.hfConfig``.
The program reports facts (``errors`` lists what it could not read); whether the operator can
train the model (an MoE family it supports, dtypes, the tokenizer's ids) is decided on the
operator's side (``moejob_operator.core.model_report``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ._base import Bool, Doc, Int, Str, read_document

MODEL_REPORT_KIND, MODEL_REPORT_VERSION = "ModelReport", 1
# safetensors dtypes the trainer trains (it upcasts to fp32 master weights); anything else
# (I8/U8, F8_E4M3, F8_E5M2, ...) is a quantized checkpoint it cannot train
TRAINABLE_DTYPES = ("F32", "F16", "BF16")
# ``errors[].code``: what the program could not read
ERROR_CODES = (
    "NotFound",  # the model directory does not exist
    "NoConfig",  # no config.json
    "BadConfig",  # config.json is not a JSON object
    "NoWeights",  # no *.safetensors (pytorch_model*.bin cannot be checked without unpickling)
    "BadIndex",  # model.safetensors.index.json unreadable
    "MissingShard",  # a shard the index names is not there
    "TruncatedShard",  # a shard's header declares more data than the file holds
    "BadShard",  # a shard's header is unreadable
    "MissingTensor",  # the index maps a tensor to a shard whose header lacks it
    "BadTokenizer",  # tokenizer files present but unreadable
)


class Shard(Doc):
    file: Str = Field(min_length=1)  # relative to the model directory
    bytes: Int = Field(ge=0)  # file size
    data_end_bytes: Int | None = Field(default=None, ge=0)  # 8 + header + data the header claims
    tensors: Int = Field(default=0, ge=0)


class TokenizerInfo(Doc):
    present: Bool = False
    files: tuple[Str, ...] = ()
    vocab_size: Int | None = Field(default=None, ge=0)  # highest id + 1, added tokens included
    chat_template: Bool = False


class ReportError(Doc):
    code: Str = Field(min_length=1)
    file: Str | None = None
    message: Str = ""


class ModelReport(Doc):
    kind: Literal["ModelReport"] = "ModelReport"
    version: Literal[1] = 1
    path: Str = Field(min_length=1)  # the directory as mounted in the inspection pod
    config: dict[str, Any] | None = None  # config.json as read
    architectures: tuple[Str, ...] = ()
    model_type: Str | None = None
    weight_format: Literal["safetensors", "pytorch", "none"] = "none"
    parameters: Int = Field(default=0, ge=0)  # elements over every shard header
    dtypes: dict[str, Int] = Field(default_factory=dict)  # dtype -> elements
    dtype_examples: dict[str, Str] = Field(default_factory=dict)  # dtype -> one tensor name
    shards: tuple[Shard, ...] = ()
    total_bytes: Int = Field(default=0, ge=0)
    tokenizer: TokenizerInfo = TokenizerInfo()
    content_hash: Str = Field(min_length=1)  # sha256 of config, index, shard headers, tokenizer
    errors: tuple[ReportError, ...] = ()
    inspected_at: Str | None = None


def parse_model_report(text: str | bytes | dict[str, Any]) -> ModelReport:
    """A ModelReport v1 (JSON text or decoded); raises DocumentError naming the field."""
    return read_document(MODEL_REPORT_KIND, (MODEL_REPORT_VERSION,), ModelReport, text)[1]
