"""The lint gate CI runs with the suite: `ruff check`, `ruff format --check` and `mypy` are clean.

Configuration in pyproject.toml ([tool.ruff], [tool.mypy]: strict on the whole operator package,
from the planning core to the kopf handlers, the operator process and the command line, on the
contracts package, and on the trainer's boundary with the operator: plan reading, progress
documents, exit codes and the TrainerExit document). Locally: `scripts/dev.sh lint` runs the
same three commands; `ruff check --fix .` and `ruff format .` repair most findings.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECKS = {
    "ruff-check": ["ruff", "check", "--no-fix", "."],
    "ruff-format": ["ruff", "format", "--check", "."],
    "mypy": ["mypy"],
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_clean(name: str) -> None:
    cmd = CHECKS[name]
    r = subprocess.run(
        [sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, f"`{' '.join(cmd)}` is not clean:\n{out[-8000:]}"
