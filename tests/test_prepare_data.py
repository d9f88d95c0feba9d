"""moe-prepare-data: JSONL and Parquet (through `datasets`) tokenized once into memory-mapped
shards, reused by key; the SFT loss mask checked token by token against the chat template; bad
data refused with the file and the row; the trainer's reader of the shards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from finetune_fixtures import chats, make_tokenizer, sentences, write_jsonl, write_parquet
from moe_contracts.data import parse_data_report, parse_manifest
from moe_trainer import prepare_data as P
from moe_trainer.inputs.data import IGNORE_INDEX
from moe_trainer.inputs.prepared import PreparedSource


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def run(tmp_path, data, *, source="jsonl", fmt="text", field=None, tokenizer=None, seq_len=16):
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    argv = [
        "--source",
        source,
        "--data",
        str(data),
        "--format",
        fmt,
        "--seq-len",
        str(seq_len),
        "--out-root",
        str(tmp_path / "cache"),
        "--vocab-size",
        "320",
        "--report",
        str(report),
    ]
    if field:
        argv += ["--field", field]
    if tokenizer:
        argv += ["--tokenizer", str(tokenizer)]
    code = P.Run(P.parse_args(argv)).run()
    return code, parse_data_report(report.read_text())


def test_chat_mask_is_the_assistant_turns_token_by_token(tok_dir):
    from transformers import AutoTokenizer

    tok = P.Tokenizer(str(tok_dir))
    msgs = [
        {"role": "system", "content": "hello model"},
        {"role": "user", "content": "how is the router"},
        {"role": "assistant", "content": "the router is the expert"},
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": "it was train"},
    ]
    ids, mask = tok.chat(msgs)
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    rendered = hf.apply_chat_template(msgs, tokenize=False)
    assert ids == hf(rendered, add_special_tokens=False)["input_ids"]
    words = hf.convert_ids_to_tokens(ids)
    expected = [
        ("<|system|>", 0),
        ("hello", 0),
        ("model", 0),
        ("<|end|>", 0),
        ("<|user|>", 0),
        ("how", 0),
        ("is", 0),
        ("the", 0),
        ("router", 0),
        ("<|end|>", 0),
        ("<|assistant|>", 0),
        ("the", 1),
        ("router", 1),
        ("is", 1),
        ("the", 1),
        ("expert", 1),
        ("<|end|>", 1),
        ("<|user|>", 0),
        ("why", 0),
        ("<|end|>", 0),
        ("<|assistant|>", 0),
        ("it", 1),
        ("was", 1),
        ("train", 1),
        ("<|end|>", 1),
    ]
    assert list(zip(words, mask, strict=True)) == expected


def test_jsonl_text_prepared_once_then_reused(tmp_path, tok_dir):
    data = write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": t} for t in sentences(40)])
    write_jsonl(tmp_path / "d" / "sub" / "b.jsonl", [{"text": t} for t in sentences(20, 1)])
    code, rep = run(tmp_path, data.parent, tokenizer=tok_dir)
    assert code == 0 and rep.phase == "Done" and not rep.reused
    assert rep.files == rep.files_done == 2 and rep.documents == 60
    out = tmp_path / "cache" / rep.key
    assert rep.path == str(out)
    m = parse_manifest(json.loads((out / "manifest.json").read_text()))
    assert m.rows == rep.rows and m.tokens == rep.tokens and m.format == "text"
    rows = np.concatenate([np.load(out / s.tokens) for s in m.shards])
    assert rows.dtype == np.uint32 and rows.shape == (m.rows, 17)
    # consecutive rows share one token (the trainer's windows), the stream is every document + EOS
    assert (rows[1:, 0] == rows[:-1, -1]).all()
    code, again = run(tmp_path, data.parent, tokenizer=tok_dir)
    assert code == 0 and again.reused and again.key == rep.key and again.rows == rep.rows
    # another seqLen is another key
    code, other = run(tmp_path, data.parent, tokenizer=tok_dir, seq_len=8)
    assert code == 0 and other.key != rep.key and not other.reused


@pytest.mark.parametrize("save_to_disk", [False, True], ids=["parquet-files", "save_to_disk"])
def test_parquet_through_datasets(tmp_path, save_to_disk):
    rows = [{"body": t, "n": i} for i, t in enumerate(sentences(30))]
    data = write_parquet(tmp_path / "pq", rows, save_to_disk=save_to_disk)
    code, rep = run(tmp_path, data, source="parquet", field="body")
    assert code == 0 and rep.documents == 30, rep
    m = parse_manifest(json.loads((tmp_path / "cache" / rep.key / "manifest.json").read_text()))
    assert m.tokenizer.kind == "byte"
    # byte-level: the stream is the UTF-8 bytes of each text, then EOS (257), in row order
    tokens = np.load(tmp_path / "cache" / rep.key / m.shards[0].tokens)
    stream = [*tokens[0].tolist(), *[t for r in tokens[1:] for t in r[1:].tolist()]]
    want = [b for r in rows[:3] for b in [*r["body"].encode(), 257]]
    assert stream[: len(want)] == want


def test_sft_jsonl_mask_reaches_the_trainer(tmp_path, tok_dir):
    data = write_jsonl(tmp_path / "c.jsonl", chats(30))
    code, rep = run(tmp_path, data, fmt="chat", tokenizer=tok_dir)
    assert code == 0 and 0 < rep.loss_tokens < rep.tokens, rep
    src = PreparedSource(rep.path, 16, 4, seed=1, vocab_size=320)
    assert src.masked and src.n_windows == rep.rows
    inputs, targets = src.inputs_targets(0, 0, 1, 0, 1)
    tokens = src.batch(0, 0, 1, 0, 1)
    assert inputs.shape == targets.shape == (4, 16)
    np.testing.assert_array_equal(inputs, tokens[:, :-1])
    kept = targets != IGNORE_INDEX
    np.testing.assert_array_equal(targets[kept], tokens[:, 1:][kept])
    assert kept.any() and not kept.all()
    total = sum(
        (src.inputs_targets(s, 0, 1, 0, 1)[1] != IGNORE_INDEX).sum() for s in range(rep.rows // 4)
    )
    assert 0 < total <= rep.loss_tokens


@pytest.mark.parametrize(
    ("content", "code", "row", "text"),
    [
        ('{"text": "a b"}\n{"body": "c"}\n', "MissingField", 1, "no field 'text'"),
        ("", "EmptyFile", None, "no rows"),
        ('{"text": "a"}\n{"text": "b\n', "Undecodable", 1, "not JSON"),
        (b'{"text": "a"}\n{"text": "\xff\xfe"}\n', "Undecodable", 1, "not UTF-8"),
        ('{"text": 3}\n', "BadField", 0, "not a string"),
    ],
    ids=["missing-field", "empty-file", "bad-json", "bad-utf8", "wrong-type"],
)
def test_bad_jsonl_names_file_and_row(tmp_path, content, code, row, text):
    f = tmp_path / "d" / "x.jsonl"
    f.parent.mkdir()
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    rc, rep = run(tmp_path, f.parent)
    assert rc == 1 and rep.phase == "Failed"
    assert (rep.error.code, rep.error.file, rep.error.row) == (code, "x.jsonl", row)
    assert text in rep.error.message


def test_chat_without_template_is_refused(tmp_path):
    tok = make_tokenizer(tmp_path / "plain", chat_template=False)
    data = write_jsonl(tmp_path / "c.jsonl", chats(2))
    rc, rep = run(tmp_path, data, fmt="chat", tokenizer=tok)
    assert rc == 1 and rep.error.code == "NoChatTemplate"
    rc, rep = run(tmp_path, data, fmt="chat")
    assert rc == 1 and rep.error.code == "NoChatTemplate" and "byte-level" in rep.error.message


def test_missing_parquet_column_names_the_file(tmp_path):
    data = write_parquet(tmp_path / "pq", [{"body": t} for t in sentences(6)])
    rc, rep = run(tmp_path, data, source="parquet")
    assert rc == 1 and rep.error.code == "MissingField"
    assert rep.error.file == "part-0.parquet" and rep.error.row == 0


def test_tokenized_kind_reads_a_prepared_directory(tmp_path):
    """spec.data.kind Tokenized -> plan data kind "tokens": a directory with manifest.json is
    memory-mapped like prepared data, .npy arrays are read as before."""
    from types import SimpleNamespace

    from moe_trainer.inputs.data import BatchSource, make_batch_source

    data = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in sentences(20)])
    code, rep = run(tmp_path, data)
    assert code == 0
    src = make_batch_source(SimpleNamespace(kind="tokens", path=rep.path), 16, 2, 0, 320)
    assert isinstance(src, PreparedSource) and not src.masked
    inputs, targets = src.inputs_targets(0, 0, 1, 0, 1)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    npy = tmp_path / "npy"
    npy.mkdir()
    np.save(npy / "a.npy", np.arange(100, dtype=np.int32) % 300)
    assert isinstance(
        make_batch_source(SimpleNamespace(kind="tokens", path=str(npy)), 16, 2, 0, 320), BatchSource
    )


def test_masked_loss_counts_only_the_targets_that_count():
    import torch
    import torch.nn.functional as F

    from moe_trainer.inputs.data import lm_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    assert torch.equal(
        lm_loss(logits, targets, False),
        F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1)),
    )
    masked = targets.clone()
    masked[0, :3] = IGNORE_INDEX
    keep = masked.reshape(-1) != IGNORE_INDEX
    want = F.cross_entropy(logits.reshape(-1, 11)[keep], targets.reshape(-1)[keep])
    torch.testing.assert_close(lm_loss(logits, masked, True), want)
    nothing = torch.full_like(targets, IGNORE_INDEX)
    assert lm_loss(logits, nothing, True).item() == 0.0  # not NaN
