"""kopf handlers: the only place with ``@kopf`` decorators. Each one parses its trigger and calls
the :class:`~moejob_operator.controller.Controller` that ``moectl operator`` created and handed to
kopf as the operator's ``memo`` (kopf gives every handler a shallow copy of it, so
``memo.controller`` is the one object); the controller runs level-based passes
(:func:`moejob_operator.reconcile.job.reconcile`) and owns everything that lives between them.

Triggers: the job's watch events (kopf), its worker and discovery pods and the progress ConfigMap
its trainer writes (the controller's child watches: server-side label selectors, not kopf), node
deletions (kopf); plus the controller's own requeue (a pass that says "again in N s") and a
resync of every known job (safety net for missed events).

The job is watched with ``kopf.on.event``, not kopf's create/update/resume handlers and timers:
those keep state on the object (a finalizer, added in its own PATCH and then waiting for the
watch event it causes, and a last-handled-configuration annotation PATCH after every handler
run). The pass needs none of it: it is level-based, its state lives in ``status`` and in the
children (ownerReferences delete them with the job), and a spec change shows as
``metadata.generation != status.observedGeneration``: two PATCHes and one watch round trip fewer
per job.

Run: ``moectl operator`` (``--no-leader-election`` for a single local process).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from . import constants as C
from .controller import Controller


def controller(memo: Any) -> Controller:
    """The controller ``moectl operator`` put in kopf's memo."""
    ctl = getattr(memo, "controller", None)
    if not isinstance(ctl, Controller):
        raise kopf.PermanentError(
            "moejob_operator.handlers needs the controller that `moectl operator` creates "
            "(run the operator with `moectl operator`, not `kopf run`)"
        )
    return ctl


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    ctl = controller(memo)
    settings.posting.enabled = False  # the reconciler posts its own Events
    settings.execution.max_workers = ctl.config.workers  # sync handlers: new jobs' first passes
    # kopf waits this long after an object's event for more events to batch (default 0.1 s):
    # on every pass's path, and the reconciler re-reads the job anyway.
    settings.batching.batch_window = 0.02
    # No handler needs a finalizer any more; naming ours lets kopf remove it from jobs created by
    # an older operator version (which added it for its timer) instead of blocking their deletion.
    settings.persistence.finalizer = C.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=C.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=C.GROUP)
    settings.watching.server_timeout = 300
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    ctl.start()


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_: Any) -> None:
    controller(memo).stop()


def _job_event_wanted(type: str | None, body: kopf.Body, **_: Any) -> bool:
    """The initial listing (None: resume after a restart), a new job, a spec change (generation
    ahead of status.observedGeneration), a deletion. Not the MODIFIED events of the operator's own
    status patches, which leave the generation alone."""
    if type in (None, "ADDED", "DELETED"):
        return True
    meta = body.get("metadata") or {}
    return meta.get("generation") != (body.get("status") or {}).get("observedGeneration")


@kopf.on.event(C.GROUP, C.VERSION, C.PLURAL, when=_job_event_wanted)
def on_job(
    type: str, namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    ctl, namespace = controller(memo), namespace or ""  # a namespaced resource: always set
    if type == "DELETED":
        ctl.job_deleted(namespace, name)
        return
    # a new job's first pass works on the body the watch delivered (one GET fewer on the way to
    # its workers); every other pass reads the job fresh
    ctl.job_seen(namespace, name, body=dict(body) if type == "ADDED" else None)


@kopf.on.event("v1", "nodes", when=lambda type, **_: type == "DELETED")
def on_node_deleted(name: str, memo: kopf.Memo, **_: Any) -> None:
    """A node went away: every job planned on it re-plans or fails now, not at the next resync."""
    controller(memo).node_deleted(name)
