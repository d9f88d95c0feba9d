"""The planner's speed choices (core/perf.py), the trainer's performance options
(moe_trainer.model.perf): fused LM head + cross-entropy against the reference, plan validation, what
the planner picks on one H200 / two H200s / CPU, and `moe-train` with every option on against the
stock path."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_contracts.plan import PerfSpec, PlanError, parse_perf
from moe_trainer.model import perf
from moejob_operator.core import models as core_models
from moejob_operator.core.errors import DocumentError  # noqa: F401  (import check: core stays importable)
from moejob_operator.core.plan import PlanRequest, build_plan
from moejob_operator.core.topology import load_topology

ROOT = Path(__file__).resolve().parents[1]
TOPO = ROOT / "tests" / "fixtures" / "topology"
PLANS = ROOT / "tests" / "fixtures" / "plans"


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_fused_linear_cross_entropy_matches_reference(chunk):
    g = torch.Generator().manual_seed(chunk)
    n, h, v = 53, 24, 97
    hidden = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = perf.IGNORE_INDEX
    ref = F.cross_entropy(hidden @ weight.T, targets, ignore_index=perf.IGNORE_INDEX)
    ref_h, ref_w = torch.autograd.grad(ref * 3.0, (hidden, weight))
    got = perf.linear_cross_entropy(hidden, weight, targets, chunk)
    got_h, got_w = torch.autograd.grad(got * 3.0, (hidden, weight))
    assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(got_h, ref_h, rtol=1e-9, atol=1e-12)
    assert torch.allclose(got_w, ref_w, rtol=1e-9, atol=1e-12)


def test_fused_loss_head_keeps_state_dict_and_plain_logits():
    from moe_trainer.model.models import TINY_HF_CONFIGS, build_model

    model = build_model(TINY_HF_CONFIGS["tiny-mixtral"], seed=3)
    keys = list(model.state_dict())
    ids = torch.randint(0, 320, (2, 17))
    ref_logits = model(input_ids=ids[:, :-1]).logits
    perf.install_fused_loss(model, chunk=5)
    assert list(model.state_dict()) == keys
    assert torch.equal(model(input_ids=ids[:, :-1]).logits, ref_logits)
    loss = model(input_ids=ids[:, :-1], targets=ids[:, 1:]).loss
    ref = F.cross_entropy(ref_logits.reshape(-1, 320), ids[:, 1:].reshape(-1))
    assert torch.allclose(loss, ref, rtol=1e-5)


def test_parse_perf_rejects_bad_documents():
    assert parse_perf(None) == PerfSpec()
    spec = parse_perf(
        {"fusedLoss": True, "zeroLeafModules": ["MixtralDecoderLayer"], "reasons": ["x"]}
    )
    assert (
        spec.fused_loss
        and spec.zero_leaf_modules == ("MixtralDecoderLayer",)
        and not spec.compile_layers
    )
    for bad, msg in [
        ({"fusedLos": True}, "unknown keys ['fusedLos']"),
        (
            {"compileLayers": "yes"},
            (
                "training.performance.compileLayers: 'yes' is invalid (Input should be a valid "
                "boolean)"
            ),
        ),
        ({"zeroLeafModules": "MixtralDecoderLayer"}, "is not a list of class names"),
        (
            {"lossChunkTokens": 0},
            "lossChunkTokens: 0 is invalid (Input should be greater than or equal to 1)",
        ),
        ([], "expected an object"),
    ]:
        with pytest.raises(PlanError, match=re.escape(msg)):
            parse_perf(bad)


def test_zero_leaf_modules_must_exist():
    from moe_trainer.model.models import TINY_HF_CONFIGS, build_model

    model = build_model(TINY_HF_CONFIGS["tiny-mixtral"], seed=3)
    assert perf.set_zero_leaves(model, ["MixtralDecoderLayer"]) == 2
    with pytest.raises(perf.PerfError, match="Qwen3MoeDecoderLayer"):
        perf.set_zero_leaves(model, ["Qwen3MoeDecoderLayer"])


def _plan(topologies, performance=True, **kw):
    model = core_models.resolve_model(kw.pop("model", "bench-mixtral-3b"))
    reports = [load_topology(str(TOPO / t)) for t in topologies]
    return build_plan(
        PlanRequest(
            "j",
            "default",
            model,
            reports,
            global_batch=kw.pop("global_batch", 8),
            seq_len=2048,
            performance=performance,
            **kw,
        )
    )


def test_planner_picks_the_fast_path_on_one_h200():
    plan = _plan(["h200-vm-1gpu.json"])
    doc, spec = plan.document, core_models.resolve_model("bench-mixtral-3b").spec
    tr, zero = doc["training"], doc["deepspeed"]["zero_optimization"]
    assert tr["moeImpl"] == "grouped" and "expert_parallel" not in doc["deepspeed"]
    p = tr["performance"]
    assert p["fusedOptimizer"] and p["fusedLoss"] and p["compileLayers"]
    assert p["zeroLeafModules"] == ["MixtralDecoderLayer"]
    assert zero["stage"] == 3
    assert zero["stage3_param_persistence_threshold"] > 2 * 16 * 4096 * 2048  # the largest tensor
    assert zero["reduce_bucket_size"] == spec.counts().total
    # fp32 gradient partitions (the optimizer steps on slices of them)
    assert doc["deepspeed"]["data_types"] == {"grad_accum_dtype": "fp32"}
    assert any(r.startswith("data_types.grad_accum_dtype fp32") for r in p["reasons"])
    # the memory model: on one rank the parameters are their partitions (persistent or gathered,
    # no second copy), the gradient partitions are fp32 (+ the 16-bit gradient on its way), the
    # reduce bucket is freed by the hand-off
    br, total = doc["memory"]["breakdown"], spec.counts().total
    assert br["parametersBytes"] == 2 * total and br["gatheredParametersBytes"] == 0
    assert br["gradientsBytes"] == 4 * total + 2 * 2 * 16 * 4096 * 2048
    assert br["buffersBytes"] == 0
    summary = plan.summary()
    assert "MoE impl   grouped; performance options (planner's choice, why):" in summary
    assert "epSize 1 leaves AutoEP nothing to parallelise" in summary
    # the trainer's reader takes it
    from moe_contracts.plan import parse_plan

    assert parse_plan(doc).training.performance.compile_layers


def test_stock_plan_keeps_autoep_and_hf_defaults():
    doc = _plan(["h200-vm-1gpu.json"], performance=False).document
    assert doc["deepspeed"]["expert_parallel"]["enabled"]
    assert "performance" not in doc["training"] and "moeImpl" not in doc["training"]
    assert doc["deepspeed"]["zero_optimization"]["reduce_bucket_size"] == 2048 * 2048


def test_two_gpus_keep_autoep_and_zero3_partitioning():
    doc = _plan(["h200x2-vm-nvswitch.json"], global_batch=16).document
    assert doc["epSize"] == 2 and doc["deepspeed"]["expert_parallel"]["enabled"]
    p = doc["training"]["performance"]
    assert p["fusedLoss"] and p["fusedOptimizer"]
    assert "zeroLeafModules" not in p and "compileLayers" not in p
    assert doc["training"]["moeImpl"] == "hf"
    assert doc["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * 2048


def test_user_overrides_win():
    from moejob_operator.core.plan import TrainingOptions

    doc = _plan(
        ["h200-vm-1gpu.json"],
        ds_overrides={"zero_optimization": {"reduce_bucket_size": 123}},
        training=TrainingOptions(extra={"performance": {"compileLayers": False}}),
    ).document
    assert doc["deepspeed"]["zero_optimization"]["reduce_bucket_size"] == 123
    assert doc["training"]["performance"]["compileLayers"] is False
    assert any("set by the user" in r for r in doc["training"]["performance"]["reasons"])
    kept = _plan(
        ["h200-vm-1gpu.json"], ds_overrides={"data_types": {"grad_accum_dtype": "bf16"}}
    ).document
    assert kept["deepspeed"]["data_types"] == {"grad_accum_dtype": "bf16"}
    assert (
        "data_types.grad_accum_dtype: the user's setting is kept"
        in (kept["training"]["performance"]["reasons"])
    )
    # the memory model follows the user's dtype: 16-bit partitions
    spec = core_models.resolve_model("bench-mixtral-3b").spec
    assert kept["memory"]["breakdown"]["gradientsBytes"] < 3 * spec.counts().total


def test_cpu_plans_have_no_performance_block():
    model = core_models.resolve_model("tiny-mixtral")
    doc = build_plan(
        PlanRequest(
            "j",
            "default",
            model,
            None,
            device="cpu",
            procs_per_node=2,
            cpu_memory_bytes=8 << 30,
            global_batch=4,
            seq_len=64,
        )
    ).document
    assert "performance" not in doc["training"]


@pytest.mark.slow
def test_moe_train_with_every_option_matches_the_stock_path(tmp_path):
    """`moe-train` (one process, ZeRO-3, CPU) with fused loss, ZeRO-3 leaf decoder layers,
    compiled decoder layers (aot_eager on CPU), the one-rank gradient hand-off and the optimizer
    stepping on slices of the (fp32 here) gradient partitions of `fusedOptimizer` (fused AdamW
    itself is GPU-only) trains the same function as without them."""
    from moe_trainer.launch import launch

    base = json.loads((PLANS / "tiny_mixtral_zero3_grouped.json").read_text())
    base["training"].update(moeImpl="hf", steps=3, checkpointEverySteps=10)
    fast = json.loads(json.dumps(base))
    fast["training"]["performance"] = {
        "fusedLoss": True,
        "lossChunkTokens": 50,
        "compileLayers": True,
        "zeroLeafModules": ["MixtralDecoderLayer"],
        "fusedOptimizer": True,
    }
    fast["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] = 10**9
    losses = {}
    for name, doc in (("stock", base), ("fast", fast)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        env = dict(os.environ, MOE_COMPILE_BACKEND="aot_eager")
        codes = launch(
            1,
            [
                "--plan",
                str(tmp_path / f"{name}.json"),
                "--checkpoint-dir",
                str(tmp_path / name),
                "--cpu",
            ],
            env=env,
            timeout=600,
            log_prefix=str(tmp_path / f"log.{name}"),
        )
        log = (tmp_path / f"log.{name}.rank0.log").read_text()
        assert codes == [0], log[-3000:]
        losses[name] = json.loads((tmp_path / name / "losses.json").read_text())["losses"]
    assert (
        "performance options: 2 ZeRO-3 leaf modules (MixtralDecoderLayer); fused LM head + "
        "cross-entropy (50 tokens per chunk); torch.compile of 2 decoder layers" in log
    )
    assert (
        "ZeRO-3 step: gradients straight into their ZeRO-3 partitions (one rank); reduce bucket "
        "freed (unused with the hand-off); fp32 gradients as slices of the gradient partitions "
        "(fp32 accumulation, no copy)" in log
    )
    assert len(losses["fast"]) == 3
    for a, b in zip(losses["stock"], losses["fast"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), losses


def test_moectl_plan_shows_the_choices_and_can_turn_them_off(capsys, tmp_path):
    from moejob_operator import cli

    args = [
        "plan",
        "--topology",
        str(TOPO / "h200-vm-1gpu.json"),
        "--model",
        "bench-mixtral-3b",
        "--global-batch",
        "8",
        "--seq-len",
        "2048",
    ]
    assert cli.main([*args, "-o", str(tmp_path / "fast.json")]) == 0
    out = capsys.readouterr().out
    assert "MoE impl   grouped; performance options (planner's choice, why):" in out
    assert "  - compileLayers: torch.compile of each decoder layer" in out
    assert "  - reduce_bucket_size 3453257728 (all parameters)" in out
    assert "  - fp32 master weights kept: DeepSpeed's bf16 master weights" in out
    assert cli.main([*args, "--no-performance", "-o", str(tmp_path / "stock.json")]) == 0
    assert "MoE impl   hf; performance options off (stock configuration)" in capsys.readouterr().out
    fast, stock = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("fast", "stock"))
    assert fast["training"]["performance"]["fusedLoss"] and "performance" not in stock["training"]


@pytest.mark.slow
def test_fused_loss_under_autoep_two_ranks_matches_the_stock_path(tmp_path):
    """What multi-GPU plans get (AutoEP EP 2, ZeRO-3 partitioned): the fused loss through AutoEP's
    model on two gloo ranks gives the stock path's losses."""
    from moe_trainer.launch import launch

    base = json.loads((PLANS / "tiny_mixtral_autoep.json").read_text())
    base["training"].update(steps=3, checkpointEverySteps=10)
    fast = json.loads(json.dumps(base))
    fast["training"]["performance"] = {
        "fusedLoss": True,
        "lossChunkTokens": 40,
        "fusedOptimizer": True,
    }
    losses = {}
    for name, doc in (("stock", base), ("fast", fast)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        codes = launch(
            2,
            [
                "--plan",
                str(tmp_path / f"{name}.json"),
                "--checkpoint-dir",
                str(tmp_path / name),
                "--cpu",
            ],
            env=dict(os.environ),
            timeout=600,
            log_prefix=str(tmp_path / f"log.{name}"),
        )
        assert codes == [0, 0], (tmp_path / f"log.{name}.rank0.log").read_text()[-3000:]
        losses[name] = json.loads((tmp_path / name / "losses.json").read_text())["losses"]
    assert len(losses["fast"]) == 3
    for a, b in zip(losses["stock"], losses["fast"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), losses


def _zero3_steps(
    mode: str,
    nproc: int,
    accumulation: int = 1,
    clipping: float = 0.05,
    accum_dtype: str = "bf16",
) -> dict:
    """Run tests/zero3_step_worker.py on ``nproc`` ranks (gloo); rank 0's report."""
    from moe_trainer.launch import local_world_envs

    envs = local_world_envs(nproc)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "zero3_step_worker.py"),
                mode,
                str(accumulation),
                str(clipping),
                accum_dtype,
            ],
            env=envs[r],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(nproc)
    ]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


@pytest.mark.parametrize("nproc", [1, 2])
def test_zero3_fused_step_matches_deepspeeds_step(nproc):
    """ZeRO-3 on one and two ranks, bf16 with fp32 masters, torch fused AdamW, clipping that
    triggers every step (several sub-groups): with ``install_zero3_fused_step`` the optimizer
    gets the clipping scale as ``grad_scale`` every step (DeepSpeed's own step hands it nothing
    and multiplies the gradients instead), and the fp32 master weights after the first step equal
    DeepSpeed's own step's to 1e-5. The fp32 norm differs from DeepSpeed's fp64 one in the 7th
    digit, which flips the rounding of a few bf16 weights; from there the two runs drift apart
    like any two runs that differ in rounding, so later steps are compared loosely (a missing or
    doubled clipping scale is off by orders of magnitude)."""
    lean, stock = _zero3_steps("patched", nproc), _zero3_steps("stock", nproc)
    one_rank = ["gradient norm in one multi-tensor pass (one rank)"] if nproc == 1 else []
    assert lean["installed"] == [
        "clipping scale inside fused AdamW",
        "gradient norm in fp32",
        *one_rank,
    ]
    assert stock["installed"] == [] and set(stock["scales"]) == {None}
    groups = lean["subGroups"]
    assert groups >= 2 and len(lean["scales"]) == groups * 4
    for step, norm in enumerate(lean["norms"]):
        assert norm > 0.05  # clipping at 0.05 triggers
        for scale in lean["scales"][groups * step : groups * (step + 1)]:
            assert scale == pytest.approx((norm + 1e-6) / 0.05, rel=1e-5)
    assert lean["norms"][0] == pytest.approx(stock["norms"][0], rel=1e-5)
    assert lean["norms"] == pytest.approx(stock["norms"], rel=1e-3)
    assert lean["masters"][0] == pytest.approx(stock["masters"][0], rel=1e-5, abs=1e-7)
    for got, want in zip(lean["masters"], stock["masters"], strict=True):
        assert got == pytest.approx(want, rel=2e-2, abs=1e-4)
    assert lean["masters"][-1] != pytest.approx(lean["masters"][0], abs=1e-3)  # it trained


def test_zero3_fused_step_hands_no_scale_when_clipping_does_not_trigger():
    """Clipping threshold above every gradient norm: the factor is exactly 1, so the fused AdamW
    gets no ``grad_scale`` (no division, no write-back of the gradients) and the master weights
    are DeepSpeed's own step's bit for bit (its multiply by 1/1 is exact too)."""
    lean, stock = _zero3_steps("patched", 1, clipping=1e6), _zero3_steps("stock", 1, clipping=1e6)
    assert lean["installed"][:2] == ["clipping scale inside fused AdamW", "gradient norm in fp32"]
    assert len(lean["scales"]) == lean["subGroups"] * 4 and set(lean["scales"]) == {None}
    assert lean["masters"] == stock["masters"]
    assert lean["norms"] == pytest.approx(stock["norms"], rel=1e-5)
    assert lean["masters"][-1] != pytest.approx(lean["masters"][0], abs=1e-3)  # it trained


@pytest.mark.parametrize("accumulation", [1, 2])
def test_single_rank_grads_equal_deepspeeds_reduce_path(accumulation):
    """One rank: with ``install_single_rank_grads`` no gradient goes through DeepSpeed's
    bucket / reduce-scatter path (including the leaf module's, reduced by its module hook), and
    training is bit for bit DeepSpeed's own: the same global norms and fp32 master weights after
    every step, with one micro-batch per step (copy) and with two (the second is added)."""
    lean, stock = _zero3_steps("grads", 1, accumulation), _zero3_steps("stock", 1, accumulation)
    assert lean["installed"] == [
        "gradients straight into their ZeRO-3 partitions (one rank)",
        "reduce bucket freed (unused with the hand-off)",
    ]
    assert lean["stockGradPathCalls"] == 0
    assert stock["installed"] == [] and stock["stockGradPathCalls"] == 6 * 4 * accumulation
    assert lean["norms"] == stock["norms"]
    assert lean["masters"] == stock["masters"]
    assert lean["masters"][-1] != pytest.approx(lean["masters"][0], abs=1e-3)  # it trained


def test_single_rank_grads_stay_off_on_two_ranks():
    """Two ranks need the reduction: nothing is installed and DeepSpeed's path runs."""
    two = _zero3_steps("grads", 2)
    assert two["installed"] == [] and two["stockGradPathCalls"] > 0


@pytest.mark.parametrize(
    ("nproc", "accumulation", "accum_dtype"),
    [(1, 1, "bf16"), (1, 2, "fp32"), (2, 1, "bf16"), (2, 2, "fp32")],
)
def test_flat_sub_group_grads_equal_deepspeeds_copies(nproc, accumulation, accum_dtype):
    """``install_flat_sub_group_grads`` hands the optimizer each sub-group's gradient as one slice
    of the gradient partitions (fp32 accumulation) or one cast of it (bf16) instead of DeepSpeed's
    concatenate-and-convert: on one and two ranks, with one and two micro-batches, the global
    norms and fp32 master weights are DeepSpeed's own bit for bit (several sub-groups)."""
    flat = _zero3_steps("flat", nproc, accumulation, accum_dtype=accum_dtype)
    stock = _zero3_steps("stock", nproc, accumulation, accum_dtype=accum_dtype)
    kind = (
        "fp32 gradients as slices of the gradient partitions (fp32 accumulation, no copy)"
        if accum_dtype == "fp32"
        else "fp32 gradients cast from one slice of the bfloat16 gradient partitions (one copy)"
    )
    assert flat["installed"] == [kind] and stock["installed"] == []
    assert (
        flat["accumDtype"]
        == stock["accumDtype"]
        == f"torch.{ {'bf16': 'bfloat16', 'fp32': 'float32'}[accum_dtype] }"
    )
    assert flat["subGroups"] >= 2
    assert flat["stockPrepareCalls"] == 0 and stock["stockPrepareCalls"] == flat["subGroups"] * 4
    assert flat["norms"] == stock["norms"]
    assert flat["masters"] == stock["masters"]
    assert flat["masters"][-1] != pytest.approx(flat["masters"][0], abs=1e-3)  # it trained


def test_fp32_accumulation_with_the_lean_step_trains_as_bf16_accumulation():
    """One rank, one micro-batch per step: a 16-bit gradient is exactly representable in fp32, so
    with everything the trainer installs the fp32-accumulation run (its gradients are slices of
    the partitions) trains bit for bit as the bf16-accumulation run (one cast per sub-group), and
    both as DeepSpeed's own step with fp32 accumulation to the fused step's tolerance."""
    fp32 = _zero3_steps("lean", 1, accum_dtype="fp32")
    bf16 = _zero3_steps("lean", 1, accum_dtype="bf16")
    stock = _zero3_steps("stock", 1, accum_dtype="fp32")
    assert fp32["installed"][-1].startswith("fp32 gradients as slices")
    assert bf16["installed"][-1].startswith("fp32 gradients cast from one slice")
    assert fp32["norms"] == bf16["norms"] and fp32["masters"] == bf16["masters"]
    assert fp32["masters"][0] == pytest.approx(stock["masters"][0], rel=1e-5, abs=1e-7)
    assert fp32["norms"][0] == pytest.approx(stock["norms"][0], rel=1e-5)
