"""docs/architecture.md against the code: the import rules between rooms, the modules its table
names, and the size of the rooms.

Every ``import`` in the product's source (module level or inside a function, relative or
absolute) is read with ``ast``; a rule names what a room may not import, so a new module in a
room is checked without editing this file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "operator"
TRAINER = ROOT / "trainer_image"
DOC = ROOT / "docs" / "architecture.md"

# What the operator image has none of (no torch in it) and what only the dev distribution holds.
HEAVY = ("torch", "deepspeed", "transformers", "pynvml", "moe_trainer")
DEV = ("moe_localkube", "operator_harness", "fake_nvml")
CLUSTER = ("kubernetes", "kopf")
# The rooms of the operator above the reconcile pass (they may import it, never the reverse).
ABOVE_RECONCILE = ("controller", "handlers", "run", "cli", "childwatch", "workqueue")
# The trainer's sub-packages sit below its run and its entry points (which import them, never
# the reverse) and below the upgrade gate's smoke run (gate/).
TRAINER_ABOVE = tuple(
    f"moe_trainer.{m}" for m in ("gate", "train", "trainer", "launch", "export_cli", "prepare_data")
)
# Modules that talk to the API server with the kubernetes client (everything else may at most
# catch its ApiException): the reconcile pass's one client seam, the gate's Job/verdict store,
# the child watches and the Lease.
API_CALLERS = {
    "moejob_operator/reconcile/client.py",
    "moejob_operator/reconcile/gate_store.py",
    "moejob_operator/childwatch.py",
    "moejob_operator/run.py",
}
EXCEPTION_ONLY = {"kubernetes.client.rest", "kubernetes.client.exceptions"}


def imports_of(path: Path, base: Path) -> set[str]:
    """Fully qualified module names ``path`` imports (``from a import b`` gives ``a`` and
    ``a.b``: ``b`` may be a module)."""
    rel = path.relative_to(base).with_suffix("")
    package = list(rel.parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def sources(base: Path, package: str) -> list[Path]:
    return sorted(p for p in (base / package).rglob("*.py") if "__pycache__" not in p.parts)


def _hits(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names for f in forbidden if n == f or n.startswith(f + "."))


def _violations(base: Path, package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for path in sources(base, package):
        hits = _hits(imports_of(path, base), forbidden)
        if hits:
            out[str(path.relative_to(base))] = hits
    return out


def _op(*rooms: str) -> tuple[str, ...]:
    return tuple(f"moejob_operator.{r}" for r in rooms)


RULES = [
    # room, where it lives, what it may not import
    (
        "moejob_operator/core",
        OPERATOR,
        (
            *CLUSTER,
            *HEAVY,
            *DEV,
            *_op(
                "builders", "reconcile", "spec", "status", "metrics", "admission", *ABOVE_RECONCILE
            ),
        ),
    ),
    (
        "moejob_operator/builders",
        OPERATOR,
        (*CLUSTER, *HEAVY, *DEV, *_op("reconcile", "status", "metrics", *ABOVE_RECONCILE)),
    ),
    ("moejob_operator/reconcile", OPERATOR, ("kopf", *HEAVY, *DEV, *_op(*ABOVE_RECONCILE))),
    ("moejob_operator", OPERATOR, (*HEAVY, *DEV)),
    ("moe_contracts", OPERATOR, (*CLUSTER, *HEAVY, *DEV, "moejob_operator")),
    ("moe_trainer", TRAINER, ("kopf", "moejob_operator", *DEV)),
    ("moe_trainer/model", TRAINER, TRAINER_ABOVE),
    ("moe_trainer/dispatch", TRAINER, TRAINER_ABOVE),
    ("moe_trainer/telemetry", TRAINER, TRAINER_ABOVE),
    ("moe_trainer/inputs", TRAINER, TRAINER_ABOVE),
]


@pytest.mark.parametrize(("room", "base", "forbidden"), RULES, ids=[r[0] for r in RULES])
def test_a_room_imports_only_the_rooms_below_it(room, base, forbidden):
    assert _violations(base, room, forbidden) == {}


def test_only_the_client_seams_call_the_api_server():
    callers = set()
    for path in sources(OPERATOR, "moejob_operator"):
        names = imports_of(path, OPERATOR)
        uses = {n for n in names if n == "kubernetes" or n.startswith("kubernetes.")}
        if uses - {n for n in uses if any(n.startswith(e) for e in EXCEPTION_ONLY)}:
            callers.add(str(path.relative_to(OPERATOR)))
    assert callers == API_CALLERS


def test_the_rules_catch_an_upward_import(tmp_path):
    """The checker itself: a core module importing the reconcile pass (relative, inside a
    function) and one importing torch are both reported."""
    room = tmp_path / "moejob_operator" / "core"
    room.mkdir(parents=True)
    (room / "bad.py").write_text("def f():\n    from ..reconcile import client\n")
    (room / "worse.py").write_text("import torch.nn\n")
    (room / "fine.py").write_text("from . import bad\nimport numpy\n")
    found = _violations(tmp_path, "moejob_operator/core", RULES[0][2])
    assert found == {
        "moejob_operator/core/bad.py": [
            "moejob_operator.reconcile",
            "moejob_operator.reconcile.client",
        ],
        "moejob_operator/core/worse.py": ["torch.nn"],
    }


def _table_names(row: str) -> tuple[set[str], set[str]]:
    """What a row of the 'Where the code lives' table gives in backticks in its module cell: all
    bare names (modules, but also functions and values the row mentions) and the ``x.py`` ones."""
    cells = row.split("|")
    toks = [t.strip() for t in re.findall(r"`([^`]+)`", cells[2] if len(cells) > 2 else "")]
    names = {t.removesuffix(".py") for t in toks if re.fullmatch(r"[a-z_][a-z0-9_]*(\.py)?", t)}
    files = {t.removesuffix(".py") for t in toks if re.fullmatch(r"[a-z_][a-z0-9_]*\.py", t)}
    return names, files


@pytest.mark.parametrize(
    ("row_key", "package"),
    [
        ("`reconcile/`", "reconcile"),
        ("`builders/`", "builders"),
        ("`core/placement/`", "core/placement"),
        ("`core/`", "core"),
    ],
)
def test_the_architecture_table_names_every_module_of_a_room(row_key, package):
    row = next(line for line in DOC.read_text().splitlines() if line.startswith(f"| {row_key}"))
    on_disk = {
        p.stem
        for p in (OPERATOR / "moejob_operator" / package).glob("*.py")
        if p.stem != "__init__"
    }
    names, files = _table_names(row)
    assert on_disk - names == set(), "modules the table does not name"
    assert files - on_disk - {"__init__"} == set(), "files the table names that do not exist"


LIMIT = 600


def test_no_product_module_is_over_the_limit_without_a_reason():
    """docs/architecture.md: rooms that fit in a head. A module over LIMIT lines says why in
    its docstring (a line starting ``Size:``)."""
    long = {}
    for base, package in (
        (OPERATOR, "moejob_operator"),
        (OPERATOR, "moe_contracts"),
        (TRAINER, "moe_trainer"),
    ):
        for path in sources(base, package):
            text = path.read_text()
            lines = text.count("\n")
            doc = ast.get_docstring(ast.parse(text)) or ""
            if lines > LIMIT and not re.search(r"^Size:", doc, re.MULTILINE):
                long[str(path.relative_to(base))] = lines
    assert long == {}
