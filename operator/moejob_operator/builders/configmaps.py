"""The plan ConfigMap (mounted into every worker) and the ConfigMaps the trainer writes to.

The trainer's ServiceAccount may only ``update``/``patch`` named ConfigMaps (RBAC cannot limit
``create`` by name), so the operator seeds the progress and routing-stats ConfigMaps empty. With
``spec.placement.replan`` the operator also writes ``<job>-placement`` (PlacementUpdate), which the
trainer only reads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from moe_contracts import placement_update
from moe_contracts.plan import MoEPlan

from .. import constants as C
from .common import (
    JobRef,
    child_metadata,
    placement_configmap_name,
    plan_configmap_name,
    progress_configmap_name,
    routing_stats_configmap_name,
)


def plan_json(plan: MoEPlan) -> str:
    """The plan as the workers read it: checked complete by the contract, sorted keys (the same
    plan is the same bytes); the plan's own memoised text (the size check serialised it)."""
    return plan.sorted_json()


def plan_configmap(
    job: JobRef, plan: MoEPlan, spec_hash: str, launched_spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``launched_spec``: the immutable spec the plan was made from (``spec.json``), what the job
    keeps running with when someone edits an immutable field after launch."""
    data = {C.PLAN_KEY: plan_json(plan)}
    if launched_spec is not None:
        data[C.LAUNCHED_SPEC_KEY] = json.dumps(launched_spec, sort_keys=True, separators=(",", ":"))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(
            job, plan_configmap_name(job), "plan", annotations={C.ANNOTATION_SPEC_HASH: spec_hash}
        ),
        "data": data,
    }


def progress_configmap(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(job, progress_configmap_name(job), "progress"),
        "data": {},
    }


def routing_stats_configmap(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(job, routing_stats_configmap_name(job), "routing-stats"),
        "data": {},
    }


def placement_configmap(
    job: JobRef, permutation: Sequence[Sequence[int]], replicas: Sequence[Any] | None = None
) -> dict[str, Any]:
    """``<job>-placement`` (``spec.placement.replan``): the PlacementUpdate the trainer reads at
    its checkpoints, seeded with generation 0 = the plan's own permutation and copies."""
    rows = [list(row) for row in permutation]
    update = placement_update.PlacementUpdate(
        generation=0,
        permutation=rows,
        reason="plan",
        replicas=None if replicas is None else tuple(replicas),
    )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(job, placement_configmap_name(job), "placement"),
        "data": {placement_update.KEY: placement_update.dumps(update)},
    }
