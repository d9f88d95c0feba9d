"""The model as the plan describes it, ready for ``deepspeed.initialize``: built (fresh and
seeded, or partitioned and loaded from ``model.path``), its MoE blocks swapped to the planned
implementation, activation checkpointing on when planned, experts placed as
``placement.permutation`` says.

Two ways, one result:
* ``model.hfConfig`` only: every rank builds the whole model from the config (seeded, on the
  device it trains on) and permutes each layer's experts and router rows in place;
* ``model.path``: the model is built ZeRO-3 partitioned and empty, and the checkpoint is streamed
  into the partitions with the permutation applied on the way (``moe_trainer.model.pretrained``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from moe_contracts.plan import MoEPlan
from moe_trainer import families
from moe_trainer.model import models


@dataclass
class PreparedModel:
    model: nn.Module
    family: families.Family
    permutation: list[list[int]]  # [layer][slot] = original expert (identity without a plan's)
    originals: list[dict] | None  # original expert tensors, for MOE_VERIFY_PLACEMENT
    load_report: dict[str, Any] | None  # what the pretrained loader read (None: fresh model)


def hf_config_of(plan: MoEPlan) -> dict[str, Any]:
    """The plan's ``hfConfig``, else the ``config.json`` of ``model.path``."""
    if plan.model.hf_config is not None:
        return dict(plan.model.hf_config)
    path = Path(plan.model.path or "") / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise models.ModelError(f"model.path: cannot read {path}: {exc}") from None


def check_content_hash(path: str, planned: str | None) -> None:
    """Refuse a model directory that changed since it was planned (``model.contentHash``)."""
    if planned is None:
        return
    from moe_trainer.inspect_model import content_hash

    now = content_hash(path)
    if now != planned:
        raise models.ModelError(
            f"model.path: {path!r} changed since it was planned (contentHash {now} differs from "
            f"the plan's {planned}); plan the job again"
        )


def prepare(
    plan: MoEPlan,
    ds_config: dict[str, Any],
    rank: int,
    initial_model: Callable[[], nn.Module],
    *,
    restoring: bool = False,
) -> PreparedModel:
    """Build the plan's model and place its experts (before ``deepspeed.initialize``).
    ``restoring``: a DeepSpeed checkpoint will overwrite every weight, so a ``model.path`` model
    is built partitioned and left empty (nothing read from the directory)."""
    from moe_trainer.model import pretrained

    t = plan.training
    fam = families.for_plan(plan.model.family, plan.model.hf_config)
    path = plan.model.path
    if path is not None and not restoring and not os.path.isdir(path):
        raise models.ModelError(
            f"model.path: {path!r} is not a local directory (no hub access at run time)"
        )
    model = pretrained.build_empty(hf_config_of(plan), ds_config) if path else initial_model()
    models.apply_moe_impl(model, t.moe_impl)
    if t.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    num_experts = models.num_experts_of(model)
    n_layers = len(models.find_moe_layers(model))
    pl = plan.placement
    if pl is not None and (pl.num_layers, pl.num_experts) != (n_layers, num_experts):
        raise models.ModelError(
            f"placement: plan says {pl.num_layers} layers x {pl.num_experts} experts, "
            f"the model has {n_layers} x {num_experts}"
        )
    permutation = (
        [list(r) for r in pl.permutation]
        if pl is not None
        else [list(range(num_experts)) for _ in range(n_layers)]
    )
    verify = os.environ.get("MOE_VERIFY_PLACEMENT") == "1"
    if path and restoring:
        return PreparedModel(model, fam, permutation, None, None)
    if path:
        check_content_hash(path, plan.model.content_hash)
        originals = pretrained.original_experts(model, path) if verify else None
        report = pretrained.load(model, path, permutation, rank=rank)
        return PreparedModel(model, fam, permutation, originals, report)
    originals = models.original_expert_tensors(model) if verify else None
    if pl is not None:
        models.permute_experts(model, pl.permutation)
    return PreparedModel(model, fam, permutation, originals, None)
