"""Re-placement during a job, the trainer's side of ``moe_contracts.placement_update``.

At every checkpoint boundary, before the checkpoint is written (:meth:`Replanner.at_checkpoint`,
collective): rank 0 reads the PlacementUpdate document (ConfigMap ``$MOE_PLACEMENT_CONFIGMAP``
key ``placement.json``; tests: the file ``$MOE_TEST_PLACEMENT_FILE`` instead) and broadcasts its
decision; a generation above the running one is applied by every rank (``moe_trainer.replace``:
experts, router rows, fp32 masters and Adam states move to their new slots), then the trainer's
own slot-indexed state follows (routing accumulators, the token sample, the permutation the
statistics and the export undo). The document's ``replicas`` (extra expert copies, the plan's
convention) become the dedup dispatcher's copies from then on (:func:`relayout`): copies are not
parameters (the homes' weights reach them every step), so nothing else moves. The checkpoint
written right after holds the tensors in the new slot order and ``trainer_state["placement"]`` =
``{generation, permutation, replicas, appliedAtStep}``, so a resume takes the checkpoint's
permutation and copies over the plan's.

A missing ConfigMap or key, an unreadable or invalid document, and a refused update (copies on a
job that does not run the dedup dispatcher, or an engine that is not ZeRO stage 3) are logged once
and reported in the progress document's ``placement.message``; training goes on either way.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.error
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe_contracts import env as E
from moe_contracts import placement_update as PU
from moe_contracts.errors import DocumentError
from moe_contracts.plan import LayerReplicas
from moe_trainer import kubeapi, replace

log = logging.getLogger("moe_trainer.replan")


def enabled() -> bool:
    """Whether the job takes placement updates (the same env on every rank)."""
    return bool(os.environ.get(E.TEST_PLACEMENT_FILE) or os.environ.get(E.PLACEMENT_CONFIGMAP))


def read_update_text() -> str | None:
    """Rank 0: the PlacementUpdate JSON text, None while there is none."""
    path = os.environ.get(E.TEST_PLACEMENT_FILE)
    if path:  # test hook, marked as such in moe_contracts.env
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            return None
    cm = kubeapi.read_configmap(os.environ[E.PLACEMENT_CONFIGMAP])
    return None if cm is None else (cm.get("data") or {}).get(PU.KEY)


def refusal(plan: Any, engine: Any) -> str | None:
    """Why this job cannot re-place during the run (None: it can)."""
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    if stage != 3:
        return f"re-placement during a job needs ZeRO stage 3 (this job runs stage {stage})"
    return None


Update = tuple[int, list[list[int]], list[LayerReplicas] | None]  # generation, permutation, copies


class Replanner:
    """``replicas``: the copies the job runs (the plan's until a generation brings others)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        refused: str | None,
        router_name: str,
        plan: Any = None,
    ):
        self.enabled = enabled()
        self.L, self.E, self.refused, self.router_name = (
            num_layers,
            num_experts,
            refused,
            router_name,
        )
        pl = None if plan is None else plan.placement
        self.ep_size = 1 if plan is None else int(plan.ep_size)
        self.replicas = None if pl is None or pl.replicas is None else list(pl.replicas)
        self.generation = 0
        self.applied_at_step: int | None = None
        self.seconds: float | None = None
        self.message = ""
        self._logged: set[str] = set()

    def _note(self, message: str) -> None:
        self.message = message
        if message not in self._logged:
            self._logged.add(message)
            log.warning("%s", message)

    def decide(self, serves_copies: bool = True) -> Update | None:
        """Rank 0: (generation, permutation, replicas) to apply now, else None; ``message`` says
        what the latest read found wrong (empty when nothing). ``serves_copies``: the job runs the
        dedup dispatcher, the only one that serves extra copies."""
        self.message = ""
        try:
            text = read_update_text()
        except (OSError, ValueError, urllib.error.URLError) as exc:
            self._note(f"PlacementUpdate not read (keeping generation {self.generation}): {exc}")
            return None
        if not text:
            return None
        try:
            update = PU.loads(text).check(self.L, self.E, ep_size=self.ep_size)
        except DocumentError as exc:
            self._note(f"PlacementUpdate refused (keeping generation {self.generation}): {exc}")
            return None
        if update.generation <= self.generation:
            return None
        if self.refused:
            self._note(f"PlacementUpdate generation {update.generation} refused: {self.refused}")
            return None
        reps = None if update.replicas is None else list(update.replicas)
        if (
            reps is not None
            and not serves_copies
            and any(len(h) > 1 for r in reps for h in r.holders)
        ):
            why = "it has extra expert copies, which only the dedup dispatcher serves"
            self._note(f"PlacementUpdate generation {update.generation} refused: {why}")
            return None
        return update.generation, [list(row) for row in update.permutation], reps

    def at_checkpoint(self, trainer: Any, step: int) -> bool:
        """Collective (every rank, at each checkpoint boundary, before the save): apply a newer
        generation when there is one. True when the placement changed."""
        if not self.enabled:
            return False
        box: list[Any] = [None]
        if trainer.is_rank0:
            try:
                box[0] = self.decide(trainer.dispatcher == "dedup")
                if box[0] is not None and not self._serves(trainer, box[0]):
                    box[0] = None
            except Exception as exc:  # noqa: BLE001 - the other ranks wait in the broadcast
                self._note(f"PlacementUpdate not read (generation {self.generation} kept): {exc}")
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return False
        generation, permutation, replicas = box[0]
        t0 = time.perf_counter()
        summary = replace.apply(
            trainer.engine, trainer.blocks, trainer.permutation, permutation, self.router_name
        )
        switch_state(trainer, permutation)
        self.relayout(trainer, replicas)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the time counts the copies, not their launch
        dist.barrier()
        self.seconds = round(time.perf_counter() - t0, 6)
        if trainer.is_rank0:
            log.info(
                "placement generation %d -> %d applied after step %d in %.3f s (%d layers, "
                "%d tensors, optimizer states %s)",
                self.generation,
                generation,
                step,
                self.seconds,
                summary["layers"],
                summary["tensors"],
                summary["stateKeys"],
            )
        self.generation, self.applied_at_step = generation, step
        return True

    def section(self) -> dict[str, Any] | None:
        """The progress document's ``placement`` (None when the job takes no updates and runs the
        plan's own placement)."""
        if not self.enabled and self.generation == 0:
            return None
        return {
            "generation": self.generation,
            "appliedAtStep": self.applied_at_step,
            "seconds": self.seconds,
            "message": self.message,
        }

    def _serves(self, trainer: Any, update: Update) -> bool:
        """Rank 0, before anything moves: whether the dispatcher can take the update's copies
        (``dedup_replicas.relayouts`` checks every layer's new layout); if not, the update is
        refused and ``message`` says why (moving the experts and then failing would fail again at
        every restart from the checkpoint before)."""
        if trainer.dispatcher != "dedup":
            return True  # decide() refused copies for it; no copies, nothing to lay out
        from moe_trainer.dispatch.dedup_ep import DispatchError
        from moe_trainer.dispatch.dedup_replicas import relayouts

        generation, permutation, replicas = update
        try:
            relayouts(trainer.blocks, replicas, permutation)
        except DispatchError as exc:
            self._note(f"PlacementUpdate generation {generation} refused: {exc}")
            return False
        return True

    def relayout(self, trainer: Any, replicas: list[LayerReplicas] | None) -> None:
        """Collective: the dedup dispatcher's copies follow ``trainer.permutation`` and
        ``replicas`` (None: one copy per expert); a job on another dispatcher has none."""
        self.replicas = replicas
        if trainer.dispatcher == "dedup":
            from moe_trainer.dispatch.dedup_replicas import relayout

            relayout(trainer.blocks, replicas, trainer.permutation)

    def state_dict(self, permutation: list[list[int]]) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "permutation": [list(r) for r in permutation],
            "replicas": None
            if self.replicas is None
            else [{"holders": r.holders, "serve": r.serve} for r in self.replicas],
            "appliedAtStep": self.applied_at_step,
        }

    def load_state_dict(self, trainer: Any, sd: dict[str, Any] | None) -> None:
        """Resume: the checkpoint's tensors are in its permutation's slot order, which wins over
        the plan's (a checkpoint without one ran the plan's), and so do its copies once the job has
        switched (generation above 0: the plan's copies fit the plan's permutation only); before
        that the plan's copies run, so a job re-planned with or without copies resumes with them
        or without."""
        if not sd:
            return
        self.generation, self.applied_at_step = int(sd["generation"]), sd.get("appliedAtStep")
        perm = [list(r) for r in sd["permutation"]]
        if perm != trainer.permutation:
            log.info("rank %d resumes placement generation %d", trainer.env.rank, self.generation)
        trainer.permutation = perm
        trainer.exporter.permutation = perm
        if self.generation > 0 and "replicas" in sd:  # a switch in this job: its copies
            reps = sd["replicas"]
            self.relayout(trainer, None if reps is None else [LayerReplicas(**r) for r in reps])


def switch_state(trainer: Any, permutation: list[list[int]]) -> None:
    """The trainer's slot-indexed state follows a re-placement: routing totals and the token
    sample are relabelled, the permutation (statistics, export) replaced."""
    sources = replace.slot_sources(trainer.permutation, permutation)
    trainer.acc.relabel(sources)
    new_slot_of = []
    for src in sources:
        row = [0] * len(src)
        for new, old in enumerate(src):
            row[old] = new
        new_slot_of.append(row)
    trainer.samples.relabel(new_slot_of)
    trainer.permutation = [list(r) for r in permutation]
    trainer.exporter.permutation = trainer.permutation
