"""The CRD schemas of ``spec.deepspeedOverrides`` and ``spec.model.hfConfig``, generated from
the libraries that read them: DeepSpeed's config models and the Hugging Face config classes of
the model families the planner knows.

Why typed: with ``x-kubernetes-preserve-unknown-fields`` the API server's work on a value grows
about twice per level of nesting (docs/security.md), so a deeply nested object sent by anyone who
may create a MoETrainingJob keeps a core of the API server busy for minutes, before any operator
check can run. A structural schema with explicit depth stops that at the API server: every key
has a type, no subtree is free-form.

What does not fit a structural schema (a key whose type is a union of kinds, such as
``eos_token_id: int | list[int]``, or an untyped ``dict``) is left out: the API server prunes it
(``kubectl`` refuses it as an unknown field); ``spec.deepspeedOverridesJSON`` and
``spec.model.hfConfigJSON`` take the same documents as JSON text with a bounded depth
(``admission.py``).

    python -m moe_localkube.crdgen --write   # rewrite the two blocks in crds/ and the chart
    python -m moe_localkube.crdgen --check   # exit 1 when they differ (tests/test_crd_freeform.py)
"""

from __future__ import annotations

import argparse
import enum
import pathlib
import sys
import types
import typing
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
CRD_FILES = (
    ROOT / "crds" / "moetrainingjob.yaml",
    ROOT / "charts" / "moe-operator" / "crds" / "moetrainingjob.yaml",
)
SKIP = object()  # a type a structural schema cannot hold


def _scalar(t: Any) -> dict[str, Any] | object:
    if t is bool:
        return {"type": "boolean"}
    if t is int:
        return {"type": "integer"}
    if t is float:
        return {"type": "number"}
    if t is str or t is pathlib.Path:
        return {"type": "string"}
    if isinstance(t, type) and issubclass(t, enum.Enum):
        values = [m.value for m in t]
        if all(isinstance(v, str) for v in values):
            return {"type": "string", "enum": values}
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return {"type": "integer", "enum": values}
    return SKIP


def schema_of(t: Any, depth: int = 0) -> dict[str, Any] | object:
    """A structural OpenAPI schema for the Python type ``t``, or ``SKIP``."""
    if depth > 4:
        return SKIP
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return schema_of(args[0], depth)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        nullable = len(kinds) != len(args)
        if str in kinds:  # `str | torch.dtype`: the JSON form is the string
            kinds = [k for k in kinds if not isinstance(k, typing.ForwardRef)]
        if set(kinds) == {int, float}:
            kinds = [float]
        if len(kinds) == 2 and dict in kinds:  # `Model | dict`: the model's keys
            kinds = [k for k in kinds if k is not dict]
        if len(kinds) != 1:
            return SKIP
        out = schema_of(kinds[0], depth)
        return out if out is SKIP or not nullable else {**out, "nullable": True}  # type: ignore[dict-item]
    if origin is typing.Literal:
        if all(isinstance(a, str) for a in args):
            return {"type": "string", "enum": list(args)}
        return SKIP
    if origin in (list, tuple, typing.Sequence):
        items = {a for a in args if a is not Ellipsis}
        if len(items) != 1:
            return SKIP
        inner = schema_of(items.pop(), depth + 1)
        return SKIP if inner is SKIP else {"type": "array", "maxItems": 4096, "items": inner}
    if _is_model(t):
        return _object(_fields(t), depth)
    return _scalar(t)


def _is_model(t: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(t, type) and (
        issubclass(t, BaseModel) or typing.is_typeddict(t)  # type: ignore[arg-type]
    )


def _fields(t: Any) -> dict[str, Any]:
    from pydantic import BaseModel

    if issubclass(t, BaseModel):
        return {(f.alias or k): f.annotation for k, f in t.model_fields.items()}
    return dict(t.__annotations__)


def _object(fields: dict[str, Any], depth: int) -> dict[str, Any]:
    props = {}
    for key, t in sorted(fields.items()):
        s = t if isinstance(t, dict) else schema_of(t, depth + 1)
        if s is not SKIP:
            props[key] = s
    return {"type": "object", "properties": props}


# ---- DeepSpeed --------------------------------------------------------------------------------
# Top-level keys DeepSpeed 0.19.8 reads as scalars (runtime/config.py `get_scalar_param` calls).
_DS_SCALARS: dict[str, Any] = {
    "gradient_clipping": float,
    "steps_per_print": int,
    "wall_clock_breakdown": bool,
    "memory_breakdown": bool,
    "prescale_gradients": bool,
    "gradient_predivide_factor": float,
    "communication_data_type": str | None,
    "seq_parallel_communication_data_type": str,
    "sparse_gradients": bool,
    "zero_allow_untested_optimizer": bool,
    "zero_force_ds_cpu_optimizer": bool,
    "dump_state": bool,
    "disable_allgather": bool,
    "graph_harvesting": bool,
    "dataloader_drop_last": bool,
    "use_data_before_expert_parallelism": bool,
}
_OPTIMIZER_PARAMS: dict[str, Any] = {
    **dict.fromkeys(("lr", "eps", "weight_decay", "momentum", "dampening"), float),
    **dict.fromkeys(("max_coeff", "min_coeff", "max_grad_norm"), float),
    **dict.fromkeys(("bias_correction", "adam_w_mode", "amsgrad", "torch_adam", "nesterov"), bool),
    **dict.fromkeys(("fused", "foreach", "cuda_aware", "set_grad_none"), bool),
    "betas": list[float],
    "freeze_step": int,
    "comm_backend_name": str,
}
_SCHEDULER_PARAMS: dict[str, Any] = {
    **dict.fromkeys(("warmup_min_lr", "warmup_max_lr", "warmup_min_ratio", "cos_min_ratio"), float),
    **dict.fromkeys(
        ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "lr_range_test_min_lr"), float
    ),
    **dict.fromkeys(("lr_range_test_step_rate", "cycle_min_mom", "cycle_max_mom"), float),
    **dict.fromkeys(("warmup_num_steps", "total_num_steps", "last_batch_iteration"), int),
    **dict.fromkeys(("cycle_first_step_size", "cycle_second_step_size", "decay_step_size"), int),
    **dict.fromkeys(("lr_range_test_step_size", "cycle_first_stair_count"), int),
    "warmup_type": str,
    "lr_range_test_staircase": bool,
    "cycle_momentum": bool,
}


# keys whose DeepSpeed default (None) does not say their type
_NONE_DEFAULTS: dict[str, Any] = {"number_checkpoints": int | None, "output_file": str | None}


def _constants(module: Any, prefix: str) -> dict[str, Any]:
    """``{key: type}`` from DeepSpeed's ``PREFIX_X = "key"`` / ``PREFIX_X_DEFAULT`` pairs."""
    out: dict[str, Any] = {}
    for name, key in vars(module).items():
        default_name = f"{name}_DEFAULT"
        if name.startswith(prefix) and isinstance(key, str) and hasattr(module, default_name):
            default = getattr(module, default_name)
            if default is None and key in _NONE_DEFAULTS:
                out[key] = _NONE_DEFAULTS[key]
            elif type(default) in (bool, int, float, str):
                out[key] = type(default)
    return out


def deepspeed_schema() -> dict[str, Any]:
    import deepspeed.profiling.constants as prof
    import deepspeed.runtime.activation_checkpointing.config as act
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    sections: dict[str, Any] = {
        "zero_optimization": DeepSpeedZeroConfig,
        "bf16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "comms_logger": CommsLoggerConfig,
        "tensorboard": TensorBoardConfig,
        "wandb": WandbConfig,
        "csv_monitor": CSVConfig,
        "comet": CometConfig,
        "activation_checkpointing": _object(_constants(act, "ACT_CHKPT_"), 1),
        "flops_profiler": _object(_constants(prof, "FLOPS_PROFILER_"), 1),
        "optimizer": _object({"type": str, "params": _object(_OPTIMIZER_PARAMS, 2)}, 1),
        "scheduler": _object({"type": str, "params": _object(_SCHEDULER_PARAMS, 2)}, 1),
        "data_types": _object({"grad_accum_dtype": str}, 1),
        "checkpoint": _object(
            {
                "tag_validation": str,
                "load_universal": bool,
                "use_node_local_storage": bool,
                "parallel_write": _object({"pipeline_stage": bool}, 2),
            },
            1,
        ),
        **_DS_SCALARS,
        # Keys the plan sets (spec.PROTECTED_DEEPSPEED_KEYS): typed so that a line setting one
        # reaches admission, which refuses it by name; a key the schema lacks would be pruned by
        # the API server without a word.
        **dict.fromkeys(
            ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
            int,
        ),
        "expert_parallel": _object({"enabled": bool, "autoep_size": int, "preset_model": str}, 1),
    }
    out = _object(sections, 0)
    out["maxProperties"] = 64
    _all_nullable(out)
    return out


def _all_nullable(schema: dict[str, Any]) -> None:
    """Every key under deepspeedOverrides may be null: the API server drops a null the schema does
    not allow before anyone sees it, and an explicit null on a key the plan sets is an override the
    operator refuses by name (admission.py) instead of a silently ignored line."""
    for sub in schema.get("properties", {}).values():
        sub["nullable"] = True
        _all_nullable(sub)


# ---- Hugging Face -----------------------------------------------------------------------------
# Keys of config.json files that are not `__init__` arguments of transformers 5's config classes
# but that the classes still read (legacy rope keys, the dtype's old name) or that name the model.
_HF_EXTRA: dict[str, Any] = {
    "model_type": str,
    "rope_theta": float,
    "rope_scaling": None,  # filled with RopeParameters below
    "torch_dtype": str,
    "full_attention_interval": int,  # Qwen3.5 configs before `layer_types`
    # `int | list[int]` in transformers: every config the planner's families ship holds one id;
    # a list goes through hfConfigJSON
    "eos_token_id": int | None,
}


def _merge(a: Any, b: Any) -> Any:
    """One schema for a key two classes type: nullable if either is; SKIP when they disagree."""
    if a is SKIP or b is SKIP:
        return SKIP
    bare = (
        {k: v for k, v in a.items() if k != "nullable"},
        {k: v for k, v in b.items() if k != "nullable"},
    )
    if bare[0] != bare[1]:
        return SKIP
    return {**bare[0], "nullable": True} if a.get("nullable") or b.get("nullable") else bare[0]


def hf_schema() -> dict[str, Any]:
    from transformers.modeling_rope_utils import RopeParameters
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from moejob_operator.core.families import MODEL_TYPES

    merged: dict[str, Any] = {}
    for model_type in MODEL_TYPES:
        cls = CONFIG_MAPPING[model_type]
        for klass in reversed(cls.__mro__):
            init = vars(klass).get("__init__")
            for key, t in (getattr(init, "__annotations__", None) or {}).items():
                if key == "return" or key.startswith("_"):
                    continue
                s = schema_of(t, 1)
                if s is SKIP:
                    continue
                merged[key] = _merge(merged[key], s) if key in merged else s
    merged = {k: v for k, v in merged.items() if v is not SKIP and k != "kwargs"}
    extra = dict(_HF_EXTRA, rope_scaling=RopeParameters)
    for key, t in extra.items():
        merged.setdefault(key, schema_of(t, 1))
    out = _object(merged, 0)
    out["maxProperties"] = 256
    return out


# ---- the CRD files ----------------------------------------------------------------------------
def _block(text: str, key: str, indent: int) -> tuple[int, int]:
    """Line range [start, end) of ``key:`` at ``indent`` spaces and everything indented under it."""
    lines = text.splitlines(keepends=True)
    head = " " * indent + key + ":"
    start = next(i for i, ln in enumerate(lines) if ln.rstrip("\n") == head)
    end = start + 1
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
    ):
        end += 1
    return start, end


def render(key: str, schema: dict[str, Any], description: str, indent: int) -> str:
    body = yaml.safe_dump(
        {key: {**schema, "description": description}}, sort_keys=False, width=1000
    )
    return "".join(" " * indent + ln + "\n" for ln in body.splitlines())


def _description(text: str, key: str, indent: int) -> str:
    start, end = _block(text, key, indent)
    node = yaml.safe_load("".join(ln[indent:] for ln in text.splitlines(True)[start:end]))
    return node[key]["description"]


def updated(text: str) -> str:
    for key, indent, make in (
        ("deepspeedOverrides", 16, deepspeed_schema),
        ("hfConfig", 20, hf_schema),
    ):
        start, end = _block(text, key, indent)
        lines = text.splitlines(keepends=True)
        block = render(key, make(), _description(text, key, indent), indent)
        text = "".join(lines[:start]) + block + "".join(lines[end:])
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    stale = []
    for path in CRD_FILES:
        text = path.read_text()
        new = updated(text)
        if new != text:
            stale.append(path)
            if args.write:
                path.write_text(new)
    for path in stale:
        print(f"{'rewrote' if args.write else 'stale'}: {path.relative_to(ROOT)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
