"""Does this DeepSpeed have what a plan uses? Checked before any of our layers import it.

A DeepSpeed release that lacks a feature the plan relies on fails far from the cause: a missing
AutoEP surfaces as ``No module named 'deepspeed.module_inject.auto_ep_layer'`` from our own
dispatcher, a dropped ZeRO option as a pydantic error deep inside ``deepspeed.initialize``, an
AutoEP option a release no longer knows not at all (AutoEP's parser ignores unknown keys). This
module names the feature, the plan's setting that needs it and the DeepSpeed version:

- the plan's ``zero_optimization`` options, validated by this DeepSpeed's own ZeRO config model;
- AutoEP (when the plan enables ``expert_parallel``): its modules, the classes and functions the
  trainer and its dispatcher use, the plan's preset among the release's presets, and every key of
  the plan's ``expert_parallel`` among the options its config knows;
- the gathering utilities the trainer and the smoke checks read state through.

Whether AutoEP was then *applied* to every MoE block is checked after ``deepspeed.initialize``
(the smoke test's ``initialize`` check). The trainer runs :func:`check` first thing in
``Trainer.build``; the smoke test runs it as its ``capabilities`` check.
"""

from __future__ import annotations

import importlib
from typing import Any

AUTOEP_NEEDS = {
    "deepspeed.module_inject.auto_ep": ("AutoEP",),
    "deepspeed.module_inject.auto_ep_config": ("AutoEPConfig", "parse_autoep_config"),
    "deepspeed.module_inject.auto_ep_presets.registry": ("available_preset_names",),
    "deepspeed.module_inject.auto_ep_layer": ("AutoEPMoELayer", "RouterOutput"),
}
DEDUP_NEEDS = {
    "deepspeed.module_inject.auto_ep_layer": (
        "permute_by_local_expert",
        "unpermute_by_local_expert",
    ),
}
DEDUP_METHODS = ("_forward", "_finalize_output")  # AutoEPMoELayer methods the dispatcher uses
STATE_NEEDS = {
    "deepspeed.utils": (
        "safe_get_full_fp32_param",
        "safe_get_full_grad",
        "safe_get_full_optimizer_state",
    ),
    "deepspeed.runtime.zero.partition_parameters": ("GatheredParameters",),
}


class MissingFeature(ValueError):
    """This DeepSpeed lacks something the plan needs (the message says what, for what); the
    trainer exits with BadConfig: a rebuilt image, not a retry, fixes it."""


def _missing(needs: dict[str, tuple[str, ...]]) -> list[str]:
    """``module`` (cannot be imported) or ``module.name`` (not in it) for each missing piece."""
    out = []
    for module, names in needs.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            out.append(f"module {module}")
            continue
        out += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    return out


def zero_problems(zero: dict[str, Any]) -> list[str]:
    """The plan's ``zero_optimization`` options this DeepSpeed's ZeRO config model rejects."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as exc:
        return [
            f"zero_optimization.{'.'.join(str(x) for x in e['loc'])} = "
            f"{zero.get(str(e['loc'][0]), '?')!r} ({e['msg']})"
            for e in exc.errors()
        ]
    return []


def autoep_problems(section: dict[str, Any], dispatcher: str) -> list[str]:
    """What AutoEP (and the dedup dispatcher on it) lacks for the plan's ``expert_parallel``."""
    missing = _missing(AUTOEP_NEEDS)
    if missing:
        return [f"it has no AutoEP ({', '.join(missing)} not found)"]
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.module_inject.auto_ep_presets.registry import available_preset_names

    out = []
    known = set(vars(AutoEPConfig()))
    unknown = sorted(k for k in section if k not in known)
    if unknown:
        out.append(f"AutoEP's config has no option(s) {unknown} (it would ignore them)")
    preset = section.get("preset_model")
    if preset and preset not in available_preset_names():
        out.append(f"AutoEP has no preset {preset!r} (it has {list(available_preset_names())})")
    if dispatcher == "dedup":
        gone = _missing(DEDUP_NEEDS) + [
            f"AutoEPMoELayer.{m}" for m in DEDUP_METHODS if not hasattr(AutoEPMoELayer, m)
        ]
        if gone:
            out.append(f"the dedup dispatcher's hooks into AutoEP are missing: {', '.join(gone)}")
    return out


def check(deepspeed_config: dict[str, Any], dispatcher: str | None) -> str:
    """Raises :class:`MissingFeature` naming every missing feature, the plan setting that needs it
    and the DeepSpeed version; returns what was checked."""
    import deepspeed

    version = deepspeed.__version__
    problems = []
    zero = deepspeed_config.get("zero_optimization") or {}
    bad = zero_problems(zero)
    if bad:
        problems.append(f"its ZeRO config rejects the plan's {'; '.join(bad)}")
    ep = deepspeed_config.get("expert_parallel") or {}
    if ep.get("enabled"):
        problems += [
            f"{p}, which the plan uses (expert_parallel enabled: preset "
            f"{ep.get('preset_model')}, autoep_size {ep.get('autoep_size')}; dispatcher "
            f"{dispatcher or 'autoep'})"
            for p in autoep_problems(ep, dispatcher or "autoep")
        ]
    gone = _missing(STATE_NEEDS)
    if gone:
        problems.append(f"the state the trainer gathers is unreachable: {', '.join(gone)}")
    if problems:
        raise MissingFeature(f"deepspeed {version}: " + "; ".join(problems))
    what = [f"ZeRO-{zero.get('stage', '?')} options {sorted(zero)}"]
    if ep.get("enabled"):
        what.append(f"AutoEP preset {ep.get('preset_model')}")
        if dispatcher == "dedup":
            what.append("the dedup dispatcher's AutoEP hooks")
    return f"deepspeed {version} has {', '.join(what)}"
