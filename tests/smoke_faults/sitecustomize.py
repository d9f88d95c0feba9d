"""Test-only fault injection for `moe-smoke`: simulated broken upgrades of DeepSpeed.

Not part of the product: tests put this folder first on PYTHONPATH and name a fault in
SMOKE_FAULT; every Python process then (the smoke run's ranks included) imports this module at
start-up (`site` imports `sitecustomize`), and it patches DeepSpeed the moment DeepSpeed's module
is imported, the way a broken release would behave. Each fault is a gap the upgrade gate must
catch (docs/gate.md, "Fault injection"):

  drop-planner-key   DeepSpeed's ZeRO config no longer knows `stage3_max_reuse_distance`, a key
                     the planner emits (pydantic then rejects it as an extra input)
  zero-expert-grads  AutoEP's expert weights get zero gradients (a broken backward)
  edp-reduction      the expert-data-parallel gradient reduction keeps only rank 0's gradient
  deepseek-routing   the DeepSeek-V3 AutoEP preset scores experts with softmax, not sigmoid
                     (a family-specific break; Mixtral and Qwen3-MoE are unaffected)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

FAULT = os.environ.get("SMOKE_FAULT", "")


def _drop_planner_key(mod) -> None:
    cfg = mod.DeepSpeedZeroConfig
    cfg.model_fields.pop("max_reuse_distance", None)
    cfg.model_rebuild(force=True)


def _zero_expert_grads(mod) -> None:
    import torch

    cls = mod.AutoEPMoELayer
    init = cls.__init__

    def __init__(self, *args, **kwargs):  # noqa: N807 - becomes the patched class's __init__
        init(self, *args, **kwargs)
        for p in self.experts.parameters():
            p.register_hook(lambda g: torch.zeros_like(g))

    cls.__init__ = __init__


def _edp_reduction(mod) -> None:
    import deepspeed.comm as dist

    cls = mod.DeepSpeedZeroOptimizer_Stage3
    name = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
    orig = getattr(cls, name)

    def avg_scatter(self, params, dtype):
        group = self._get_param_partition_group(params[0])
        if (
            self._autoep_expert_parallel_group(params) is not None
            and dist.get_world_size(group) > 1
            and dist.get_rank(group) != 0
        ):
            for p in params:
                p.grad.zero_()
        return orig(self, params, dtype)

    setattr(cls, name, avg_scatter)


def _deepseek_routing(mod) -> None:
    from dataclasses import replace

    mod.PRESET_MODELS["deepseek_v3"] = replace(
        mod.PRESET_MODELS["deepseek_v3"], score_func="softmax"
    )


PATCHES = {
    "drop-planner-key": ("deepspeed.runtime.zero.config", _drop_planner_key),
    "zero-expert-grads": ("deepspeed.module_inject.auto_ep_layer", _zero_expert_grads),
    "edp-reduction": ("deepspeed.runtime.zero.stage3", _edp_reduction),
    "deepseek-routing": ("deepspeed.module_inject.auto_ep_presets.registry", _deepseek_routing),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `target` with the other finders, runs it, then applies the patch."""

    def __init__(self, target: str, patch):
        self.target, self.patch, self.spec = target, patch, None

    def find_spec(self, name, path=None, target=None):
        if name != self.target or self.spec is not None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        self.spec = spec
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


if FAULT:
    if FAULT not in PATCHES:
        raise SystemExit(f"sitecustomize: SMOKE_FAULT={FAULT!r} is not one of {sorted(PATCHES)}")
    sys.meta_path.insert(0, _PatchAfterImport(*PATCHES[FAULT]))
