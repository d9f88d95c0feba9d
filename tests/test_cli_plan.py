"""`moectl plan` in-process: summary, written plan, exit code 2 with one line on bad input."""

import json
import re

import pytest

from moe_contracts.plan import load_plan
from moe_contracts.routing import write_routing_stats
from moejob_operator import cli
from moejob_operator.core import models, routing


def read_plan(path):
    return load_plan(path, complete=True).raw


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_two_nodes_writes_a_valid_plan(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    code, out, err = _run(
        capsys,
        "plan",
        "--topology",
        "nvswitch-h200-8@gpu-a",
        "--topology",
        "nvswitch-h200-8@gpu-b",
        "--model",
        "mixtral-8x7b",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--activation-checkpointing",
        "--job",
        "mix",
        "-o",
        str(out_file),
    )
    assert code == 0, err
    for text in (
        "world size 16",
        "NVLink     gpu-a[0-7] gpu-b[0-7]",
        "EP size    8",
        "x contiguous",
        "optimizer",
        "activations",
        "fits:",
        f"wrote {out_file}",
    ):
        assert text in out
    doc = read_plan(out_file)
    assert (doc["job"]["name"], doc["worldSize"], doc["epSize"]) == ("mix", 16, 8)
    assert doc["training"]["activationCheckpointing"] is True


def test_plan_with_stats_config_file_and_overrides(capsys, tmp_path):
    cfg = models.preset_hf_config("tiny-qwen3-moe")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    stats = routing.synthetic_trace(4, 8, 2, 1024, num_clusters=2, seed=2).without_tokens()
    write_routing_stats(stats, tmp_path / "routing.json")
    code, out, err = _run(
        capsys,
        "plan",
        "--topology",
        "pcie-bridged-pairs-4",
        "--model",
        str(tmp_path / "config.json"),
        "--stats",
        str(tmp_path / "routing.json"),
        "--ep-size",
        "4",
        "--global-batch",
        "8",
        "--seq-len",
        "64",
        "--ds-override",
        '{"steps_per_print": 1}',
        "-o",
        str(tmp_path / "plan.json"),
    )
    assert code == 0, err
    assert "routingStats routing" in out and "spans NVLink groups" in out
    doc = read_plan(tmp_path / "plan.json")
    assert (
        doc["model"]["path"] is None
        and doc["model"]["preset"] is None
        and doc["model"]["hfConfig"] == cfg
    )
    assert doc["deepspeed"]["steps_per_print"] == 1
    assert doc["placement"]["quality"]["basis"] == "routingStats"


def test_plan_cpu_mode(capsys, tmp_path):
    code, out, err = _run(
        capsys,
        "plan",
        "--cpu",
        "--procs-per-node",
        "2",
        "--cpu-memory-gib",
        "4",
        "--model",
        "tiny-mixtral",
        "--global-batch",
        "4",
        "--seq-len",
        "128",
        "-o",
        str(tmp_path / "p.json"),
    )
    assert code == 0, err
    assert "device     cpu" in out and "memory per process" in out
    doc = read_plan(tmp_path / "p.json")
    assert doc["device"] == "cpu" and doc["distBackend"] == "gloo" and doc["worldSize"] == 2


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["plan", "--topology", "nvswitch-h200-8", "--model", "mixtral-9x9b"],
            r"neither a known preset \(mixtral-8x7b",
        ),
        (
            ["plan", "--topology", "no-such-machine", "--model", "tiny-mixtral"],
            "no such file or fixture",
        ),
        (["plan", "--model", "tiny-mixtral"], "--topology is required"),
        (
            ["plan", "--topology", "nvswitch-h200-8", "--model", "tiny-mixtral", "--strategy", "x"],
            "invalid choice: 'x'",
        ),
        (
            [
                "plan",
                "--topology",
                "nvswitch-h200-8",
                "--model",
                "tiny-mixtral",
                "--gpus-per-node",
                "9",
            ],
            "gpusPerNode: 9 requested",
        ),
        (
            [
                "plan",
                "--topology",
                "nvswitch-h200-8",
                "--model",
                "deepseek-v3",
                "--seq-len",
                "4096",
            ],
            r"memory: the job needs .* short by",
        ),
        (
            [
                "plan",
                "--topology",
                "nvswitch-h200-8",
                "--model",
                "tiny-mixtral",
                "--ds-override",
                "{x",
            ],
            "--ds-override: '{x' is not a JSON object",
        ),
        (
            [
                "plan",
                "--topology",
                "nvswitch-h200-8",
                "--model",
                "tiny-mixtral",
                "--ds-override",
                '{"zero_optimization": {"zero_hpz_partition_size": 8}}',
            ],
            "zero_hpz_partition_size: 8",
        ),
        ([], "required: command"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, match):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("moectl")
    assert re.search(match, err), err


def test_topology_file_path(capsys, tmp_path):
    from moejob_operator.core.topology import FIXTURE_DIR

    path = tmp_path / "node.json"
    path.write_text((FIXTURE_DIR / "single-h200.json").read_text())
    code, out, _ = _run(
        capsys,
        "plan",
        "--topology",
        str(path),
        "--model",
        "tiny-mixtral",
        "--global-batch",
        "2",
        "--seq-len",
        "64",
    )
    assert code == 0 and "world size 1" in out and "EP size    1" in out


def _plan_with(capsys, tmp_path, stats_doc, top_k=4):
    cfg = dict(models.preset_hf_config("tiny-qwen3-moe"), num_experts_per_tok=top_k)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = [
        "plan",
        "--topology",
        "pcie-bridged-pairs-4",
        "--model",
        str(tmp_path / "config.json"),
        "--ep-size",
        "4",
        "--global-batch",
        "8",
        "--seq-len",
        "64",
        "-o",
        str(tmp_path / "plan.json"),
    ]
    if stats_doc is not None:
        (tmp_path / "routing.json").write_text(json.dumps(stats_doc))
        argv += ["--stats", str(tmp_path / "routing.json")]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    return out, read_plan(tmp_path / "plan.json")


def test_top4_without_token_samples_is_labelled_a_lower_bound(capsys, tmp_path):
    stats = routing.synthetic_trace(4, 8, 4, 2048, num_clusters=2, seed=2)
    out, doc = _plan_with(capsys, tmp_path, stats.without_tokens().to_json())
    assert "LOWER BOUND" in out and doc["placement"]["quality"]["estimate"] == "lowerBound"
    assert any("bytes are lower bounds" in w for w in doc["warnings"])
    out, doc = _plan_with(capsys, tmp_path, stats.to_json())  # v2 with tokenSamples: exact
    assert "LOWER BOUND" not in out and doc["placement"]["quality"]["estimate"] == "exact"


def test_empty_routing_stats_do_not_shrink_the_dispatch_buffer(capsys, tmp_path):
    empty = routing.synthetic_trace(4, 8, 4, 16, seed=0).without_tokens().to_json()
    empty.update(tokens=0, load=[[0] * 8] * 4, coactivation=[[[0] * 8] * 8] * 4)
    out, doc = _plan_with(capsys, tmp_path, empty)
    _, none = _plan_with(capsys, tmp_path, None)
    assert "records 0 tokens" in out and doc["placement"]["quality"]["basis"] == "uniform"
    assert (
        doc["memory"]["breakdown"]["moeDispatchBytes"]
        == none["memory"]["breakdown"]["moeDispatchBytes"]
    )


def test_plan_shows_dedup_and_autoep_bytes_side_by_side(capsys, tmp_path):
    """Two CPU 'nodes' x 2 processes (EP 4 over 2 groups), routing statistics with sampled tokens:
    the plan defaults to the dedup dispatcher and carries both dispatchers' bytes by tier, equal
    to core.dispatch on the same tokens scaled to the job's tokens per step."""
    from moejob_operator.core import dispatch, placement
    from moejob_operator.core.plan import cpu_topology

    cfg = dict(models.preset_hf_config("tiny-mixtral"), num_local_experts=8, num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    stats = routing.synthetic_trace(cfg["num_hidden_layers"], 8, 2, 512, num_clusters=2, seed=2)
    (tmp_path / "routing.json").write_text(json.dumps(stats.to_json()))  # v2, with tokenSamples
    args = [
        "plan",
        "--cpu",
        "--nodes",
        "a,b",
        "--procs-per-node",
        "2",
        "--cpu-memory-gib",
        "4",
        "--model",
        str(tmp_path / "config.json"),
        "--stats",
        str(tmp_path / "routing.json"),
        "--ep-size",
        "4",
        "--global-batch",
        "8",
        "--seq-len",
        "64",
    ]
    code, out, err = _run(capsys, *args, "-o", str(tmp_path / "plan.json"))
    assert code == 0, err
    assert re.search(
        r"dispatch   dedup; MiB/step fwd\+bwd \(512 sampled tokens\): dedup cross-group .* \| "
        r"AutoEP cross-group",
        out,
    ), out
    plan = read_plan(tmp_path / "plan.json")
    assert plan["placement"]["dispatcher"] == "dedup"
    assert [r["group"] for r in plan["ranks"]] == [0, 0, 1, 1]
    q = plan["placement"]["quality"]["dispatch"]
    topo = cpu_topology(["a", "b"], 2, 4 * 2**30)
    pl = placement.Placement(
        "x",
        __import__("numpy").array(plan["placement"]["permutation"]),
        __import__("numpy").arange(4),
        4,
    )
    want = dispatch.dispatch_bytes(
        pl, topo, stats.token_experts, hidden_size=cfg["hidden_size"], bytes_per_elem=4
    )
    scale = 8 * 64 / 512
    for d in ("dedup", "autoep"):
        for tier in dispatch.TIERS:
            assert q[d][f"{tier}BytesPerStep"] == round(want[d][tier] * scale)
    assert 0 < q["dedup"]["crossGroupBytesPerStep"] < q["autoep"]["crossGroupBytesPerStep"]
    code, out, err = _run(capsys, *args, "--dispatcher", "autoep", "-o", str(tmp_path / "p2.json"))
    assert code == 0 and read_plan(tmp_path / "p2.json")["placement"]["dispatcher"] == "autoep"


def test_plan_reports_a_held_out_estimate_above_the_fitted_ratio(capsys, tmp_path):
    from moejob_operator.core.placement import heldout_optimism

    stats = routing.synthetic_trace(
        4, 8, 2, 2048, num_clusters=2, cluster_affinity=1.0, zipf_s=0.0, seed=2
    )
    out, doc = _plan_with(capsys, tmp_path, stats.to_json(), top_k=2)
    q = doc["placement"]["quality"]
    assert q["crossGroupVsContiguous"] < 0.95
    assert q["crossGroupVsContiguousHeldOut"] == pytest.approx(
        min(1.0, q["crossGroupVsContiguous"] * (1 + heldout_optimism(2))), abs=1e-4
    )
    assert f"~{q['crossGroupVsContiguousHeldOut']:.2f}x expected on new tokens" in out


def test_plan_defaults_checkpoint_as_the_crd(capsys, tmp_path):
    """`moectl plan` without --checkpoint-every checkpoints as often as a MoETrainingJob that
    leaves spec.checkpoint.everySteps out (it said 5 while the CRD said 50)."""
    from moejob_operator.spec import Checkpoint

    out_file = tmp_path / "plan.json"
    code, _, err = _run(
        capsys, "plan", "--topology", "single-h200", "--model", "tiny-mixtral", "-o", str(out_file)
    )
    assert code == 0, err
    every = read_plan(out_file)["training"]["checkpointEverySteps"]
    assert every == Checkpoint().every_steps == 50


def test_plan_as_a_module_as_the_gpu_benchmarks_run_it(tmp_path):
    """``python -m moejob_operator.cli plan`` (benchmarks/userflow_gpu.sh, finetune_gpu.py): the
    module's ``__main__`` block runs after every helper its parser uses is defined."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out_file = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(root / p) for p in ("operator",))}
    r = subprocess.run(
        [sys.executable, "-m", "moejob_operator.cli", "plan", "--topology",
         "nvswitch-h200-8@gpu-a", "--model", "mixtral-8x7b", "--replicas", "none",
         "-o", str(out_file)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert read_plan(out_file)["worldSize"] == 8
