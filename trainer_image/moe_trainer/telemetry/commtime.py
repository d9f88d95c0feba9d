"""Time spent in expert all-to-all and ZeRO-3 all-gather, per step.

Wraps the `deepspeed.comm` functions that AutoEP (`all_to_all_single`) and ZeRO-3 parameter
gathering (`allgather_fn`, `all_gather_into_tensor`, `all_gather`) call through the module
attribute at call time. The clock covers the call and, for async calls, the `wait()` on the
returned handle, so on CPU/gloo it is the blocking time; on CUDA it is host-side time (launch +
waits), not kernel time, which under-counts overlapped communication. Nested calls
(allgather_fn -> all_gather_into_tensor) are counted once.

It also counts the bytes this rank sends to *other* ranks in all-to-alls (`allToAllBytes`): for
`all_to_all_single` with `input_split_sizes` the rows addressed to other ranks times the row size,
without them (equal split) `(P-1)/P` of the input. AutoEP calls it four times per MoE layer and
micro-step (dispatch and combine, forward and backward), so this is the measured counterpart of
the planner's `core.cost.autoep_sends` prediction. With `set_tiers` (NVLink group and node of
every global rank, from the plan) it also splits those bytes by the receiver's tier
(`intraGroup`, `crossGroup`, and `crossNode`, the part of `crossGroup` that leaves the node), for
AutoEP's all-to-alls and the dedup dispatcher's alike (`core.cost.dispatch_bytes` predicts both).
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


TIERS = ("intraGroup", "crossGroup", "crossNode")


def _rows_per_peer(args: tuple, kwargs: dict) -> tuple[list[int], int, object] | None:
    """(rows sent to each rank of the group, bytes per row, group) of an ``all_to_all_single``."""
    import deepspeed.comm as dscomm

    tensor = kwargs.get("tensor", kwargs.get("input", args[1] if len(args) > 1 else None))
    if tensor is None or tensor.dim() == 0 or tensor.shape[0] == 0:
        return None
    splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
    group = kwargs.get("group", args[4] if len(args) > 4 else None)
    row = tensor.element_size() * (tensor.numel() // tensor.shape[0])
    if not splits:
        size = dscomm.get_world_size(group=group)
        splits = [tensor.shape[0] // size] * size
    return list(splits), row, group


def all_to_all_sent_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes an ``all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group)``
    call sends to ranks other than the caller."""
    import deepspeed.comm as dscomm

    got = _rows_per_peer(args, kwargs)
    if got is None:
        return 0
    splits, row, group = got
    me = dscomm.get_rank(group=group)
    return int((sum(splits) - splits[me]) * row)


def all_to_all_tier_bytes(
    args: tuple, kwargs: dict, group_of: list[int], node_of: list[int]
) -> dict[str, int]:
    """The same bytes by tier of the receiver; ``group_of``/``node_of`` are per global rank."""
    import torch.distributed as dist

    out = dict.fromkeys(TIERS, 0)
    got = _rows_per_peer(args, kwargs)
    if got is None:
        return out
    splits, row, group = got
    peers = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    me = dist.get_rank()
    for peer, n in zip(peers, splits, strict=True):
        if peer == me or not n:
            continue
        if group_of[peer] == group_of[me]:
            out["intraGroup"] += n * row
        else:
            out["crossGroup"] += n * row
            if node_of[peer] != node_of[me]:
                out["crossNode"] += n * row
    return out


class CommTimer:
    def __init__(self):
        self.seconds = {"allToAll": 0.0, "allGather": 0.0}
        self.sent_bytes = 0
        self.tier_bytes = dict.fromkeys(TIERS, 0)
        self._tiers: tuple[list[int], list[int]] | None = None
        self._local = threading.local()
        self._originals = {}

    def set_tiers(self, group_of: list[int], node_of: list[int]) -> CommTimer:
        """NVLink group and node of every global rank: count all-to-all bytes by tier too."""
        self._tiers = (list(group_of), list(node_of))
        return self

    def add(self, kind: str, dt: float) -> None:
        self.seconds[kind] += dt

    def take(self) -> dict[str, float]:
        """Seconds per kind, all-to-all bytes sent to other ranks (``allToAllBytes``) and the same
        by
        tier (``allToAllTierBytes``, zeros without `set_tiers`) since the last take()."""
        out = dict(
            self.seconds, allToAllBytes=self.sent_bytes, allToAllTierBytes=dict(self.tier_bytes)
        )
        for k in self.seconds:
            self.seconds[k] = 0.0
        self.sent_bytes = 0
        self.tier_bytes = dict.fromkeys(TIERS, 0)
        return out

    def _wrap(self, fn, kind, name):
        timer = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if getattr(timer._local, "depth", 0):
                return fn(*args, **kwargs)
            timer._local.depth = 1
            if name == "all_to_all_single":
                timer.sent_bytes += all_to_all_sent_bytes(args, kwargs)
                if timer._tiers is not None:
                    for k, v in all_to_all_tier_bytes(args, kwargs, *timer._tiers).items():
                        timer.tier_bytes[k] += v
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

    def install(self) -> CommTimer:
        import deepspeed.comm as dscomm

        for name, kind in KINDS.items():
            fn = getattr(dscomm, name, None)
            if fn is not None and name not in self._originals:
                self._originals[name] = fn
                setattr(dscomm, name, self._wrap(fn, kind, name))
        return self

    def uninstall(self) -> None:
        import deepspeed.comm as dscomm

        for name, fn in self._originals.items():
            setattr(dscomm, name, fn)
        self._originals = {}
