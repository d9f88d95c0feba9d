"""moe-inspect on real save_pretrained directories, and the operator's decision on its report
(core.model_report): every refusal of the model's directory, with the message a person reads."""

from __future__ import annotations

import json
import struct

import pytest

from finetune_fixtures import make_model, make_tokenizer, tiny_model_config
from moe_contracts.model import parse_model_report
from moe_trainer.inspect_model import inspect
from moejob_operator.core import model_report as M
from moejob_operator.core.models import FAMILIES, spec_from_hf_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "tiny")


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _refusal(path) -> M.ModelRefused:
    report = parse_model_report(inspect(path))
    with pytest.raises(M.ModelRefused) as info:
        M.resolve_report(report, "/model")
    return info.value


def test_report_of_a_saved_model_plans_like_its_hf_config(model_dir):
    doc = inspect(model_dir)
    report = parse_model_report(doc)
    assert report.errors == ()
    assert report.model_type == "mixtral" and report.architectures == ("MixtralForCausalLM",)
    assert len(report.shards) > 1 and all(s.data_end_bytes == s.bytes for s in report.shards)
    assert set(report.dtypes) == {"F32"}
    # parameters from the headers = the planner's count from the config
    spec = spec_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    assert report.parameters == spec.counts().total
    assert report.tokenizer.present and report.tokenizer.chat_template
    from transformers import AutoTokenizer

    assert report.tokenizer.vocab_size == len(AutoTokenizer.from_pretrained(str(model_dir)))
    model = M.resolve_report(report, "/model")
    assert model.hf_config == report.config and model.path == "/model"
    assert model.spec == spec
    assert inspect(model_dir)["contentHash"] == doc["contentHash"]  # stable


def test_no_config(tmp_path):
    (tmp_path / "m").mkdir()
    exc = _refusal(tmp_path / "m")
    assert exc.reason == "ModelConfigMissing" and "has no config.json" in str(exc)
    assert str(exc).startswith("spec.model.path: ")


def test_missing_directory(tmp_path):
    assert _refusal(tmp_path / "nope").reason == "ModelNotFound"


def test_dense_model_is_not_moe(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}
        )
    )
    exc = _refusal(d)
    assert exc.reason == "ModelNotMoE"
    assert "'llama' (LlamaForCausalLM) is not a Mixture-of-Experts model" in str(exc)


def test_unsupported_moe_lists_the_supported(tmp_path):
    d = tmp_path / "olmoe"
    d.mkdir()
    cfg = {
        "model_type": "olmoe_x",
        "architectures": ["OlmoeXForCausalLM"],
        "num_experts": 64,
        "num_experts_per_tok": 8,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    exc = _refusal(d)
    assert exc.reason == "UnsupportedArchitecture"
    assert f"supported model_type values: {', '.join(FAMILIES)}" in str(exc)


def test_missing_shard(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "m")
    shard = sorted(d.glob("*.safetensors"))[1]
    shard.unlink()
    exc = _refusal(d)
    assert exc.reason == "ModelShardsInvalid"
    assert f"{shard.name}: named by the index, not in the directory" in str(exc)


def test_truncated_shard(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "m")
    shard = min(d.glob("*.safetensors"))
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size - 100)
    exc = _refusal(d)
    assert exc.reason == "ModelShardsInvalid"
    assert f"{shard.name}: the header declares {size} bytes, the file has {size - 100}" in str(exc)


def test_no_weights(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_model_config()))
    (d / "pytorch_model.bin").write_bytes(b"x")
    exc = _refusal(d)
    assert exc.reason == "ModelShardsInvalid" and "only pytorch_model.bin" in str(exc)


def _rewrite_dtype(shard, dtype: str) -> None:
    """Relabel every tensor of a shard (header only; the sizes keep matching for I8 of F32 x4)."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for name, t in header.items():
        if name != "__metadata__":
            t["dtype"] = dtype
            t["shape"] = [*t["shape"][:-1], t["shape"][-1] * 4]  # 1-byte elements, same bytes
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_quantized_dtype(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "m")
    _rewrite_dtype(min(d.glob("*.safetensors")), "F8_E4M3")
    exc = _refusal(d)
    assert exc.reason == "UnsupportedDtype"
    assert "tensors stored as F8_E4M3" in str(exc) and "trains F32, F16, BF16" in str(exc)


def test_tokenizer_larger_than_vocabulary(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "m")
    make_tokenizer(d, extra_ids=400)  # 446 ids, the model has 320 rows
    exc = _refusal(d)
    assert exc.reason == "TokenizerVocabMismatch"
    assert "the tokenizer has 446 token ids, config.json vocab_size is 320" in str(exc)


def test_hash_changes_with_the_directory(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "m")
    before = inspect(d)["contentHash"]
    cfg = json.loads((d / "config.json").read_text())
    cfg["router_aux_loss_coef"] = 0.5
    (d / "config.json").write_text(json.dumps(cfg))
    assert inspect(d)["contentHash"] != before
