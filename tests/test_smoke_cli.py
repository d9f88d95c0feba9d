"""`moectl smoke`: the command it runs, the readable verdict, exit codes (one real, fast run)."""

from __future__ import annotations

import json

from moejob_operator import cli
from moejob_operator.smoke_cli import format_verdict, render_plans, smoke_command


def parse(*argv):
    return cli.build_parser().parse_args(["smoke", *argv])


def test_local_command_uses_the_installed_moe_smoke():
    cmd = smoke_command(parse("--cpu", "--expect-deepspeed", "0.19.8"), "/tmp/p.json")
    assert cmd[0].endswith("moe-smoke") or cmd[1:3] == ["-m", "moe_trainer.gate.main"]
    assert cmd[-7:] == [
        "--cpu",
        "--expect-deepspeed",
        "0.19.8",
        "--timeout",
        "600",
        "--plans",
        "/tmp/p.json",
    ]


def test_image_command_runs_the_image_with_one_gpu_and_the_plans_mounted():
    cmd = smoke_command(parse("--image", "reg.io/trainer:1.2"), "/tmp/p.json")
    assert cmd[:8] == [
        "docker",
        "run",
        "--rm",
        "--entrypoint",
        "moe-smoke",
        "--ipc=host",
        "-v",
        "/tmp/p.json:/etc/moe-smoke/plans.json:ro",
    ]
    assert cmd[8:12] == ["--gpus", "1", "reg.io/trainer:1.2", "--gpu"]
    assert cmd[-2:] == ["--plans", "/etc/moe-smoke/plans.json"]
    cpu = smoke_command(
        parse("--image", "reg.io/trainer:1.2", "--runtime", "podman", "--cpu"), "/tmp/p.json"
    )
    assert cpu[0] == "podman" and "--gpus" not in cpu and "--gpu" not in cpu
    assert "--cpu" in cpu[cpu.index("reg.io/trainer:1.2") :]


def test_format_names_the_failed_check_and_the_exception():
    doc = {
        "kind": "SmokeVerdict",
        "version": 3,
        "passed": False,
        "failedCheck": "numerics",
        "failedCase": "mixtral",
        "worldSize": 2,
        "cases": ["mixtral"],
        "checks": [
            {
                "name": "imports",
                "case": None,
                "passed": True,
                "seconds": 3.0,
                "message": "deepspeed 0.19.8",
            },
            {
                "name": "numerics",
                "case": "mixtral",
                "passed": False,
                "seconds": 1.5,
                "message": "loss is nan at step 2",
            },
        ],
        "exception": "Traceback ...\nCheckFailed: loss is nan at step 2",
        "durationSeconds": 12.0,
        "versions": {"deepspeed": "0.19.8", "torch": "2.13.0", "device": "cpu"},
    }
    text = format_verdict(doc)
    assert "PASS  imports" in text and "FAIL  numerics [mixtral]" in text
    assert (
        "FAILED at check 'numerics' of case 'mixtral' after 12.0s" in text
        and "CheckFailed: loss is nan" in text
    )
    assert text.splitlines()[0].startswith(
        "smoke test of deepspeed 0.19.8, torch 2.13.0 on cpu (2 rank(s))"
    )


def test_missing_container_runtime_is_a_usage_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker on this PATH
    assert cli.main(["smoke", "--image", "reg.io/trainer:1.2"]) == 2
    assert "docker is not installed" in capsys.readouterr().err


def test_plans_are_the_planners_for_the_device(tmp_path, capsys):
    cpu = render_plans(parse("--cpu"))
    assert (
        cpu["kind"] == "SmokePlans" and [c["plan"]["device"] for c in cpu["cases"]] == ["cpu"] * 3
    )
    gpu = render_plans(parse("--gpu", "--compute-capability", "7.0"))
    assert all(
        c["plan"]["deepspeed"]["fp16"]["enabled"] for c in gpu["cases"]
    )  # no bf16 before 8.0
    out = tmp_path / "plans.json"
    assert cli.main(["smoke", "--cpu", "--write-plans", str(out)]) == 0
    assert (
        json.loads(out.read_text()) == cpu
        and "wrote 3 smoke plans (cpu)" in capsys.readouterr().out
    )


def test_real_run_prints_the_verdict_and_exits_1_on_failure(capsys, tmp_path):
    out = tmp_path / "v.json"
    code = cli.main(["smoke", "--cpu", "--expect-deepspeed", "0.99.0", "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    assert "FAIL  imports" in text and "the job declares 0.99.0" in text
    assert json.loads(out.read_text())["failedCheck"] == "imports"
