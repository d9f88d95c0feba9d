"""The de-duplicating two-stage expert-parallel dispatcher for AutoEP layers
(docs/dispatch.md): :mod:`.dedup_ep` and its replicated experts, :mod:`.dedup_replicas`."""
