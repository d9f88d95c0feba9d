"""The fine-tuning tests' local inputs: ``moe_localkube.finetune_inputs`` (the dev package; the
same functions write the README's local example)."""

from moe_localkube.finetune_inputs import (
    chats,
    make_model,
    make_tokenizer,
    sentences,
    tiny_model_config,
    write_jsonl,
    write_parquet,
)

__all__ = [
    "chats",
    "make_model",
    "make_tokenizer",
    "sentences",
    "tiny_model_config",
    "write_jsonl",
    "write_parquet",
]
