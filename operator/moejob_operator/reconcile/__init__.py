"""Reconcile: the only code that talks to the Kubernetes API (through :mod:`.client`).

:mod:`.machine` holds the pure decisions (tested without a cluster), :mod:`.job` runs one
level-based pass over a MoETrainingJob, :mod:`.topology`, :mod:`.planning` and :mod:`.gate`
are its stages; a stage that cannot hand on a result raises :class:`.outcome.NotYet` or
:class:`.outcome.Refused`.
"""
