"""Checkpoint mapping without a process group (fast): the loader and the export against
transformers' own `save_pretrained`, for every family and a non-identity placement; a partition's
row ranges; shards and index; refusals that name the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_trainer import families
from moe_trainer.model import export, models, pretrained
from moe_trainer.model.hf_checkpoint import CheckpointError, weight_map

NAMES = families.NAMES


def seeded(name: str, seed: int = 5):
    fam = families.get(name)
    model = models.build_model(fam.tiny_config, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.rsplit(".", 1)[-1] in fam.router_buffers:
                b.copy_(torch.randn(b.shape, generator=g))
    return model


def perm_for(model) -> list[list[int]]:
    E, L = models.num_experts_of(model), len(models.find_moe_layers(model))
    return [
        [(s + layer + 1) % E for s in range(E)][:: -1 if layer % 2 else 1] for layer in range(L)
    ]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for key, name in weight_map(path).items():
        with safe_open(str(path / name), "pt") as f:
            out[key] = f.get_tensor(key)
    return out


def state(model) -> dict[str, torch.Tensor]:
    fam = families.of_model(model)
    out = dict(model.named_parameters())
    out.update(
        {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in fam.router_buffers}
    )
    return {n: t.detach() for n, t in out.items()}


@pytest.mark.parametrize("name", NAMES)
def test_load_places_experts_like_permute_experts(name, tmp_path):
    src = seeded(name)
    src.save_pretrained(tmp_path)
    perm = perm_for(src)
    want = seeded(name)
    models.permute_experts(want, perm)
    got = seeded(name, seed=99)  # other weights: all must be overwritten
    report = pretrained.load(got, tmp_path, perm)
    assert report["unused"] == []
    a, b = state(want), state(got)
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("name", NAMES)
def test_export_of_a_placed_model_is_what_save_pretrained_writes(name, tmp_path):
    model = seeded(name)
    model.save_pretrained(tmp_path / "ref")
    perm = perm_for(model)
    models.permute_experts(model, perm)
    doc = export.export_model(model, families.get(name).tiny_config, perm, tmp_path / "out", 4)
    ref, out = tensors(tmp_path / "ref"), tensors(tmp_path / "out")
    assert ref.keys() == out.keys()
    for k in ref:
        assert torch.equal(ref[k], out[k]), k
    assert doc["step"] == 4 and doc["family"] == name


def test_shards_index_and_reading_them_back(tmp_path):
    from transformers import AutoModelForCausalLM

    model = seeded("qwen3_moe")
    perm = perm_for(model)
    models.permute_experts(model, perm)
    cfg = families.get("qwen3_moe").tiny_config
    export.export_model(model, cfg, perm, tmp_path / "out", 1, shard_bytes=200_000)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    back = seeded("qwen3_moe", seed=42)
    pretrained.load(back, tmp_path / "out", perm)  # read through the index, placed again
    a, b = state(model), state(back)
    assert all(torch.equal(a[n], b[n]) for n in a)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    unplaced = seeded("qwen3_moe")
    assert all(torch.equal(hf.state_dict()[n], unplaced.state_dict()[n]) for n in state(unplaced))


def test_export_replaces_an_earlier_one_inside_the_directory(tmp_path):
    """The output path is a mount point in a pod: the export is committed inside it (staged,
    moved file by file, the manifest last); a later export replaces the earlier one's files and
    removes the ones it no longer has; files that are not the export's stay."""
    model = seeded("olmoe")
    cfg = families.get("olmoe").tiny_config
    perm = perm_for(model)
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")
    first = export.export_model(model, cfg, perm, out, 1, shard_bytes=100_000)
    assert len(first["files"]) > 5
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    second = export.export_model(model, cfg, perm, out, 2)
    on_disk = sorted(p.name for p in out.iterdir())
    assert on_disk == sorted([*(f["name"] for f in second["files"]), "export.json", "README.md"])
    assert json.loads((out / "export.json").read_text())["step"] == 2
    assert first["sha256"] != second["sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_partitions_cover_the_permuted_tensor(monkeypatch, tmp_path, chunk, world):
    """Each rank's slice of the flattened tensor, read in row blocks of at most ``chunk``
    elements (a row is never split), equals the same slice of the whole permuted tensor."""
    model = seeded("mixtral")
    model.save_pretrained(tmp_path)
    perm = perm_for(model)
    want = seeded("mixtral")
    models.permute_experts(want, perm)
    monkeypatch.setattr(pretrained, "CHUNK_ELEMENTS", chunk)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.embed_tokens.weight"):
        full = dict(want.named_parameters())[name].detach().reshape(-1)
        size = -(-full.numel() // world)
        parts = []
        for rank in range(world):
            target = seeded("mixtral", seed=3)
            param = dict(target.named_parameters())[name]
            part = torch.full((size,), float("nan"))
            monkeypatch.setattr(
                pretrained,
                "_partition_of",
                lambda p, part=part, rank=rank, param=param: (
                    (part, rank * size, size) if p is param else None
                ),
            )
            pretrained.load(target, tmp_path, perm)
            parts.append(part)
        got = torch.cat(parts)
        assert torch.equal(got[: full.numel()], full), name
        assert torch.isnan(got[full.numel() :]).all()  # padding untouched


def _resave(src: Path, dst: Path, drop: str | None = None, change: str | None = None) -> None:
    from safetensors.torch import save_file

    t = tensors(src)
    if drop:
        del t[drop]
    if change:
        t[change] = torch.zeros(3, 3)
    dst.mkdir()
    save_file(t, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_refusals_name_the_tensor(tmp_path):
    seeded("mixtral").save_pretrained(tmp_path / "ok")
    ok = tmp_path / "ok"
    _resave(ok, tmp_path / "a", drop="model.norm.weight")
    with pytest.raises(
        CheckpointError, match=r"1 tensor\(s\) .* not in the checkpoint.*model.norm"
    ):
        pretrained.load(seeded("mixtral"), tmp_path / "a", None)
    _resave(ok, tmp_path / "b", drop="model.layers.0.block_sparse_moe.experts.3.w1.weight")
    with pytest.raises(CheckpointError, match=r"expert tensor\(s\) missing.*experts.3.w1.weight"):
        pretrained.load(seeded("mixtral"), tmp_path / "b", None)
    _resave(ok, tmp_path / "c", change="lm_head.weight")
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' has shape \[3, 3\].*\[320, 64\]"):
        pretrained.load(seeded("mixtral"), tmp_path / "c", None)
    (tmp_path / "d").mkdir()
    with pytest.raises(CheckpointError, match=r"holds no \*.safetensors"):
        pretrained.load(seeded("mixtral"), tmp_path / "d", None)
    (tmp_path / "d" / "model.safetensors.index.json").write_text('{"weight_map": {"x": "y.st"}}')
    with pytest.raises(CheckpointError, match=r"names missing shard\(s\) \['y.st'\]"):
        pretrained.load(seeded("mixtral"), tmp_path / "d", None)
    (tmp_path / "d" / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"is not a safetensors index"):
        pretrained.load(seeded("mixtral"), tmp_path / "d", None)


def test_export_schedule():
    from types import SimpleNamespace as NS  # noqa: N814

    out = NS(path="/out", every_checkpoints=2)
    plan = NS(
        output=out,
        model=NS(path=None, hf_config={"model_type": "mixtral"}, family="mixtral"),
        training=NS(checkpoint_every_steps=5, data=NS(tokenizer=None)),
    )
    ex = export.Exporter(plan, [[0]])
    assert [s for s in range(1, 24) if ex.due(s, 23)] == [10, 20, 23]
    out.every_checkpoints = 0
    assert [s for s in range(1, 24) if ex.due(s, 23)] == [23]
