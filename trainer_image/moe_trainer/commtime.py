"""Time spent in expert all-to-all and ZeRO-3 all-gather, per step.

Wraps the `deepspeed.comm` functions that AutoEP (`all_to_all_single`) and ZeRO-3 parameter
gathering (`allgather_fn`, `all_gather_into_tensor`, `all_gather`) call through the module
attribute at call time. The clock covers the call and, for async calls, the `wait()` on the
returned handle, so on CPU/gloo it is the blocking time; on CUDA it is host-side time (launch +
waits), not kernel time, which under-counts overlapped communication. Nested calls
(allgather_fn -> all_gather_into_tensor) are counted once.
"""

from __future__ import annotations

import functools
import threading
import time

KINDS = {
    "all_to_all_single": "allToAll",
    "all_to_all": "allToAll",
    "allgather_fn": "allGather",
    "all_gather_into_tensor": "allGather",
    "all_gather": "allGather",
}


class _TimedHandle:
    def __init__(self, handle, timer, kind):
        self._handle, self._timer, self._kind = handle, timer, kind

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._handle.wait(*args, **kwargs)
        finally:
            self._timer.add(self._kind, time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._handle, name)


class CommTimer:
    def __init__(self):
        self.seconds = {"allToAll": 0.0, "allGather": 0.0}
        self._local = threading.local()
        self._originals = {}

    def add(self, kind: str, dt: float) -> None:
        self.seconds[kind] += dt

    def take(self) -> dict[str, float]:
        """Seconds per kind since the last take()."""
        out = dict(self.seconds)
        for k in self.seconds:
            self.seconds[k] = 0.0
        return out

    def _wrap(self, fn, kind):
        timer = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if getattr(timer._local, "depth", 0):
                return fn(*args, **kwargs)
            timer._local.depth = 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                timer._local.depth = 0
                timer.add(kind, time.perf_counter() - t0)
            if out is not None and hasattr(out, "wait") and kwargs.get("async_op", False):
                return _TimedHandle(out, timer, kind)
            return out
        return wrapper

    def install(self) -> "CommTimer":
        import deepspeed.comm as dscomm
        for name, kind in KINDS.items():
            fn = getattr(dscomm, name, None)
            if fn is not None and name not in self._originals:
                self._originals[name] = fn
                setattr(dscomm, name, self._wrap(fn, kind))
        return self

    def uninstall(self) -> None:
        import deepspeed.comm as dscomm
        for name, fn in self._originals.items():
            setattr(dscomm, name, fn)
        self._originals = {}
