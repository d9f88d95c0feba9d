"""Data: byte tokenizer, real-text corpus, deterministic disjoint shards, synthetic mode."""

import json

import numpy as np
import pytest

from moe_contracts.plan import DataSpec
from moe_trainer.inputs import corpus, data


def test_byte_tokenizer_roundtrip():
    tok = data.ByteTokenizer()
    ids = tok.encode("héllo, wörld")
    assert ids.max() < 256 and tok.decode(ids) == "héllo, wörld"
    assert tok.vocab_size == 259


def test_corpus_is_real_text_and_deterministic(tmp_path):
    a = corpus.build_corpus(max_bytes=200_000, cache_dir=tmp_path / "a")
    b = corpus.build_corpus(max_bytes=200_000, cache_dir=tmp_path / "b")
    text = a.read_text()
    assert a.read_bytes() == b.read_bytes()
    assert 150_000 < len(text.encode()) <= 200_000
    assert text.count(" the ") > 500  # English prose, not noise
    assert corpus.build_corpus(max_bytes=200_000, cache_dir=tmp_path / "a") == a  # cached


def test_batches_are_deterministic_and_disjoint_across_ranks(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(corpus.DOC_SEPARATOR.join(f"document number {i} " * 20 for i in range(200)))
    toks = data.tokens_from_text(f, data.ByteTokenizer())
    assert (toks == data.ByteTokenizer.EOS).sum() == 200
    src = data.BatchSource(toks, seq_len=32, micro_batch=2, seed=7, vocab_size=320)
    b0 = src.batch(step=3, micro=1, grad_accum=2, dp_rank=0, dp_size=2)
    b1 = src.batch(step=3, micro=1, grad_accum=2, dp_rank=1, dp_size=2)
    assert b0.shape == (2, 33)
    again = data.BatchSource(toks, seq_len=32, micro_batch=2, seed=7, vocab_size=320)
    np.testing.assert_array_equal(again.batch(3, 1, 2, 0, 2), b0)
    assert not np.array_equal(b0, b1)
    # within one epoch the windows of all (step, micro, rank, row) are distinct: token i == i
    ids = data.BatchSource(
        np.arange(32 * 40 + 1), seq_len=32, micro_batch=2, seed=7, vocab_size=10**6
    )
    starts = [
        int(row[0])
        for step in range(5)
        for micro in range(2)
        for r in range(2)
        for row in ids.batch(step, micro, 2, r, 2)
    ]
    assert len(set(starts)) == len(starts) == 40 and all(s % 32 == 0 for s in starts)


def test_npy_and_synthetic_and_errors(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(1000) % 300)
    src = data.make_batch_source(DataSpec(kind="tokens", path=str(tmp_path)), 16, 2, 0, 320)
    assert src.batch(0, 0, 1, 0, 1).shape == (2, 17)
    syn = data.make_batch_source(DataSpec(kind="synthetic"), 16, 2, 0, 320)
    assert syn.batch(5, 0, 1, 1, 2).max() < 320
    np.testing.assert_array_equal(syn.batch(5, 0, 1, 1, 2), syn.batch(5, 0, 1, 1, 2))
    with pytest.raises(data.DataError, match=r"token id 299 >= model vocab_size 256"):
        data.make_batch_source(DataSpec(kind="tokens", path=str(tmp_path)), 16, 2, 0, 256)
    with pytest.raises(data.DataError, match=r"does not exist"):
        data.make_batch_source(DataSpec(kind="text", path=str(tmp_path / "nope")), 16, 2, 0, 320)


def test_hf_tokenizer_from_a_local_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", eos_token="</s>"
    ).save_pretrained(tmp_path / "tok")
    (tmp_path / "text.txt").write_text("hello world" + corpus.DOC_SEPARATOR + "world hello zzz")
    src = data.make_batch_source(
        DataSpec(kind="text", path=str(tmp_path / "text.txt"), tokenizer=str(tmp_path / "tok")),
        seq_len=3,
        micro_batch=1,
        seed=0,
        vocab_size=4,
    )
    assert src.tokens.tolist() == [2, 3, 1, 3, 2, 0, 1]


def _starts(src, steps: int, grad_accum: int, dp: int) -> list[int]:
    """The first token of every row, in sample order (token i == i)."""
    return [
        int(row[0])
        for step in range(steps)
        for micro in range(grad_accum)
        for r in range(dp)
        for row in src.batch(step, micro, grad_accum, r, dp)
    ]


def test_sequential_order_reads_windows_in_stream_order_epoch_after_epoch(tmp_path):
    """``training.data.order: sequential``: sample i is window i % n (files in path order), so a
    stream whose second half is another domain switches domain at a known step; ranks still
    read disjoint rows and a resumed run (any step) reads what the straight run read."""
    np.save(tmp_path / "a.npy", np.arange(32 * 10 + 1))  # 10 windows of 32
    spec = DataSpec(kind="tokens", path=str(tmp_path), order="sequential")
    src = data.make_batch_source(spec, 32, 2, 7, 10**6)
    assert src.order.sequential
    starts = _starts(src, steps=5, grad_accum=1, dp=2)  # 20 samples: 2 epochs of 10 windows
    assert starts == [32 * (i % 10) for i in range(20)]
    shuffled = data.make_batch_source(DataSpec(kind="tokens", path=str(tmp_path)), 32, 2, 7, 10**6)
    first = _starts(shuffled, steps=5, grad_accum=1, dp=2)
    assert sorted(first[:10]) == starts[:10] and first[:10] != starts[:10]
    assert first[:10] != first[10:]  # redrawn each epoch
    # a fresh source asked for step 3 directly reads what the straight run read at step 3
    again = data.make_batch_source(spec, 32, 2, 7, 10**6)
    np.testing.assert_array_equal(again.batch(3, 0, 1, 1, 2), src.batch(3, 0, 1, 1, 2))


def test_sequential_text_follows_file_order(tmp_path):
    (tmp_path / "1-prose.txt").write_text("a" * 199)
    (tmp_path / "2-digits.txt").write_text("7" * 199)
    spec = DataSpec(kind="text", path=str(tmp_path), order="sequential")
    src = data.make_batch_source(spec, 50, 1, 0, 320)
    rows = [chr(int(src.batch(s, 0, 1, 0, 1)[0, 0])) for s in range(src.n_windows)]
    assert rows == ["a"] * 4 + ["7"] * 3  # 400 tokens (an EOS after each file): 7 windows


def test_sequential_prepared_rows(tmp_path):
    from moe_contracts.data import MANIFEST_FILE
    from moe_trainer.inputs.prepared import PreparedSource

    rows = np.arange(6 * 9, dtype=np.uint32).reshape(6, 9)
    np.save(tmp_path / "tokens-0.npy", rows[:4])
    np.save(tmp_path / "tokens-1.npy", rows[4:])
    manifest = {
        "kind": "DataManifest",
        "version": 1,
        "key": "k",
        "source": "jsonl",
        "field": "text",
        "seqLen": 8,
        "tokenizer": {"kind": "byte", "vocabSize": 259, "eosId": 257, "padId": 258},
        "documents": 6,
        "tokens": 54,
        "lossTokens": 48,
        "rows": 6,
        "shards": [
            {"tokens": "tokens-0.npy", "rows": 4},
            {"tokens": "tokens-1.npy", "rows": 2},
        ],
    }
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest))
    src = PreparedSource(tmp_path, 8, 1, seed=3, vocab_size=320, sequential=True)
    got = [int(src.batch(s, 0, 1, 0, 1)[0, 0]) for s in range(12)]
    assert got == [9 * (i % 6) for i in range(12)]
