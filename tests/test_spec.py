"""The MoETrainingJob spec model: parsing, defaults in step with the CRD, errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moejob_operator import constants as C
from moejob_operator.spec import JobSpec, SpecError, changed_immutable_fields, parse_spec

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / "moetrainingjob.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
MINIMAL = {"image": "img", "model": {"preset": "tiny-mixtral"}}


def test_crd_names_match_constants():
    assert CRD["spec"]["group"] == C.GROUP
    assert CRD["spec"]["names"]["kind"] == C.KIND
    assert CRD["spec"]["names"]["plural"] == C.PLURAL
    assert CRD["spec"]["names"]["shortNames"] == list(C.SHORT_NAMES)
    assert CRD["spec"]["versions"][0]["name"] == C.VERSION
    assert CRD["metadata"]["name"] == f"{C.PLURAL}.{C.GROUP}"


FREE_FORM = ("hfConfig", "deepspeedOverrides")


def _walk(schema: dict, model: type, path: str):
    """Every CRD property has a description and a field in the model with the same default."""
    props = schema.get("properties", {})
    fields = {(f.alias or n): f for n, f in model.model_fields.items()}
    assert set(props) == set(fields), f"{path}: CRD {sorted(props)} vs model {sorted(fields)}"
    for name, sub in props.items():
        assert sub.get("description"), f"{path}.{name} has no description"
        field = fields[name]
        if "default" in sub and sub["default"] != {}:
            assert field.default == sub["default"], f"{path}.{name}: default differs"
        if name in FREE_FORM:  # typed from DeepSpeed / transformers (test_crd_freeform.py)
            continue
        if sub.get("type") == "object" and "properties" in sub:
            ann = field.annotation
            inner = next(
                (
                    a
                    for a in getattr(ann, "__args__", (ann,))
                    if isinstance(a, type) and hasattr(a, "model_fields")
                ),
                None,
            )
            assert inner is not None, f"{path}.{name} has no model"
            _walk(sub, inner, f"{path}.{name}")


def test_crd_schema_and_model_agree():
    _walk(SPEC_SCHEMA, JobSpec, "spec")


def test_crd_required_fields_are_required_in_model():
    for name in SPEC_SCHEMA["required"]:
        field = next(f for n, f in JobSpec.model_fields.items() if (f.alias or n) == name)
        assert field.is_required()


@pytest.mark.parametrize(
    "example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_examples_parse(example):
    doc = yaml.safe_load(example.read_text())
    assert doc["kind"] == C.KIND
    spec = parse_spec(doc["spec"])
    if spec.auto_fields:  # the planner chooses: world size and accumulation come from the plan
        assert spec.device == "GPU"
        assert spec.nodes.world_size is None or spec.training.micro_batch == "Auto"
    else:
        assert spec.nodes.world_size >= 1
        assert spec.grad_accum >= 1


def test_defaults_fill_in():
    spec = parse_spec(MINIMAL)
    assert spec.device == "GPU"
    assert spec.placement.strategy == "TopologyAware"
    assert spec.placement.dispatcher is None  # the planner picks (Dedup when EP > 1)
    assert spec.run_policy.backoff_limit == 3
    assert spec.training.lr == pytest.approx(3e-4)
    assert spec.data.kind == "Synthetic"


@pytest.mark.parametrize(
    ("patch", "field", "text"),
    [
        ({"image": 5}, "spec.image", "5 is invalid"),
        ({"model": {}}, "spec.model", "exactly one"),
        ({"model": {"preset": "a", "path": "/x"}}, "spec.model", "exactly one"),
        ({"nodes": {"count": -1}}, "spec.nodes.count", "-1"),
        ({"nodes": {"count": "2"}}, "spec.nodes.count", "'2'"),
        ({"nodes": {"count": 2, "nodeNames": ["a"]}}, "spec.nodes.nodeNames", "count is 2"),
        ({"nodes": {"count": 2, "nodeNames": ["a", "a"]}}, "spec.nodes.nodeNames", "twice"),
        ({"training": {"learningRate": "fast"}}, "spec.training.learningRate", "'fast'"),
        ({"training": {"learningRate": "100"}}, "spec.training.learningRate", "<= 10"),
        ({"training": {"globalBatch": 2, "microBatch": 4}}, "spec.training.microBatch", "larger"),
        (
            {"training": {"globalBatch": 3}, "nodes": {"count": 2}},
            "spec.training.globalBatch",
            "multiple",
        ),
        (
            {
                "placement": {"expertParallelSize": 3},
                "nodes": {"count": 2},
                "training": {"globalBatch": 2},
            },
            "spec.placement.expertParallelSize",
            "does not divide",
        ),
        ({"placement": {"strategy": "contiguous"}}, "spec.placement.strategy", "'contiguous'"),
        ({"placement": {"dispatcher": "dedup"}}, "spec.placement.dispatcher", "'dedup'"),
        ({"placement": {"replan": {}}}, "spec.placement.replan.everySteps", "missing"),
        (
            {"placement": {"replan": {"everySteps": 0}}},
            "spec.placement.replan.everySteps",
            "0 is invalid",
        ),
        (
            {"placement": {"replan": {"everySteps": 5, "minPredictedGainPercent": 101}}},
            "spec.placement.replan.minPredictedGainPercent",
            "101 is invalid",
        ),
        (
            {"placement": {"replan": {"everySteps": 5, "minPredictedGainPercent": 2.5}}},
            "spec.placement.replan.minPredictedGainPercent",
            "2.5 is invalid",
        ),
        ({"gate": {"skip": True}}, "spec.gate.skipReason", "audited"),
        (
            {"deepspeedOverrides": {"zero_optimization": {"stage": 2}}},
            "spec.deepspeedOverrides.zero_optimization.stage",
            "cannot be overridden",
        ),
        ({"data": {"kind": "Text"}}, "spec.data.volume", "Text"),
        ({"data": {"order": "Sequential"}}, "spec.data.order", "Synthetic"),
        ({"data": {"order": "sequential"}}, "spec.data.order", "'sequential'"),
        ({"resources": {"limits": {"memory": "lots"}}}, "spec.resources.limits.memory", "quantity"),
        ({"runPolicy": {"backoffLimit": 1000}}, "spec.runPolicy.backoffLimit", "1000"),
        ({"surprise": 1}, "spec.surprise", "unknown field"),
    ],
)
def test_invalid_specs_name_the_field(patch, field, text):
    with pytest.raises(SpecError, match=text) as info:
        parse_spec({**MINIMAL, **patch})
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_missing_image_and_non_object():
    with pytest.raises(SpecError, match=r"spec.image: required"):
        parse_spec({"model": {"preset": "x"}})
    with pytest.raises(SpecError, match="expected an object"):
        parse_spec(["not", "a", "spec"])


def test_immutable_fields_after_launch():
    spec = parse_spec(MINIMAL)
    launched = spec.immutable_view()
    assert "runPolicy" not in launched and "gate" not in launched
    same = parse_spec({**MINIMAL, "runPolicy": {"suspend": True, "backoffLimit": 9}})
    assert changed_immutable_fields(launched, same) == []
    assert same.immutable_hash() == spec.immutable_hash()
    moved = parse_spec({**MINIMAL, "image": "other", "training": {"steps": 7}})
    assert changed_immutable_fields(launched, moved) == ["image", "training"]
    assert moved.immutable_hash() != spec.immutable_hash()


def test_spec_is_frozen():
    spec = parse_spec(MINIMAL)
    with pytest.raises(Exception, match="frozen"):
        spec.image = "x"  # type: ignore[misc]


def test_replan_defaults_and_leaves_the_hash_of_jobs_without_it():
    spec = parse_spec({**MINIMAL, "placement": {"replan": {"everySteps": 20}}})
    assert spec.placement.replan is not None
    assert (
        spec.placement.replan.every_steps,
        spec.placement.replan.min_predicted_gain_percent,
    ) == (
        20,
        10,
    )
    assert parse_spec(MINIMAL).placement.replan is None
    assert "replan" not in parse_spec(MINIMAL).immutable_view()["placement"]


def test_data_order_reaches_the_plan_only_when_sequential():
    """``spec.data.order`` -> the plan's ``training.data.order`` (absent unless Sequential, so a
    plan of a job without the field is the same bytes as before it existed)."""
    from moejob_operator.reconcile.planning import Inputs, plan_data

    vol = {"hostPath": {"path": "/srv/data"}}
    text = parse_spec({**MINIMAL, "data": {"kind": "Text", "volume": vol}})
    assert plan_data(text, Inputs()) == {"kind": "text", "path": "/data"}
    assert text.data.order is None and "order" not in text.immutable_view()["data"]
    seq = parse_spec({**MINIMAL, "data": {"kind": "Text", "volume": vol, "order": "Sequential"}})
    assert plan_data(seq, Inputs())["order"] == "sequential"
    prepared = Inputs(data={"kind": "prepared", "path": "/cache/k"})
    assert plan_data(seq, prepared) == {
        "kind": "prepared",
        "path": "/cache/k",
        "order": "sequential",
    }
