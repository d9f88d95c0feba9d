"""`moe-smoke`: a real CPU run passes on the verified versions; injected faults fail the right check;
verdict merging/compaction and the exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from moe_trainer import smoke
from moejob_operator.core.gate import parse_smoke_verdict


def run_smoke(tmp_path, *args, timeout=400):
    out = tmp_path / "verdict.json"
    term = tmp_path / "termination-log"
    term.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_FAULT")}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "moe_trainer.smoke", "--cpu", "-o", str(out),
                        "--termination-log", str(term), *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    return p, json.loads(p.stdout), json.loads(out.read_text()), term.read_text(), time.monotonic() - t0


@pytest.fixture(scope="module")
def passing(tmp_path_factory):
    return run_smoke(tmp_path_factory.mktemp("smoke-pass"))


@pytest.mark.slow
def test_real_cpu_run_passes_every_check(passing):
    p, stdout_doc, file_doc, term, wall = passing
    assert p.returncode == 0, p.stderr[-3000:]
    assert stdout_doc == file_doc
    v = parse_smoke_verdict(stdout_doc)              # the operator's reader accepts it
    assert v["passed"] and v["failedCheck"] is None and v["exception"] is None
    assert [c["name"] for c in v["checks"]] == list(smoke.CHECKS) and all(c["passed"] for c in v["checks"])
    assert v["versions"]["deepspeed"] == "0.19.8" and v["versions"]["transformers"] == "5.17.0"
    assert v["versions"]["torch"].startswith("2.13") and v["versions"]["device"] == "cpu"
    assert v["worldSize"] == 2
    by = {c["name"]: c["message"] for c in v["checks"]}
    assert "AutoEP (EP size 2)" in by["initialize"] and "AutoEPMoELayer" in by["initialize"]
    assert "as planned" in by["permutation"]
    assert "identical" in by["checkpoint"] and by["fused_adam"].startswith("fallback")
    losses = [float(x) for x in by["train"].split("loss [")[1].rstrip("]").split(", ")]
    assert len(losses) == 6 and losses[-1] < 0.9 * losses[0]
    assert json.loads(term) == stdout_doc            # the termination log holds the (small) verdict
    assert 0 < v["durationSeconds"] <= wall + 1      # how long it takes is the benchmark's business
    print(f"\nmoe-smoke --cpu: {v['durationSeconds']}s (wall {wall:.1f}s); "
          + ", ".join(f"{c['name']} {c['seconds']}s" for c in v["checks"]))


@pytest.mark.slow
def test_native_moe_under_zero3_fails_initialize(tmp_path):
    p, v, _, term, _ = run_smoke(tmp_path, "--inject", "native-moe", "--steps", "3")
    assert p.returncode == 1
    assert v["passed"] is False and v["failedCheck"] == "initialize" and v["injected"] == "native-moe"
    assert [c["name"] for c in v["checks"]] == ["imports", "initialize"]
    assert "Native DeepSpeed MoE is not supported with ZeRO Stage 3" in v["checks"][-1]["message"]
    assert "_validate_zero3_moe_compatibility" in v["exception"]
    assert json.loads(term)["failedCheck"] == "initialize"
    parse_smoke_verdict(v)


@pytest.mark.slow
def test_nan_loss_fails_train(tmp_path):
    p, v, _, _, _ = run_smoke(tmp_path, "--inject", "nan", "--steps", "3")
    assert p.returncode == 1
    assert v["failedCheck"] == "train" and [c["passed"] for c in v["checks"]] == [True, True, True, False]
    assert f"loss is nan at step {smoke.NAN_AT_STEP}" in v["checks"][-1]["message"]


def test_expected_deepspeed_mismatch_fails_imports_without_distributed_setup(tmp_path):
    p, v, _, _, wall = run_smoke(tmp_path, "--expect-deepspeed", "0.99.0", "--nproc", "1", "--steps", "3")
    assert p.returncode == 1 and v["failedCheck"] == "imports"
    assert "the image has deepspeed 0.19.8, the job declares 0.99.0" in v["checks"][0]["message"]


def test_gpu_required_but_absent_fails_imports(tmp_path):
    p = subprocess.run([sys.executable, "-m", "moe_trainer.smoke", "--gpu", "--steps", "3",
                        "--termination-log", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    v = json.loads(p.stdout)
    assert p.returncode == 1 and v["failedCheck"] == "imports"
    assert "no CUDA device is visible" in v["checks"][0]["message"]


def test_usage_errors_exit_2():
    assert smoke.run(["--cpu", "--gpu"]) == smoke.EXIT_USAGE
    assert smoke.run(["--steps", "1"]) == smoke.EXIT_USAGE
    assert smoke.run(["--inject", "segfault"]) == smoke.EXIT_USAGE


# ---- pure pieces ---------------------------------------------------------------------------
def _rank(checks, exception=None):
    return {"checks": [{"name": n, "passed": ok, "seconds": 1.0, "message": m} for n, ok, m in checks],
            "versions": {"deepspeed": "0.19.8"}, "exception": exception}


def test_merge_a_check_passes_only_when_every_rank_passed_it():
    ok = [(n, True, "ok") for n in smoke.CHECKS]
    v = smoke.merge([_rank(ok), _rank(ok)], [0, 0], [[], []], False, 600, 10.0)
    assert v["passed"] and len(v["checks"]) == 6
    r1 = _rank([("imports", True, "ok"), ("initialize", True, "ok"), ("permutation", False, "misplaced")], "Tb\nX")
    v = smoke.merge([_rank(ok[:3]), r1], [1, 1], [[], []], False, 600, 10.0)
    assert not v["passed"] and v["failedCheck"] == "permutation"
    assert v["checks"][-1]["message"] == "rank 1: misplaced" and v["exception"] == "Tb\nX"


def test_merge_a_rank_that_died_names_the_unfinished_check_and_keeps_its_output():
    r0 = _rank([("imports", True, "ok"), ("initialize", True, "ok")])
    v = smoke.merge([r0, None], [-9, 139], [["a"], ["free(): invalid pointer", "Segmentation fault"]], False, 600, 3.0)
    assert v["failedCheck"] == "imports" and "rank 1: did not finish" in v["checks"][0]["message"]
    v = smoke.merge([r0, r0], [139, -9], [["boom"], []], False, 600, 3.0)
    assert v["failedCheck"] == "permutation" and "rank 0 exited with code 139" in v["checks"][-1]["message"]
    assert v["exception"] == "boom"
    v = smoke.merge([r0, r0], [None, None], [[], []], True, 600, 600.0)
    assert "timed out after 600s" in v["checks"][-1]["message"]


def test_compact_fits_the_termination_message_limit():
    big = _rank([("imports", True, "x" * 900), ("initialize", False, "y" * 1000)], "z" * 3000)
    v = smoke.merge([big, big], [1, 1], [[], []], False, 600, 1.0)
    text = smoke.compact(v)
    assert len(text.encode()) <= smoke.TERMINATION_LIMIT
    doc = parse_smoke_verdict(text)
    assert doc["failedCheck"] == "initialize" and doc["checks"][-1]["message"].startswith("rank 0: yyy")
    small = smoke.merge([_rank([(n, True, "ok") for n in smoke.CHECKS])], [0], [[]], False, 600, 1.0)
    assert json.loads(smoke.compact(small)) == small


def test_smoke_plan_is_a_plan_the_trainer_reads_with_every_expert_moved():
    from moe_trainer.plan import parse_plan
    plan = parse_plan(smoke.smoke_plan_doc(2, "cpu", 6))
    assert plan.autoep_enabled and plan.ep_size == 2 and plan.world_size == 2
    for layer, row in enumerate(plan.placement.permutation):
        assert sorted(row) == [0, 1, 2, 3] and all(row[s] != s for s in range(4))
        # every EP rank holds at least one expert that contiguous placement would put elsewhere
        for ep in range(2):
            assert set(plan.placement.experts_of_ep_rank(layer, ep)) != {2 * ep, 2 * ep + 1}
    assert "bf16" in parse_plan(smoke.smoke_plan_doc(1, "cuda", 6)).deepspeed
