"""A bounded uniform sample of per-token expert sets, across the whole run and all ranks.

Pairwise co-activation counts score top-1/top-2 placements exactly but only bound top-k > 2 from
below (a token is sent once per remote NVLink group holding *any* of its experts, which depends on
the whole set). The planner scores exactly from a sample of whole token expert sets: this module
keeps one, bounded by ``capacity`` tokens, the same tokens in every MoE layer.

Bottom-k (priority) sampling: every routed token gets a random key; the sample is the
``capacity`` tokens with the smallest keys over everything routed so far. Keys are drawn from a
generator seeded by (seed, rank, step, micro step), so a resumed run draws the same keys.
Each rank keeps the bottom-``capacity`` of what it holds; the global bottom-``capacity`` is always
inside the union of the ranks' holdings, so ``merge`` (a collective, at checkpoint time) gathers
the keys, picks the global winners and gathers only their expert sets. After a merge rank r keeps
every W-th winner (``i % W == r``): the holdings stay disjoint and the invariant holds.

A second pool, ``window``, keeps the bottom-``capacity`` of the same keys over the tokens routed
since the previous RoutingStats publish only (:meth:`TokenSampler.take_window` merges it the same
way and empties it): the document's ``window`` carries its own uniform sample. A window cut out of
the whole-run sample would hold about ``capacity x window / run`` tokens, too few late in a long
run for the re-placement decision, which reads the window. Every checkpoint publishes just before
it saves the state (``Trainer.save``; without a checkpoint dir there is no resume), so a
checkpoint's window pool is always empty, a resume starts it empty, and it has no checkpoint state.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class TokenSampler:
    """keys[n] float64, experts[n, L, k] int16 (slot ids), steps[n] int32 (the step, 1-based)."""

    def __init__(
        self,
        num_layers: int,
        top_k: int,
        capacity: int,
        seed: int,
        rank: int,
        world: int,
        window: bool = True,
    ):
        self.L, self.k, self.capacity = num_layers, top_k, int(capacity)
        self.seed, self.rank, self.world = int(seed), int(rank), int(world)
        self.keys = torch.empty(0, dtype=torch.float64)
        self.experts = torch.empty(0, num_layers, top_k, dtype=torch.int16)
        self.steps = torch.empty(0, dtype=torch.int32)
        # CUDA: (keys, experts [pinned, copy in flight], steps, event) not yet folded in; the
        # forward's expert ids reach the host without the host waiting for the forward
        self._pending: list[tuple] = []
        # candidates not yet folded into the holding: a full pool's keys at or above ``_thr``
        # (its largest kept key at the last fold: an upper bound of it ever after) never enter;
        # the rest wait here until they are ``capacity`` many, so a micro step copies and selects
        # only its candidates, not the whole holding (every pool its own)
        self._chunks: list[tuple] = []
        self._chunked = 0
        self._thr = math.inf
        # the tokens since the last take_window, fed by this sampler's add (never its own)
        self.window = self._empty_pool() if window else None

    def _empty_pool(self) -> TokenSampler:
        return TokenSampler(self.L, self.k, self.capacity, self.seed, self.rank, self.world, False)

    def _pools(self) -> list[TokenSampler]:
        return [self] if self.window is None else [self, self.window]

    def __len__(self) -> int:
        self._settle(wait=True)
        return len(self.keys)

    def _settle(self, wait: bool) -> None:
        """Fold in the pending expert sets whose copies are done; with ``wait``, every one, and
        every pool's holding is then exactly its bottom-``capacity``."""
        while self._pending:
            keys, ex, steps, event = self._pending[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._pending.pop(0)
            for pool in self._pools():
                pool._offer(keys, ex, steps)
        if wait:
            for pool in self._pools():
                pool._compact()

    def _offer(self, keys, experts, steps) -> None:
        """Candidate tokens for this pool (see ``_chunks``)."""
        if self.capacity <= 0:
            return
        if self._thr < math.inf:
            sel = torch.nonzero(keys < self._thr).flatten()
            if not len(sel):
                return
            keys, experts, steps = keys[sel], experts[sel], steps[sel]
        self._chunks.append((keys, experts, steps))
        self._chunked += len(keys)
        if self._chunked >= self.capacity:
            self._compact()

    def _compact(self) -> None:
        if not self._chunks:
            return
        parts = [(self.keys, self.experts, self.steps), *self._chunks]
        self._chunks, self._chunked = [], 0
        self._keep(*(torch.cat(list(col)) for col in zip(*parts, strict=True)))

    def add(self, topk: list[torch.Tensor], step: int, micro: int) -> None:
        """``topk[L]`` of ``[T, k]`` expert (slot) ids of one forward pass at 1-based ``step``."""
        if self.capacity <= 0 or not topk:
            return
        self._settle(wait=False)
        T = topk[0].shape[0]
        g = torch.Generator().manual_seed(
            hash((self.seed, self.rank, step, micro)) & 0x7FFF_FFFF_FFFF_FFFF
        )
        keys = torch.rand(T, generator=g, dtype=torch.float64)
        # a pre-filter only (each pool filters by its own bound and _keep picks the exact
        # bottom-k): a candidate is a token either pool could keep
        thr = max(p._thr for p in self._pools())
        idx = torch.nonzero(keys < thr).flatten() if thr < math.inf else torch.arange(T)
        if not len(idx):
            return
        dev = idx.pin_memory().to(topk[0].device, non_blocking=True) if topk[0].is_cuda else idx
        ex = torch.stack([tk[dev] for tk in topk], dim=1).to(torch.int16)  # [c, L, k]
        steps = torch.full((len(idx),), step, dtype=torch.int32)
        if ex.device.type == "cuda":
            host = torch.empty(ex.shape, dtype=torch.int16, pin_memory=True)
            host.copy_(ex, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((keys[idx], host, steps, event))
            return
        for pool in self._pools():
            pool._offer(keys[idx], ex.cpu(), steps)

    def relabel(self, new_slot_of: list[list[int]]) -> None:
        """Re-placement: a held slot id ``x`` of layer ``l`` becomes ``new_slot_of[l][x]`` (the
        window pool's too)."""
        self._settle(wait=True)
        for pool in self._pools():
            for layer, row in enumerate(new_slot_of):
                m = torch.as_tensor(row, dtype=torch.int16)
                pool.experts[:, layer] = m[pool.experts[:, layer].long()]

    def _keep(self, keys, experts, steps) -> None:
        if len(keys) > self.capacity:
            # the bottom-capacity set, in no particular order (merge sorts): a selection, not a
            # sort of the whole holding on the host every step
            order = torch.topk(keys, self.capacity, largest=False, sorted=False).indices
            keys, experts, steps = keys[order], experts[order], steps[order]
        self.keys, self.experts, self.steps = keys, experts, steps
        self._thr = float(keys.max()) if len(keys) >= self.capacity > 0 else math.inf

    def merge(self, device) -> dict:
        """Collective (every rank): the global sample, sorted by key, as {keys, experts, steps}
        on every rank; afterwards this rank holds every W-th winner."""
        self._settle(wait=True)
        if self.world <= 1 or not dist.is_available() or not dist.is_initialized():
            order = torch.argsort(self.keys)
            return {
                "keys": self.keys[order],
                "experts": self.experts[order],
                "steps": self.steps[order],
            }
        cap = self.capacity
        pad = torch.full((cap,), float("inf"), dtype=torch.float64)
        pad[: len(self)] = self.keys
        all_keys = [torch.empty(cap, dtype=torch.float64, device=device) for _ in range(self.world)]
        dist.all_gather(all_keys, pad.to(device))
        all_keys = torch.stack(all_keys).cpu()  # [W, cap]
        flat = all_keys.flatten()
        n = int(torch.isfinite(flat).sum())
        thr = (
            torch.sort(flat).values[min(cap, n) - 1]
            if n
            else torch.tensor(-1.0, dtype=torch.float64)
        )
        wins = [int(((row <= thr) & torch.isfinite(row)).sum()) for row in all_keys]
        mine = torch.nonzero(self.keys <= thr).flatten()
        m = max(wins)
        width = self.L * self.k + 1
        buf = torch.zeros(m, width, dtype=torch.int32)
        # reshape(len, L * k), not (len, -1): with no sample (routingSampleTokens 0) there are no
        # rows and -1 is ambiguous
        buf[: len(mine), :-1] = self.experts[mine].reshape(len(mine), width - 1).to(torch.int32)
        buf[: len(mine), -1] = self.steps[mine]
        gathered = [
            torch.empty(m, width, dtype=torch.int32, device=device) for _ in range(self.world)
        ]
        dist.all_gather(gathered, buf.to(device))
        keys, rows = [], []
        for row, g in zip(all_keys, gathered, strict=True):
            sel = torch.nonzero((row <= thr) & torch.isfinite(row)).flatten()
            keys.append(row[sel])
            rows.append(g.cpu()[: len(sel)])
        keys, rows = torch.cat(keys), torch.cat(rows)
        order = torch.argsort(keys)
        keys, rows = keys[order], rows[order]
        experts = rows[:, :-1].reshape(-1, self.L, self.k).to(torch.int16)
        steps = rows[:, -1].clone()
        out = {"keys": keys, "experts": experts, "steps": steps}
        self._hold_share(out)
        return out

    def take_window(self, device) -> dict:
        """Collective (every rank), at each RoutingStats publish: the sample of the tokens routed
        since the previous one, as ``merge`` returns it; the next window starts empty."""
        self._settle(wait=True)
        if self.window is None:
            raise ValueError("take_window: this sampler keeps no window pool")
        merged = self.window.merge(device)
        self.window = self._empty_pool()
        return merged

    def _hold_share(self, merged: dict) -> None:
        # max(): fewer samples than ranks (or none) leaves this rank an empty share
        sel = torch.arange(self.rank, max(self.rank, len(merged["keys"])), self.world)
        self._chunks, self._chunked, self._thr = [], 0, math.inf  # a share: no bound known
        self.keys, self.experts, self.steps = (
            merged["keys"][sel],
            merged["experts"][sel],
            merged["steps"][sel],
        )

    def state_dict(self, merged: dict) -> dict:
        """What goes into the (rank 0) trainer state: the merged global sample."""
        return {"keys": merged["keys"], "experts": merged["experts"], "steps": merged["steps"]}

    def load_state_dict(self, sd: dict | None) -> None:
        if not sd:
            return
        self._pending.clear()
        self.window = self._empty_pool() if self.window is not None else None
        self._hold_share(
            {
                "keys": sd["keys"],
                "experts": sd["experts"].to(torch.int16),
                "steps": sd["steps"].to(torch.int32),
            }
        )
        self._keep(self.keys, self.experts, self.steps)


def samples_doc(merged: dict | None, permutation) -> dict | None:
    """A merged sample (``merge``, ``take_window``) as a RoutingStats ``tokenSamples``:
    ``{"experts"[L][S][k] original ids, "steps"[S]}`` in key order; None when it holds none."""
    if merged is None or not len(merged["keys"]):
        return None
    return {
        "experts": to_original_ids(merged["experts"], permutation),
        "steps": merged["steps"].tolist(),
    }


def to_original_ids(experts_slot: torch.Tensor, permutation) -> list[list[list[int]]]:
    """``experts_slot[S, L, k]`` slot ids -> ``tokenSamples.experts[L][S][k]`` original ids."""
    import numpy as np

    ex = experts_slot.numpy().astype(np.int64).transpose(1, 0, 2)  # [L, S, k]
    out = np.empty_like(ex)
    for layer, row in enumerate(permutation):
        out[layer] = np.asarray(row)[ex[layer]]
    return np.sort(out, axis=-1).tolist()
