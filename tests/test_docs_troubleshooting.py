"""docs/troubleshooting.md has a row for every condition reason the operator can set: the
reasons in constants.py, the upgrade gate's own reasons, a refused model directory's
(core.model_report), and the trainer's health finding types
(which become Healthy=False reasons)."""

from __future__ import annotations

import re
from pathlib import Path

from moejob_operator import constants as C
from moejob_operator.core import gate as core_gate
from moejob_operator.core import model_report

ROOT = Path(__file__).resolve().parents[1]


def documented() -> set[str]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    return set(re.findall(r"^\| `(\w+)` \|", text, re.MULTILINE))


def test_every_reason_has_a_row():
    reasons = {v for k, v in vars(C).items() if k.startswith("R_")}
    reasons |= {v for k, v in vars(core_gate).items() if k.startswith("R_") and isinstance(v, str)}
    reasons |= set(model_report.REASONS)  # a refused model directory
    gate_src = (ROOT / "operator" / "moejob_operator" / "reconcile" / "gate.py").read_text()
    reasons |= set(re.findall(r'^R_\w+ = "(\w+)"', gate_src, re.MULTILINE))
    health_src = (ROOT / "trainer_image" / "moe_trainer" / "telemetry" / "health.py").read_text()
    findings = set(re.findall(r'Finding\(\s*"(\w+)"', health_src))
    assert len(reasons) >= 30 and len(findings) >= 4
    missing = (reasons | findings) - documented()
    assert not missing, f"docs/troubleshooting.md lacks rows for {sorted(missing)}"
