"""The typed schemas of ``hfConfig`` and ``deepspeedOverrides`` (``moe_localkube.crdgen``): the
CRD holds what the generator makes from the installed transformers and DeepSpeed, every preset's
config and the planner's own DeepSpeed keys fit them without pruning, and the JSON-text forms are
parsed under their bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from moe_localkube import crdgen
from moejob_operator.core import models
from moejob_operator.spec import SpecError, parse_spec
from moejob_operator.spec_json import MAX_JSON_DEPTH

ROOT = Path(__file__).resolve().parents[1]
SPEC = yaml.safe_load((ROOT / "crds" / "moetrainingjob.yaml").read_text())["spec"]["versions"][0][
    "schema"
]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def misfits(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Where ``value`` would be pruned or refused by a structural ``schema`` (none: it fits)."""
    if value is None:
        return [] if schema.get("nullable") else [f"{path}: null"]
    t = schema.get("type")
    kinds = {
        "boolean": (bool,),
        "integer": (int,),
        "number": (int, float),
        "string": (str,),
        "array": (list,),
        "object": (dict,),
    }
    if not isinstance(value, kinds[t]) or (t in ("integer", "number") and value is True):
        return [f"{path}: {type(value).__name__} is not {t}"]
    if t == "array":
        return [m for i, v in enumerate(value) for m in misfits(v, schema["items"], f"{path}[{i}]")]
    if t == "object":
        props = schema.get("properties", {})
        out = [f"{path}.{k}: not in the schema" for k in value if k not in props]
        return out + [m for k, v in value.items() if k in props for m in misfits(v, props[k])]
    return []


def test_the_crd_holds_the_generated_schemas():
    for path in crdgen.CRD_FILES:
        text = path.read_text()
        assert crdgen.updated(text) == text, (
            f"{path.relative_to(ROOT)} is stale: python -m moe_localkube.crdgen --write"
        )


@pytest.mark.parametrize("preset", sorted(models._PRESETS))
def test_every_presets_config_fits_the_hfconfig_schema(preset):
    cfg = models.preset_hf_config(preset)
    assert misfits(cfg, SPEC["model"]["properties"]["hfConfig"], "hfConfig") == []


def test_the_planners_own_deepspeed_keys_fit_the_overrides_schema():
    from moejob_operator.core.dsconfig import CPU, GpuCaps, deepspeed_config

    model = models.spec_from_hf_config(models.preset_hf_config("tiny-mixtral"))
    for gpu in (
        CPU,
        GpuCaps("NVIDIA H200", 141 << 30, "9.0"),
        GpuCaps("NVIDIA V100", 32 << 30, "7.0"),
    ):
        cfg, _ = deepspeed_config(
            model,
            world_size=4,
            ep_size=2,
            global_batch=8,
            gpu=gpu,
            include_optimizer=True,
            warmup_steps=2,
        )
        assert misfits(cfg, SPEC["deepspeedOverrides"], "deepspeedOverrides") == []


def test_every_key_the_plan_protects_reaches_admission_not_pruned():
    """A protected key the schema lacked would be dropped by the API server without a word; in the
    schema (nullable) it reaches admission, which refuses it by name."""
    from moejob_operator.spec import PROTECTED_DEEPSPEED_KEYS

    for path in PROTECTED_DEEPSPEED_KEYS:
        node = SPEC["deepspeedOverrides"]
        for key in path:
            assert key in node.get("properties", {}), f"deepspeedOverrides.{'.'.join(path)}"
            node = node["properties"][key]
        assert node.get("nullable") is True, f"deepspeedOverrides.{'.'.join(path)}"


def test_a_key_two_families_type_differently_is_left_out_and_nullable_merges():
    assert crdgen._merge({"type": "integer"}, {"type": "integer", "nullable": True}) == {
        "type": "integer",
        "nullable": True,
    }
    assert crdgen._merge({"type": "integer"}, {"type": "string"}) is crdgen.SKIP
    assert crdgen.schema_of(int | list[int]) is crdgen.SKIP


def _deep(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = {"k": v}
    return v


def _spec(**extra) -> dict[str, Any]:
    return {"image": "i", "model": {"preset": "tiny-mixtral"}, **extra}


def test_json_text_forms_merge_over_the_objects():
    import json

    spec = parse_spec(
        _spec(
            deepspeedOverrides={"zero_optimization": {"overlap_comm": False}},
            deepspeedOverridesJSON=json.dumps({"zero_optimization": {"reduce_bucket_size": 7}}),
        )
    )
    assert spec.deepspeed_overrides == {
        "zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 7}
    }
    cfg = models.preset_hf_config("tiny-mixtral")
    spec = parse_spec(
        {"image": "i", "model": {"hfConfigJSON": json.dumps({**cfg, "eos_token_id": [2, 3]})}}
    )
    assert spec.model.hf_config == {**cfg, "eos_token_id": [2, 3]}


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"deepspeedOverridesJSON": "[1]"}, "spec.deepspeedOverridesJSON", "JSON object"),
        ({"deepspeedOverridesJSON": "{"}, "spec.deepspeedOverridesJSON", "not JSON"),
        ({"deepspeedOverridesJSON": "[" * 100_000}, "spec.deepspeedOverridesJSON", "characters"),
        ({"deepspeedOverridesJSON": "[" * 60_000}, "spec.deepspeedOverridesJSON", "deeper"),
        (
            {"deepspeedOverridesJSON": '{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * 9},
            "spec.deepspeedOverridesJSON",
            "deeper",
        ),
        (
            {"deepspeedOverrides": {"zero_optimization": _deep(30)}},
            "spec.deepspeedOverrides",
            "deeper",
        ),
        (
            {"deepspeedOverridesJSON": '{"zero_optimization": {"stage": 1}}'},
            "spec.deepspeedOverrides.zero_optimization.stage",
            "plan sets",
        ),
    ],
)
def test_bad_json_text_is_refused_with_its_field(extra, field, words):
    with pytest.raises(SpecError) as err:
        parse_spec(_spec(**extra))
    assert err.value.field == field and words in str(err.value), str(err.value)
