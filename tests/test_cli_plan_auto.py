"""`moectl plan --auto`: the ranked candidates with predicted memory and tokens/s, why the others
were rejected, the chosen shape in the written plan, the given values kept, a helpful refusal."""

from __future__ import annotations

import json
import re

from moejob_operator import cli


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


TWO_NODES = ("--topology", "nvswitch-h200-8@gpu-a", "--topology", "nvswitch-h200-8@gpu-b")


def test_auto_prints_the_ranked_candidates_and_writes_the_chosen_shape(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    code, out, err = _run(
        capsys,
        "plan",
        "--auto",
        *TWO_NODES,
        "--model",
        "bench-mixtral-3b",
        "--seq-len",
        "2048",
        "--global-batch",
        "64",
        "-o",
        str(out_file),
    )
    assert code == 0, err
    assert "sizing     Auto: nodes.count, nodes.gpusPerNode" in out
    assert "<- chosen" in out and "rejected:" in out and "GiB usable" in out
    doc = json.loads(out_file.read_text())
    chosen = doc["sizing"]["chosen"]
    assert doc["worldSize"] == chosen["nodeCount"] * chosen["gpusPerNode"]
    assert doc["training"]["microBatch"] == chosen["microBatch"]
    line = next(x for x in out.splitlines() if x.startswith("chosen "))
    assert f"microBatch {chosen['microBatch']}" in line and "tokens/s" in line


def test_auto_keeps_the_values_given_on_the_command_line(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    code, _out, err = _run(
        capsys,
        "plan",
        "--auto",
        *TWO_NODES,
        "--model",
        "bench-mixtral",
        "--global-batch",
        "32",
        "--gpus-per-node",
        "2",
        "--micro-batch",
        "2",
        "--no-activation-checkpointing",
        "-o",
        str(out_file),
    )
    assert code == 0, err
    rec = json.loads(out_file.read_text())["sizing"]
    assert "nodes.gpusPerNode" not in rec["auto"] and "training.microBatch" not in rec["auto"]
    for c in [rec["chosen"], *rec["candidates"]]:
        assert (c["gpusPerNode"], c["microBatch"], c["activationCheckpointing"]) == (2, 2, False)


def test_auto_refusal_names_the_smallest_shape_that_fits(capsys):
    base = (
        "plan",
        "--auto",
        "--topology",
        "nvswitch-h100-8@node-a",
        "--model",
        "mixtral-8x7b",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--micro-batch",
        "8",
    )
    code, out, err = _run(capsys, *base)
    assert code == 2 and out == ""
    assert err.startswith("moectl plan: error: memory: no shape fits in GPU memory on node-a")
    assert len(err.strip().splitlines()) == 1
    # more nodes, the given micro-batch kept (checkpointing is Auto)
    assert re.search(r"It needs \d+ nodes x 8 NVIDIA H100 [^(]*\(EP \d+, microBatch 8, ", err)
    # checkpointing given too: no node count rescues micro-batch 8, so it says what to change
    code, out, err = _run(capsys, *base, "--no-activation-checkpointing")
    assert code == 2
    assert re.search(r"It needs \d+ nodes x 8 NVIDIA H100 \S+ \S+ with microBatch \d", err)


def test_without_auto_nothing_is_sized(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    code, out, _ = _run(capsys, "plan", *TWO_NODES, "--model", "tiny-mixtral", "-o", str(out_file))
    assert code == 0 and "sizing" not in out
    assert "sizing" not in json.loads(out_file.read_text())
