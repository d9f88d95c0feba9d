"""`moectl smoke`: the command it runs, the readable verdict, exit codes (one real, fast run)."""

from __future__ import annotations

import json

from moejob_operator import cli
from moejob_operator.smoke_cli import format_verdict, smoke_command


def parse(*argv):
    return cli.build_parser().parse_args(["smoke", *argv])


def test_local_command_uses_the_installed_moe_smoke():
    cmd = smoke_command(parse("--cpu", "--inject", "nan", "--expect-deepspeed", "0.19.8"))
    assert cmd[0].endswith("moe-smoke") or cmd[1:3] == ["-m", "moe_trainer.smoke"]
    assert cmd[-7:] == ["--cpu", "--inject", "nan", "--expect-deepspeed", "0.19.8", "--timeout", "600"]


def test_image_command_runs_the_image_with_one_gpu():
    cmd = smoke_command(parse("--image", "reg.io/trainer:1.2"))
    assert cmd[:6] == ["docker", "run", "--rm", "--entrypoint", "moe-smoke", "--ipc=host"]
    assert cmd[6:10] == ["--gpus", "1", "reg.io/trainer:1.2", "--gpu"]
    cpu = smoke_command(parse("--image", "reg.io/trainer:1.2", "--runtime", "podman", "--cpu"))
    assert cpu[0] == "podman" and "--gpus" not in cpu and "--gpu" not in cpu
    assert "--cpu" in cpu[cpu.index("reg.io/trainer:1.2"):]


def test_format_names_the_failed_check_and_the_exception():
    doc = {"kind": "SmokeVerdict", "version": 1, "passed": False, "failedCheck": "train", "worldSize": 2,
           "checks": [{"name": "imports", "passed": True, "seconds": 3.0, "message": "deepspeed 0.19.8"},
                      {"name": "train", "passed": False, "seconds": 1.5, "message": "loss is nan at step 2"}],
           "exception": "Traceback ...\nCheckFailed: loss is nan at step 2", "durationSeconds": 12.0,
           "versions": {"deepspeed": "0.19.8", "torch": "2.13.0", "device": "cpu"}}
    text = format_verdict(doc)
    assert "PASS  imports" in text and "FAIL  train" in text
    assert "FAILED at check 'train' after 12.0s" in text and "CheckFailed: loss is nan" in text
    assert text.splitlines()[0].startswith("smoke test of deepspeed 0.19.8, torch 2.13.0 on cpu (2 rank(s))")


def test_missing_container_runtime_is_a_usage_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))          # no docker on this PATH
    assert cli.main(["smoke", "--image", "reg.io/trainer:1.2"]) == 2
    assert "docker is not installed" in capsys.readouterr().err


def test_real_run_prints_the_verdict_and_exits_1_on_failure(capsys, tmp_path):
    out = tmp_path / "v.json"
    code = cli.main(["smoke", "--cpu", "--nproc", "1", "--expect-deepspeed", "0.99.0", "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    assert "FAIL  imports" in text and "the job declares 0.99.0" in text
    assert json.loads(out.read_text())["failedCheck"] == "imports"
