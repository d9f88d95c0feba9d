"""Pure manifest builders: plain dicts in, plain dicts (Kubernetes objects) out.

No API calls, no clocks, no randomness: the same job and plan always give byte-identical
manifests (golden-file tested in tests/golden/). The reconciler creates what these return.
"""
