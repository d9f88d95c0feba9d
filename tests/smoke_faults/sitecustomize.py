"""Test-only fault injection for `moe-smoke`: simulated broken upgrades of DeepSpeed.

Not part of the product: tests put this folder first on PYTHONPATH and name a fault in
SMOKE_FAULT; every Python process then (the smoke run's ranks included) imports this module at
start-up (`site` imports `sitecustomize`), and it patches DeepSpeed (or the trainer module a
broken DeepSpeed would break) the moment that module is imported, the way a broken release would
behave. Each fault is a gap the upgrade gate must catch (docs/gate.md, "Fault injection").

SMOKE_FAULT_STEP=<k> (default 1) starts a fault of a training step at optimizer step k (1-based):
steps before it run correctly, so a check that compares only the first steps misses it.

  capabilities (before any of our layers import DeepSpeed's)
    drop-planner-key   DeepSpeed's ZeRO config no longer knows `stage3_max_reuse_distance`, a key
                       the planner emits (pydantic then rejects it as an extra input)
    no-autoep          a DeepSpeed without AutoEP: its modules are gone and `expert_parallel` is
                       ignored at initialize (the MoE blocks stay Hugging Face blocks)
  initialize
    autoep-not-applied AutoEP is there but `deepspeed.initialize` replaces no MoE block
  numerics (from step k)
    zero-expert-grads  AutoEP's expert weights get zero gradients (a broken backward)
    edp-reduction      the expert-data-parallel gradient reduction keeps only rank 0's gradient
    no-clipping        ZeRO-3 no longer clips gradients (`gradient_clipping` ignored)
  dispatcher (from step k)
    no-dedup           the dedup dispatcher silently falls back to AutoEP's all-to-all, which
                       sends one row per (token, expert): same numbers, more bytes
  resume
    resume-weights-only  loading a checkpoint restores the weights, not the optimizer state or the
                       learning-rate schedule
  permutation
    deepseek-routing   the DeepSeek-V3 AutoEP preset scores experts with softmax, not sigmoid
                       (a family-specific break; Mixtral and Qwen3-MoE are unaffected)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

FAULT = os.environ.get("SMOKE_FAULT", "")
FROM_STEP = int(os.environ.get("SMOKE_FAULT_STEP", "1") or 1)
_STEP = {"now": 0}  # the optimizer step the engine is in (1-based), set at every forward


def active() -> bool:
    return _STEP["now"] >= FROM_STEP


def _track_steps(mod) -> None:
    """DeepSpeedEngine.forward records which optimizer step runs (global_steps + 1; a resumed
    engine continues from its checkpoint's count)."""
    cls = mod.DeepSpeedEngine
    forward = cls.forward

    def tracked(self, *args, **kwargs):
        _STEP["now"] = int(self.global_steps) + 1
        return forward(self, *args, **kwargs)

    cls.forward = tracked


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
            p.register_hook(lambda g: torch.zeros_like(g) if active() else g)

    cls.__init__ = __init__


def _edp_reduction(mod) -> None:
    import deepspeed.comm as dist

    cls = mod.DeepSpeedZeroOptimizer_Stage3
    name = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
    orig = getattr(cls, name)

    def avg_scatter(self, params, dtype):
        group = self._get_param_partition_group(params[0])
        if (
            active()
            and self._autoep_expert_parallel_group(params) is not None
            and dist.get_world_size(group) > 1
            and dist.get_rank(group) != 0
        ):
            for p in params:
                p.grad.zero_()
        return orig(self, params, dtype)

    setattr(cls, name, avg_scatter)


def _no_clipping(mod) -> None:
    cls = mod.DeepSpeedZeroOptimizer_Stage3
    orig = cls.unscale_and_clip_grads

    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        if not active():
            return orig(self, sub_group_id, total_norm)
        saved, self.clip_grad = self.clip_grad, 0.0
        try:
            return orig(self, sub_group_id, total_norm)
        finally:
            self.clip_grad = saved

    cls.unscale_and_clip_grads = unscale_and_clip_grads


def _no_dedup(mod) -> None:
    make = mod._layer_class

    def _layer_class():
        cls = make()
        dedup_forward = cls._forward

        def _forward(self, hidden_states):
            if active():
                return super(cls, self)._forward(hidden_states)
            return dedup_forward(self, hidden_states)

        cls._forward = _forward
        return cls

    mod._layer_class = _layer_class


def _resume_weights_only(mod) -> None:
    cls = mod.DeepSpeedEngine
    load = cls.load_checkpoint

    def load_checkpoint(self, *args, **kwargs):
        kwargs.update(load_optimizer_states=False, load_lr_scheduler_states=False)
        return load(self, *args, **kwargs)

    cls.load_checkpoint = load_checkpoint


_GONE = (
    "deepspeed.module_inject.auto_ep",
    "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.module_inject.auto_ep_config",
    "deepspeed.module_inject.auto_ep_presets",
)


class _NoAutoEP(importlib.abc.MetaPathFinder):
    """A DeepSpeed release without AutoEP: its modules cannot be imported."""

    def find_spec(self, name, path=None, target=None):
        if name in _GONE or name.startswith(tuple(g + "." for g in _GONE)):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return


def _no_autoep(mod) -> None:
    """The engine of a release without AutoEP ignores `expert_parallel`."""
    cls = mod.DeepSpeedEngine
    cls._configure_expert_parallel = lambda self, model, collect_sources=None: None
    for fn in (
        "_remap_client_optimizer_after_module_replacement",
        "_remap_model_parameters_after_module_replacement",
    ):
        setattr(mod, fn, lambda *args, **kwargs: None)


def _autoep_not_applied(mod) -> None:
    from deepspeed.module_inject.auto_ep_layer import ReplacementSourceMap

    mod.DeepSpeedEngine._configure_expert_parallel = lambda self, model, collect_sources=None: (
        ReplacementSourceMap()
    )


def _deepseek_routing(mod) -> None:
    from dataclasses import replace

    mod.PRESET_MODELS["deepseek_v3"] = replace(
        mod.PRESET_MODELS["deepseek_v3"], score_func="softmax"
    )


ENGINE = "deepspeed.runtime.engine"
PATCHES = {
    "drop-planner-key": ("deepspeed.runtime.zero.config", _drop_planner_key),
    "no-autoep": (ENGINE, _no_autoep),
    "autoep-not-applied": (ENGINE, _autoep_not_applied),
    "zero-expert-grads": ("deepspeed.module_inject.auto_ep_layer", _zero_expert_grads),
    "edp-reduction": ("deepspeed.runtime.zero.stage3", _edp_reduction),
    "no-clipping": ("deepspeed.runtime.zero.stage3", _no_clipping),
    "no-dedup": ("moe_trainer.dispatch.dedup_ep", _no_dedup),
    "resume-weights-only": (ENGINE, _resume_weights_only),
    "deepseek-routing": ("deepspeed.module_inject.auto_ep_presets.registry", _deepseek_routing),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `target` with the other finders, runs it, then applies the patches."""

    def __init__(self, target: str, patches):
        self.target, self.patches, self.spec = target, patches, None

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
        for patch in self.patches:
            patch(module)


if FAULT:
    if FAULT not in PATCHES:
        raise SystemExit(f"sitecustomize: SMOKE_FAULT={FAULT!r} is not one of {sorted(PATCHES)}")
    target, patch = PATCHES[FAULT]
    patches = {target: [patch]}
    patches.setdefault(ENGINE, []).insert(0, _track_steps)
    for name, fns in patches.items():
        sys.meta_path.insert(0, _PatchAfterImport(name, fns))
    if FAULT == "no-autoep":
        sys.meta_path.insert(0, _NoAutoEP())
