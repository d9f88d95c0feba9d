"""`moe-smoke` on the planner's smoke plans: a real CPU run passes on the verified versions; each
simulated broken upgrade (tests/smoke_faults) fails the check that names it; verdict merging,
compaction, plans reading and the exit codes."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_contracts import gate as contract_gate
from moe_trainer.gate import main as smoke
from moejob_operator.core import gate as G
from moejob_operator.core.smoke_plans import CPU_CASES, smoke_plans

FAULTS = Path(__file__).resolve().parent / "smoke_faults"
CASES = [c.name for c in CPU_CASES]


@pytest.fixture(scope="module")
def plans_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("smoke-plans") / "plans.json"
    path.write_text(json.dumps(smoke_plans("cpu")))
    return path


def run_smoke(tmp_path, plans_file, *args, fault=None, fault_step=1, timeout=400):
    out = tmp_path / "verdict.json"
    term = tmp_path / "termination-log"
    term.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOE_FAULT", "SMOKE_FAULT"))}
    if fault:
        env.update(
            SMOKE_FAULT=fault,
            SMOKE_FAULT_STEP=str(fault_step),
            PYTHONPATH=os.pathsep.join([str(FAULTS), env.get("PYTHONPATH", "")]),
        )
    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_trainer.gate.main",
            "--cpu",
            "--plans",
            str(plans_file),
            "-o",
            str(out),
            "--termination-log",
            str(term),
            "--workdir",
            str(tmp_path / "work"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return (
        p,
        json.loads(p.stdout),
        json.loads(out.read_text()),
        term.read_text(),
        time.monotonic() - t0,
    )


GOLDEN = {  # the golden values of an earlier image (made up here; the operator keeps real ones)
    "kind": "SmokeGolden",
    "version": 1,
    "goldenKey": "0123456789abcdef",
    "against": {"image": "reg.io/trainer:old", "digest": "sha256:" + "0" * 64, "verifiedAt": "t0"},
    "cases": {
        c: {
            "loss": [5.8, 5.5, 5.3, 5.0, 4.8],
            "gradNorm": [2.2] * 5,
            "update": {"experts": [0.6] * 5},
        }
        for c in CASES
    },
}


@pytest.fixture(scope="module")
def passing(tmp_path_factory, plans_file):
    work = tmp_path_factory.mktemp("smoke-pass")
    golden = work / "golden.json"
    golden.write_text(json.dumps(GOLDEN))
    return run_smoke(work, plans_file, "--golden", str(golden))


@pytest.mark.slow
def test_real_cpu_run_passes_every_check_of_every_family(passing):
    p, stdout_doc, file_doc, term, wall = passing
    assert p.returncode == 0, p.stderr[-3000:]
    assert stdout_doc == file_doc
    v = contract_gate.parse_smoke_verdict(stdout_doc)  # the operator's reader accepts it
    assert (
        v["passed"] and v["failedCheck"] is None and v["exception"] is None and v["cases"] == CASES
    )
    assert [(c["name"], c["case"]) for c in v["checks"]] == contract_gate.expected_checks(CASES)
    assert all(c["passed"] for c in v["checks"])
    assert v["versions"]["deepspeed"] == "0.19.8" and v["versions"]["transformers"] == "5.17.0"
    assert (
        v["versions"]["torch"].startswith("2.13")
        and v["versions"]["device"] == "cpu"
        and v["worldSize"] == 2
    )
    by = {(c["name"], c["case"]): c["message"] for c in v["checks"]}
    assert "EP size 2 of world 2, grad accum 2" in by[("initialize", "mixtral")]
    assert "EP size 1 of world 2" in by[("initialize", "qwen3-moe-edp")]  # expert-data-parallel
    assert "activation checkpointing on" in by[("initialize", "qwen3-moe-edp")]
    # EP > 1: the dedup dispatcher (the planner's default there) runs; EP 1: AutoEP's own layer.
    assert by[("initialize", "qwen3-moe-edp")].endswith("AutoEPMoELayer, dispatcher autoep")
    for case in ("mixtral", "deepseek-v3"):
        assert by[("initialize", case)].endswith("DedupEPMoELayer, dispatcher dedup")
        # the bytes are the plan's byte model's for the tokens routed
        assert "equal to the plan's byte model" in by[("dispatch", case)]
    assert "no all-to-all traffic" in by[("dispatch", "qwen3-moe-edp")]
    for case in CASES:
        assert "AutoEP preset" in by[("capabilities", case)]
        part, total = map(int, by[("partition", case)].split(" tensors")[0].split(" of "))
        assert part / total >= 0.5, by[("partition", case)]  # ZeRO-3 partitions most
        assert "as planned" in by[("permutation", case)]
        numerics = by[("numerics", case)]
        assert numerics.startswith("5 optimizer steps match plain PyTorch"), numerics
        for group in ("router", "experts", "attention", "embeddings"):
            assert group in numerics.split(") gradients")[0]
        # the clipping case: the gradients exceed the threshold at every compared step
        assert "clipping active at 5 of 5 steps" in numerics, numerics
        assert "Adam moments, step count" in by[("resume", case)]
        assert "equal the uninterrupted run's" in by[("resume", case)]
    assert "shared_experts" in by[("numerics", "deepseek-v3")]
    assert "28 expert slots moved" in by[("permutation", "mixtral")]
    assert by[("fused_adam", None)].startswith("fallback")
    # golden values per case and step, for the next image's drift report
    assert set(v["golden"]) == set(CASES)
    assert all(
        len(g["loss"]) == 5 and len(g["update"]["experts"]) == 5 for g in v["golden"].values()
    )
    # ... and their drift from the earlier image's, in the verdict and the numerics messages
    assert v["goldenDrift"]["against"]["image"] == "reg.io/trainer:old"
    for case in CASES:
        drift = v["goldenDrift"]["cases"][case]
        assert 0 < drift["loss"] < 1 and drift["update"] > 0, drift
        assert "drift from the golden values of sha256:0000" in by[("numerics", case)]
    short = contract_gate.parse_smoke_verdict(
        term
    )  # the termination log holds it, compacted to 4 KiB
    assert len(term.encode()) <= smoke.TERMINATION_LIMIT and short["passed"]
    assert [(c["name"], c["case"]) for c in short["checks"]] == contract_gate.expected_checks(CASES)
    assert 0 < v["durationSeconds"] <= wall + 1  # how long it takes is the benchmark's business
    print(
        f"\nmoe-smoke --cpu: {v['durationSeconds']}s (wall {wall:.1f}s, load "
        f"{os.getloadavg()[0]:.1f})"
    )


# One simulated broken upgrade per class of fault the gate must name (tests/smoke_faults), each
# started at optimizer step 1 and at step 3 where it is a fault of a training step: (check, case,
# words the message must hold). Faults of a step run on the first case only (mixtral: the fault
# stops the run there); the rest need the case they break.
STEP_FAULTS = {
    "zero-expert-grads": (
        "numerics",
        "mixtral",
        ["experts: gradient is zero", "the group does not move", "expert gradient zero counts"],
    ),
    "edp-reduction": (
        "numerics",
        "qwen3-moe-edp",
        ["experts: gradient differs from the reference"],
    ),
    "no-clipping": (
        "numerics",
        "mixtral",
        ["gradient clipping", "exceeds gradient_clipping 0.5", "the gradients were not clipped"],
    ),
    "no-dedup": (
        "dispatch",
        "mixtral",
        ["the plan's byte model predicts", "the dispatcher does not de-duplicate"],
    ),
}
LOAD_FAULTS = {
    "resume-weights-only": (
        "resume",
        "mixtral",
        [
            "optimizer step count 1, uninterrupted 6",
            "learning-rate schedule was not restored",
            "Adam first moment (exp_avg)",
            "Adam second moment (exp_avg_sq)",
        ],
    ),
    "drop-planner-key": (
        "capabilities",
        "mixtral",
        ["deepspeed 0.19.8", "zero_optimization.stage3_max_reuse_distance", "Extra inputs"],
    ),
    "no-autoep": (
        "capabilities",
        "mixtral",
        ["deepspeed 0.19.8: it has no AutoEP", "auto_ep_layer", "expert_parallel enabled"],
    ),
    "autoep-not-applied": (
        "initialize",
        "mixtral",
        ["AutoEP was not applied to every MoE block", "MixtralSparseMoeBlock"],
    ),
    "deepseek-routing": (
        "permutation",
        "deepseek-v3",
        ["computes a different function than the plain model"],
    ),
}
FAULT_RUNS = [(f, s) for f in sorted(STEP_FAULTS) for s in (1, 3)] + [
    (f, 1) for f in sorted(LOAD_FAULTS)
]


@pytest.fixture(scope="module")
def first_case_plans(tmp_path_factory):
    """The plans with only the case a fault breaks first: a failing run stops there anyway."""
    out = {}
    for case in CASES:
        path = tmp_path_factory.mktemp(f"plans-{case}") / "plans.json"
        doc = smoke_plans("cpu")
        doc["cases"] = [c for c in doc["cases"] if c["name"] == case]
        path.write_text(json.dumps(doc))
        out[case] = path
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "step"), FAULT_RUNS, ids=[f"{f}@{s}" for f, s in FAULT_RUNS])
def test_each_broken_upgrade_fails_the_gate_naming_the_cause(
    tmp_path, first_case_plans, fault, step
):
    check, case, words = {**STEP_FAULTS, **LOAD_FAULTS}[fault]
    p, v, _, term, _ = run_smoke(tmp_path, first_case_plans[case], fault=fault, fault_step=step)
    assert p.returncode == 1, p.stderr[-2000:]
    assert (v["passed"], v["failedCheck"], v["failedCase"]) == (False, check, case), v["checks"][-1]
    last = v["checks"][-1]
    assert (last["name"], last["case"], last["passed"]) == (check, case, False)
    for w in words:
        assert w in last["message"], last["message"]
    if fault in STEP_FAULTS and check == "numerics":
        assert f"optimizer step {step} of 5" in last["message"], last["message"]
    if fault in STEP_FAULTS and check == "dispatch":
        assert last["message"].startswith(f"rank 0: CheckFailed: step {step}:"), last["message"]
    assert all(c["passed"] for c in v["checks"][:-1])  # the checks before it passed
    rec = G.decide(
        G.identity_for("reg.io/t:1", None, "CPU"),
        None,
        G.SmokeObservation("moe-smoke-k-1", True, 1, term),
        dt.datetime.now(dt.UTC),
        G.GateConfig(),
        cases=[case],
    )
    assert rec.status == "False" and f"check '{check}' of case '{case}' failed" in rec.message


def test_expected_deepspeed_mismatch_fails_imports(tmp_path, plans_file):
    p, v, _, _, _wall = run_smoke(tmp_path, plans_file, "--expect-deepspeed", "0.99.0")
    assert p.returncode == 1 and v["failedCheck"] == "imports" and v["failedCase"] is None
    assert "the image has deepspeed 0.19.8, the job declares 0.99.0" in v["checks"][0]["message"]


def test_gpu_required_but_absent_fails_imports(tmp_path):
    plans = tmp_path / "gpu-plans.json"
    plans.write_text(json.dumps(smoke_plans("cuda")))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_trainer.gate.main",
            "--gpu",
            "--plans",
            str(plans),
            "--termination-log",
            str(tmp_path / "none"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    v = json.loads(p.stdout)
    assert p.returncode == 1 and v["failedCheck"] == "imports"
    assert "no CUDA device is visible" in v["checks"][0]["message"]


def test_usage_errors_exit_2(tmp_path, plans_file, capsys):
    assert smoke.run(["--cpu", "--gpu", "--plans", str(plans_file)]) == smoke.EXIT_USAGE
    assert smoke.run(["--cpu", "--plans", str(tmp_path / "missing.json")]) == smoke.EXIT_USAGE
    assert "cannot read the smoke plans" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    doc = smoke_plans("cpu")
    del doc["cases"][1]["plan"]["deepspeed"]
    bad.write_text(json.dumps(doc))
    assert smoke.run(["--cpu", "--plans", str(bad)]) == smoke.EXIT_USAGE
    assert (
        "cases[1] (qwen3-moe-edp).plan: MoEPlan deepspeed: required field is missing"
        in capsys.readouterr().err
    )
    assert (
        smoke.run(["--gpu", "--plans", str(plans_file)]) == smoke.EXIT_USAGE
    )  # CPU plans, GPU run
    assert smoke.run(["--nproc", "2"]) == smoke.EXIT_USAGE
    bad_golden = tmp_path / "golden.json"
    bad_golden.write_text(json.dumps(dict(GOLDEN, kind="Nope")))
    assert smoke.run(["--cpu", "--plans", str(plans_file), "--golden", str(bad_golden)]) == 2
    assert "SmokeGolden kind: 'Nope'" in capsys.readouterr().err


# ---- pure pieces ---------------------------------------------------------------------------
def _rank(checks, exception=None):
    return {
        "checks": [
            {"name": n, "case": c, "passed": ok, "seconds": 1.0, "message": m}
            for n, c, ok, m in checks
        ],
        "versions": {"deepspeed": "0.19.8"},
        "exception": exception,
    }


EXPECTED = smoke.expected_checks(["a", "b"])


def test_merge_a_check_passes_only_when_every_rank_passed_it():
    ok = [(n, c, True, "ok") for n, c in EXPECTED]
    v = smoke.merge([_rank(ok), _rank(ok)], [0, 0], [[], []], False, 600, 10.0, EXPECTED)
    assert v["passed"] and len(v["checks"]) == len(EXPECTED) and v["cases"] == ["a", "b"]
    r1 = _rank([*ok[:4], ("permutation", "a", False, "misplaced")], "Tb\nX")
    r0 = _rank(
        [
            *ok[:4],
            ("permutation", "a", False, "RuntimeError: Connection closed by peer [127.0.0.1]"),
        ]
    )
    v = smoke.merge([r0, r1], [1, 1], [[], []], False, 600, 10.0, EXPECTED)
    assert not v["passed"] and (v["failedCheck"], v["failedCase"]) == ("permutation", "a")
    # the rank that broke is reported, not the one that lost its peer
    assert v["checks"][-1]["message"] == "rank 1: misplaced" and v["exception"] == "Tb\nX"


def test_merge_a_rank_that_died_names_the_unfinished_check_and_keeps_its_output():
    r0 = _rank(
        [
            ("imports", None, True, "ok"),
            ("capabilities", "a", True, "ok"),
            ("initialize", "a", True, "ok"),
        ]
    )
    v = smoke.merge(
        [r0, None],
        [-9, 139],
        [["a"], ["free(): invalid pointer", "Segmentation fault"]],
        False,
        600,
        3.0,
        EXPECTED,
    )
    assert v["failedCheck"] == "imports" and "rank 1: did not finish" in v["checks"][0]["message"]
    v = smoke.merge([r0, r0], [139, -9], [["boom"], []], False, 600, 3.0, EXPECTED)
    assert (v["failedCheck"], v["failedCase"]) == ("partition", "a")
    assert "rank 0 exited with code 139" in v["checks"][-1]["message"] and v["exception"] == "boom"
    v = smoke.merge([r0, r0], [None, None], [[], []], True, 600, 600.0, EXPECTED)
    assert "timed out after 600s" in v["checks"][-1]["message"]


def test_compact_fits_the_termination_message_limit():
    ok = [(n, c, True, "x" * 300) for n, c in EXPECTED]
    big = _rank([*ok[:5], ("numerics", "a", False, "y" * 1000)], "z" * 3000)
    v = smoke.merge([big, big], [1, 1], [[], []], False, 600, 1.0, EXPECTED)
    text = smoke.compact(v)
    assert len(text.encode()) <= smoke.TERMINATION_LIMIT
    doc = contract_gate.parse_smoke_verdict(text)
    assert doc["failedCheck"] == "numerics" and doc["checks"][-1]["message"].startswith(
        "rank 0: yyy"
    )
    real = smoke.merge(
        [_rank([(n, c, True, "ok " * 40) for n, c in smoke.expected_checks(CASES)])],
        [0],
        [[]],
        False,
        600,
        1.0,
        smoke.expected_checks(CASES),
    )
    assert contract_gate.parse_smoke_verdict(smoke.compact(real))["passed"]
