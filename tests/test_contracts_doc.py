"""docs/contracts.md against the contracts package (moe_contracts): each document's heading names
the version the package reads, every field of its model is documented, the required ones in the
document's own JSON example, and the worker pod's environment the doc lists is exactly what the
operator's builder writes, every name one of moe_contracts.env."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from moe_contracts import data, gate, model, plan, progress, routing, topology
from moe_contracts import env as contract_env
from moe_contracts import exit as exit_doc
from moejob_operator.builders import common, workers
from test_builders import _admitted

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "contracts.md").read_text()

# (kind, version the package writes, the model of the document)
DOCUMENTS: list[tuple[str, int, type[BaseModel]]] = [
    ("TopologyReport", 1, topology.TopologyReport),
    ("RoutingStats", max(routing.VERSIONS), routing._Header),
    ("MoEPlan", plan.PLAN_VERSION, plan.MoEPlan),
    ("TrainerProgress", progress.PROGRESS_VERSION, progress.TrainerProgress),
    ("TrainerExit", exit_doc.EXIT_VERSION, exit_doc.TrainerExit),
    ("SmokePlans", gate.SMOKE_PLANS_VERSION, gate.SmokePlans),
    ("SmokeVerdict", gate.SMOKE_VERSION, gate.SmokeVerdict),
    ("SmokeGolden", gate.GOLDEN_VERSION, gate.SmokeGolden),
    ("GateVerdict", gate.VERDICT_VERSION, gate.GateVerdict),
    ("ModelReport", model.MODEL_REPORT_VERSION, model.ModelReport),
    ("DataPrepReport", data.REPORT_VERSION, data.DataPrepReport),
    ("DataManifest", data.MANIFEST_VERSION, data.DataManifest),
]


def section(kind: str) -> str:
    """From the ``## <kind> v<N>`` heading to the next ``## `` heading."""
    m = re.search(rf"^## {kind} v(\d+)\b.*?(?=^## |\Z)", DOC, re.MULTILINE | re.DOTALL)
    assert m, f"docs/contracts.md has no '## {kind} v<N>' section"
    return m.group(0)


def example(kind: str) -> str:
    m = re.search(r"```json\n(.*?)```", section(kind), re.DOTALL)
    assert m, f"the {kind} section has no JSON example"
    return m.group(1)


def fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, bool]]:
    """(dotted camelCase path, required) of a model and the models nested in it."""
    out = []
    for name, info in model.model_fields.items():
        alias = info.alias or name
        out.append((prefix + alias, info.is_required()))
        for sub in _models(info.annotation):
            out += fields(sub, f"{prefix}{alias}.")
    return out


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models(arg)]


@pytest.mark.parametrize(("kind", "version", "model"), DOCUMENTS, ids=[d[0] for d in DOCUMENTS])
def test_document_sections_match_the_package(kind, version, model):
    heading = re.search(rf"^## {kind} v(\d+)", DOC, re.MULTILINE)
    assert heading and int(heading.group(1)) == version, (
        f"docs say {kind} v{heading and heading.group(1)}"
    )
    kind_field = model.model_fields.get("kind")
    assert kind_field is None or kind_field.default == kind
    ex = example(kind)
    undocumented = [
        path
        for path, _ in fields(model)
        if not re.search(rf"[\"`.]{re.escape(path.rsplit('.', 1)[-1])}[\"`]", DOC)
    ]
    assert not undocumented, f"{kind} fields docs/contracts.md does not mention: {undocumented}"
    missing = [
        path
        for path, required in fields(model)
        if required and "." not in path and f'"{path}"' not in ex
    ]
    assert not missing, f"required {kind} fields missing from its JSON example: {missing}"


def test_routing_stats_arrays_and_configmap_keys_are_documented():
    ex = example("RoutingStats")
    for key in ("load", "coactivation", "tokenSamples", "experts"):
        assert f'"{key}"' in ex
    for key in (contract_env.ROUTING_STATS_KEY, contract_env.ROUTING_STATS_GZ_KEY):
        assert f"`{key}`" in DOC or f'["{key}"]' in DOC, key
    assert f"{routing.LIMIT_BYTES:,}" in DOC


def test_worker_environment_is_the_contracts_and_the_docs():
    raw = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    job = common.JobRef(
        namespace="team-a", name="tiny-cpu", uid="0b6f6c2e-6f1d-4f43-9d0e-3f5a1f1a9b11"
    )
    pod = workers.worker_pod(job, _admitted(raw), node_rank=0, node="n", attempt=0, spec_hash="h")
    written = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    paragraph = r"Environment \(the pod's, shared by its ranks\):(.*?)The pod has no"
    m = re.search(paragraph, DOC, re.DOTALL)
    assert m, "docs/contracts.md: the worker pods' Environment paragraph moved"
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)", m.group(1)))
    assert documented == written, (
        f"documented, not written: {sorted(documented - written)}; "
        f"written, not documented: {sorted(written - documented)}"
    )
    names = {v for k, v in vars(contract_env).items() if k.isupper() and isinstance(v, str)}
    assert written <= names, sorted(written - names)
