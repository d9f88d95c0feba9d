"""docs/gate.md against the code: the checks it lists are the checks a passing run reports, its
tolerance table is the one the smoke test reads, every simulated fault is documented and tested,
and the step count and clipping threshold it states are the smoke plans'."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from moe_contracts.gate import CHECKS
from moe_trainer.gate.compare import TOLERANCES_FILE
from moejob_operator.core import smoke_plans

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "gate.md").read_text()


def block(name: str) -> str:
    m = re.search(rf"<!-- {name}:.*?-->\n(.*?)<!-- /{name} -->", DOC, re.DOTALL)
    assert m, f"docs/gate.md has no <!-- {name}: ... --> block"
    return m.group(1)


def rows(text: str) -> list[list[str]]:
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells and not set(cells[0]) <= {"-"} and cells[0] not in ("check", "quantity"):
            out.append(cells)
    return out


def test_the_checks_table_is_the_order_of_a_passing_run():
    assert [r[0].strip("`") for r in rows(block("checks"))] == list(CHECKS)


def test_the_tolerance_table_is_the_packaged_one():
    tables = json.loads(TOLERANCES_FILE.read_text())["tables"]
    header = next(
        line for line in block("tolerances").splitlines() if line.startswith("| quantity")
    )
    names = [c.strip() for c in header.strip("|").split("|")][2:]
    assert names == ["cpu-fp32", "cuda-bf16", "cuda-fp16"] and set(names) <= set(tables)
    documented = {r[0].strip("`"): r[2:] for r in rows(block("tolerances"))}
    for name in names:
        assert set(documented) == set(tables[name]["tolerances"]), name
    for key, values in documented.items():
        for name, text in zip(names, values, strict=True):
            assert float(text) == tables[name]["tolerances"][key], (key, name, text)


def test_every_fault_is_documented_and_tested():
    faults_src = (ROOT / "tests" / "smoke_faults" / "sitecustomize.py").read_text()
    patches = re.search(r"^PATCHES = \{(.*?)^\}", faults_src, re.MULTILINE | re.DOTALL).group(1)
    faults = set(re.findall(r'^\s+"([\w-]+)":', patches, re.MULTILINE))
    assert len(faults) >= 9
    table = DOC[DOC.index("| class | fault |") :]
    assert faults <= set(re.findall(r"\| `([\w-]+)`", table))
    tests = ast.parse((ROOT / "tests" / "test_smoke.py").read_text())
    tested = set()
    for node in ast.walk(tests):
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id in ("STEP_FAULTS", "LOAD_FAULTS"):
            assert isinstance(node.value, ast.Dict)
            tested |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    assert tested == faults


def test_steps_and_clipping_are_the_smoke_plans():
    plans = smoke_plans.smoke_plans("cpu")
    training = {c["plan"]["training"]["steps"] for c in plans["cases"]}
    clip = {c["plan"]["training"]["gradClip"] for c in plans["cases"]}
    assert training == {smoke_plans.TRAIN_STEPS} and f"**{smoke_plans.TRAIN_STEPS} steps**" in DOC
    assert f"every optimizer step of the plan ({smoke_plans.TRAIN_STEPS})" in DOC
    assert clip == {0.5} and "**gradient clipping at 0.5**" in DOC
