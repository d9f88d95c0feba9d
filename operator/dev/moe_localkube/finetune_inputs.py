"""Small local inputs for fine-tuning (no hub access): a word-level tokenizer with a chat
template, a seeded tiny model saved with ``save_pretrained`` next to it, JSONL and Parquet data
sets. The tests use them, and ``python -m moe_localkube.finetune_inputs DIR`` writes what
``examples/finetune-local.yaml`` reads (README "Fine-tune your own model")."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "be",
    "this",
    "from",
    "or",
    "are",
    "not",
    "model",
    "expert",
    "router",
    "token",
    "layer",
    "train",
    "data",
    "loss",
    "step",
    "hello",
    "hi",
    "you",
    "there",
    "how",
    "what",
    "why",
]
SPECIAL = ["[UNK]", "[PAD]", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tokenizer(path: Path, *, chat_template: bool = True, extra_ids: int = 0) -> Path:
    """A word-level tokenizer (whitespace split) saved as a Hugging Face tokenizer directory;
    ``extra_ids`` more vocabulary entries (to outgrow a model's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = SPECIAL + WORDS + [f"w{i}" for i in range(extra_ids)]
    vocab = {w: i for i, w in enumerate(names)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="<eos>"
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


def tiny_model_config(preset: str = "tiny-mixtral") -> dict:
    from moejob_operator.core.models import preset_hf_config

    return preset_hf_config(preset)


def make_model(
    path: Path,
    *,
    preset: str = "tiny-mixtral",
    seed: int = 0,
    shard: str = "200KB",
    tokenizer: bool = True,
    dtype=None,
) -> Path:
    """A seeded tiny model of ``preset`` saved with save_pretrained (safetensors shards, fp32
    unless ``dtype``), with a tokenizer beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    from moe_trainer.model.models import build_hf_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_hf_config(tiny_model_config(preset)))
    model = model.to(dtype or torch.float32)
    model.save_pretrained(str(path), max_shard_size=shard)
    for f in path.iterdir():
        f.chmod(0o644)  # pods run as non-root users
    if tokenizer:
        make_tokenizer(path)
    return path


def sentences(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chats(n: int, seed: int = 0) -> list[dict]:
    s = sentences(3 * n, seed)
    return [
        {
            "messages": [
                {"role": "system", "content": s[3 * i]},
                {"role": "user", "content": s[3 * i + 1]},
                {"role": "assistant", "content": s[3 * i + 2]},
            ]
        }
        for i in range(n)
    ]


def write_parquet(path: Path, rows: list[dict], *, save_to_disk: bool = False) -> Path:
    """Parquet files (two of them) or a ``datasets`` save_to_disk directory, written with the
    ``datasets`` library."""
    import datasets

    ds = datasets.Dataset.from_list(rows)
    if save_to_disk:
        ds.save_to_disk(str(path))
        return path
    path.mkdir(parents=True, exist_ok=True)
    half = len(rows) // 2
    ds.select(range(half)).to_parquet(str(path / "part-0.parquet"))
    ds.select(range(half, len(rows))).to_parquet(str(path / "part-1.parquet"))
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="writes DIR/model (tiny Mixtral + tokenizer), DIR/data")
    ap.add_argument("--conversations", type=int, default=200)
    args = ap.parse_args(argv)
    make_model(args.dir / "model")
    write_jsonl(args.dir / "data" / "chat.jsonl", chats(args.conversations))
    for sub in ("ckpt", "export"):
        (args.dir / sub).mkdir(parents=True, exist_ok=True)
    print(f"{args.dir}/model: tiny Mixtral (save_pretrained) + tokenizer with a chat template")
    print(f"{args.dir}/data/chat.jsonl: {args.conversations} conversations")


if __name__ == "__main__":
    main()
