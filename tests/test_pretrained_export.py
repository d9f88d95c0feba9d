"""A pretrained checkpoint in, a trained Hugging Face model out, through `moe-train` (2 gloo
ranks, ZeRO-3 with no parameter kept whole, a non-identity placement), for every family:

* the model the trainer built from `model.path` (partitioned, streamed, experts placed; AutoEP
  at EP 2 or the grouped block) gives the logits of `from_pretrained(model.path)` within 1e-4
  relative (fp32, CPU);
* `from_pretrained(<plan output>)` gives the logits of the trainer's final model within 1e-4
  relative, after the weights moved; progress reports the export and `export.json` describes the
  files it sits beside;
* the dedup dispatcher (Mixtral, and DeepSeek-V3 with router groups kept whole) loads and exports
  the same way.

The trainer's logits come from its own test hook (`MOE_TEST_LOGITS_DIR`: the engine's module on
one fixed batch, after `build` + `resume` and after the last step). One run per family, ~40 s
each on this machine's 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from family_plans import plan_doc, write_plan
from moe_contracts.progress import parse_progress
from moe_trainer import families
from moe_trainer.launch import launch
from moe_trainer.model import models

pytestmark = pytest.mark.slow

# family -> (dispatcher, hfConfig overrides): every registered family, AutoEP's dispatcher unless
# named here (families without an AutoEP preset run the grouped block at EP 1 either way)
CASES = {name: ("autoep", {}) for name in families.NAMES} | {
    "mixtral": ("dedup", {}),
    "deepseek_v3": ("dedup", {"n_group": 2, "topk_group": 1}),
}
STEPS = 3
STEP_99 = ("--step", "99")  # a checkpoint step the runs never reach
TOL = 1e-4


def seeded_checkpoint(family: str, overrides: dict, where: Path) -> Path:
    """``save_pretrained`` of the family's tiny model, every parameter and per-expert router
    buffer perturbed with seeded noise (no zero norms or biases that would hide a misplaced
    tensor)."""
    cfg = dict(families.get(family).tiny_config, **overrides)
    model = models.build_model(cfg, seed=5)
    g = torch.Generator().manual_seed(11)
    fam = families.get(family)
    with torch.no_grad():
        tensors = list(model.named_parameters()) + [
            (n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in fam.router_buffers
        ]
        for _, t in tensors:
            t.add_(torch.randn(t.shape, generator=g) * 0.05)
    model.save_pretrained(where)
    return where


def add_tokenizer(where: Path) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tk = Tokenizer(tk_models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", eos_token="</s>"
    ).save_pretrained(where)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pretrained")
    out = {}
    for family, (dispatcher, overrides) in CASES.items():
        d = base / family
        d.mkdir()
        src = seeded_checkpoint(family, overrides, d / "model")
        if family == "mixtral":
            add_tokenizer(src)
        cfg = json.loads((src / "config.json").read_text())
        doc = plan_doc(
            family,
            cfg,
            path=str(src),
            dispatcher=dispatcher,
            steps=STEPS,
            output={"path": str(d / "export"), "everyCheckpoints": 0},
            lr=1e-2,
        )
        logits = d / "logits"
        logits.mkdir()
        codes = launch(
            2,
            [
                "--plan",
                str(write_plan(d, family, doc)),
                "--checkpoint-dir",
                str(d / "ckpt"),
                "--cpu",
            ],
            env=dict(os.environ, MOE_TEST_LOGITS_DIR=str(logits), MOE_VERIFY_PLACEMENT="1"),
            timeout=600,
            log_prefix=str(d / "log"),
        )
        out[family] = {"codes": codes, "dir": d, "plan": doc}
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.mark.parametrize("family", list(CASES))
def test_loaded_model_equals_from_pretrained(runs, family):
    r = runs[family]
    assert r["codes"] == [0, 0], (r["dir"] / "log.rank0.log").read_text()[-3000:]
    start = torch.load(r["dir"] / "logits" / "start.pt")
    want = hf_logits(r["dir"] / "model", start["input_ids"])
    assert rel(start["logits"], want) < TOL
    # the placement is not the identity and moved experts between the EP ranks
    perm = r["plan"]["placement"]["permutation"]
    assert all(row != sorted(row) for row in perm)
    for rank in range(2):  # MOE_VERIFY_PLACEMENT: each rank holds the experts the plan says
        report = json.loads((r["dir"] / "ckpt" / f"placement_check_rank{rank}.json").read_text())
        assert report["ok"], report


@pytest.mark.parametrize("family", list(CASES))
def test_export_equals_the_trained_model(runs, family):
    r = runs[family]
    assert r["codes"] == [0, 0]
    start = torch.load(r["dir"] / "logits" / "start.pt")
    final = torch.load(r["dir"] / "logits" / "final.pt")
    assert rel(final["logits"], start["logits"]) > 0.01  # training moved the weights
    assert rel(hf_logits(r["dir"] / "export", final["input_ids"]), final["logits"]) < TOL


@pytest.mark.parametrize("family", list(CASES))
def test_export_is_a_checkpoint_like_save_pretrained_writes(runs, family):
    from safetensors import safe_open

    r = runs[family]
    export, src = r["dir"] / "export", r["dir"] / "model"
    with (
        safe_open(str(src / "model.safetensors"), "pt") as a,
        safe_open(str(export / "model.safetensors"), "pt") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())  # the family's names and per-expert layout
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == [families.get(family).causal_lm_class]
    assert (export / "generation_config.json").is_file()
    assert not list(export.glob(".export-*"))  # no staging left


@pytest.mark.parametrize("family", list(CASES))
def test_manifest_and_progress_describe_the_export(runs, family):
    r = runs[family]
    export = r["dir"] / "export"
    doc = json.loads((export / "export.json").read_text())
    assert doc["kind"] == "MoEExport" and doc["step"] == STEPS and doc["path"] == str(export)
    total = hashlib.sha256()
    files = sorted(p for p in export.iterdir() if p.name != "export.json")
    assert [f["name"] for f in doc["files"]] == [p.name for p in files]
    for f, p in zip(doc["files"], files, strict=True):
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        assert (f["bytes"], f["sha256"]) == (p.stat().st_size, digest)
        total.update(f"{p.name}\0{digest}\n".encode())
    assert doc["sha256"] == total.hexdigest()
    assert doc["bytes"] == sum(p.stat().st_size for p in files)
    progress = parse_progress((r["dir"] / "ckpt" / "progress.json").read_text())
    assert progress.phase == "Finished"
    assert progress.output is not None
    assert (progress.output.path, progress.output.bytes, progress.output.sha256) == (
        str(export),
        doc["bytes"],
        doc["sha256"],
    )
    assert progress.output.step == STEPS


def test_tokenizer_files_travel_with_the_export(runs):
    from transformers import AutoTokenizer

    d = runs["mixtral"]["dir"]
    a = AutoTokenizer.from_pretrained(d / "model")
    b = AutoTokenizer.from_pretrained(d / "export")
    assert a("hello world zzz")["input_ids"] == b("hello world zzz")["input_ids"] == [2, 3, 0]


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_moectl_export_from_the_checkpoint_equals_the_trained_model(runs, family, tmp_path):
    """Offline: `moectl export CHECKPOINT OUT` (which runs the trainer's `moe-export`, one
    process per rank of the checkpoint's plan) writes the same model from the DeepSpeed
    checkpoint of the last step."""
    import subprocess
    import sys

    r = runs[family]
    out = tmp_path / "offline"
    proc = subprocess.run(
        [sys.executable, "-m", "moejob_operator.cli", "export", str(r["dir"] / "ckpt"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    final = torch.load(r["dir"] / "logits" / "final.pt")
    assert rel(hf_logits(out, final["input_ids"]), final["logits"]) < TOL
    doc = json.loads((out / "export.json").read_text())
    assert doc["step"] == STEPS and doc["path"] == str(out)


def test_moe_export_refuses_a_missing_checkpoint(runs, tmp_path):
    import subprocess
    import sys

    ckpt = runs["olmoe"]["dir"] / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_trainer.export_cli", str(ckpt), str(tmp_path / "x"), *STEP_99],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "no checkpoint 99" in proc.stderr
    assert not (tmp_path / "x").exists()
