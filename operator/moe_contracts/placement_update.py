"""``PlacementUpdate`` v1: a new expert placement for a running job (re-placement during a job).

The operator writes it into the ConfigMap ``$MOE_PLACEMENT_CONFIGMAP`` (``<job>-placement``, key
``placement.json``; seeded at launch with generation 0 = the plan's own permutation) when fresh
routing statistics predict enough fewer cross-group bytes (``spec.placement.replan``). Rank 0 of
the trainer reads it at checkpoint boundaries; a generation above the one it runs is applied in
place (experts, router rows and their optimizer state move to the new slots), a checkpoint is
written, and the progress document reports ``placement: {generation, appliedAtStep}``.

Trainer side (``moe_trainer.replan``, ``moe_trainer.replace``; docs/placement.md "Re-placement
during a job"): the progress ``placement`` section is
``{generation, appliedAtStep, seconds, message}`` (``moe_contracts.progress.PlacementStatus``):
``message`` says why the latest document was not applied (unreadable, invalid, or refused: the
engine is not ZeRO stage 3, or the job cannot serve the document's copies), and the trainer keeps
its placement. The checkpoint written after a switch records generation and permutation, so a
resumed job keeps running the generation it had (a document of a lower or equal generation is
ignored). The worker pods' Role needs ``get`` on this ConfigMap. The RoutingStats the trainer
publishes at every checkpoint carry an optional ``window`` (the counts since the previous
checkpoint, ``moe_contracts.routing.window_stats``) for drift detection.

``permutation[layer][slot]`` is the original expert id in each slot (the plan's
``placement.permutation`` convention): EP rank ``r`` holds slots ``r * E_local .. (r + 1) *
E_local - 1``. ``replicas`` (optional, the plan's ``placement.replicas`` convention, per layer:
``holders[e]`` home first, ``serve[p][e]``): the extra expert copies of this generation, which
must fit its permutation (a holder list starts at the expert's new home); absent: one copy per
expert. A job whose plan has copies re-places them with the experts; the copies are not
parameters (the homes' weights reach them every step), so a switch moves only the homes.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from ._base import Doc, Float, Int, Str, validate
from .errors import DocumentError, check_kind_version
from .plan import LayerReplicas, check_replicas

DOCUMENT = "PlacementUpdate"
KEY = "placement.json"


class Predicted(Doc):
    """Predicted cross-group bytes per step on the statistics the decision used."""

    cross_group_bytes_before: Float = Field(ge=0)
    cross_group_bytes_after: Float = Field(ge=0)


class PlacementUpdate(Doc):
    kind: Literal["PlacementUpdate"] = "PlacementUpdate"
    version: Literal[1] = 1
    generation: Int = Field(ge=0)
    permutation: list[list[Int]]
    decided_at_step: Int = Field(default=0, ge=0)  # the trainer step of the statistics used
    reason: Str = ""
    predicted: Predicted | None = None
    replicas: tuple[LayerReplicas, ...] | None = None  # per layer; None: one copy per expert

    def check(self, num_layers: int, num_experts: int, *, ep_size: int) -> PlacementUpdate:
        """The permutation fits ``num_layers`` x ``num_experts``, and the copies (if any) fit it
        over ``ep_size`` EP ranks. Raises DocumentError."""
        if len(self.permutation) != num_layers:
            raise DocumentError(
                f"{DOCUMENT} permutation: {len(self.permutation)} layers, the model has "
                f"{num_layers}"
            )
        for layer, row in enumerate(self.permutation):
            if sorted(row) != list(range(num_experts)):
                raise DocumentError(
                    f"{DOCUMENT} permutation[{layer}] is not a permutation of 0..{num_experts - 1}"
                )
        if self.replicas is not None:
            if num_experts % ep_size:
                raise DocumentError(
                    f"{DOCUMENT} replicas: {num_experts} experts over {ep_size} ranks"
                )
            try:
                check_replicas(self.replicas, self.permutation, ep_size, f"{DOCUMENT} replicas")
            except ValueError as exc:
                raise DocumentError(str(exc)) from None
        return self


def parse(obj: Any) -> PlacementUpdate:
    """A decoded JSON object -> :class:`PlacementUpdate` (kind, version, fields checked)."""
    check_kind_version(DOCUMENT, obj)
    return validate(DOCUMENT, PlacementUpdate, obj)


def loads(text: str) -> PlacementUpdate:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise DocumentError(f"{DOCUMENT}: not JSON: {exc}") from None
    return parse(obj)


def dumps(update: PlacementUpdate) -> str:
    return json.dumps(update.model_dump(by_alias=True, exclude_none=True), separators=(",", ":"))
