"""Router probes, per-layer load-balancing loss, and routing statistics.

Forward hooks on each MoE layer's router capture, per forward pass,
  logits[T, E]   router logits (kept in the autograd graph for the balancing loss)
  topk[T, K]     the experts each token was sent to (slot ids)
for both layouts the trainer runs:
  Hugging Face blocks: `block.gate` returns (logits, scores, indices);
  DeepSpeed AutoEP:    `block.router` returns (scores, indices, counts), logits from `router.gate`.

Statistics are kept in *slot* ids while training and reported in *original* expert ids (the ids
the planner's permutation refers to): slot s of layer l holds original expert permutation[l][s].
"""

from __future__ import annotations

import torch
from torch import nn


class RouterProbe:
    """Captures router logits and top-k choices of every MoE layer on each forward pass."""

    def __init__(self, blocks: list[nn.Module]):
        self.num_layers = len(blocks)
        self.logits: list[torch.Tensor | None] = [None] * self.num_layers
        self.topk: list[torch.Tensor | None] = [None] * self.num_layers
        self._handles = []
        for i, block in enumerate(blocks):
            router = getattr(block, "router", None)
            if router is not None and hasattr(router, "gate"):  # AutoEP layer
                self._handles.append(router.gate.register_forward_hook(self._logits_hook(i)))
                self._handles.append(router.register_forward_hook(self._topk_hook(i, 1)))
            elif hasattr(block, "gate"):  # HF block (or a swapped one keeping `gate`)
                self._handles.append(block.gate.register_forward_hook(self._hf_hook(i)))
            else:
                raise ValueError(f"MoE layer {i} ({type(block).__name__}) has no router to probe")

    def _logits_hook(self, i):
        def hook(_m, _inp, out):
            self.logits[i] = out

        return hook

    def _topk_hook(self, i, index):
        def hook(_m, _inp, out):
            self.topk[i] = out[index].detach()

        return hook

    def _hf_hook(self, i):
        def hook(_m, _inp, out):
            self.logits[i] = out[0]
            self.topk[i] = out[2].detach()

        return hook

    def clear(self) -> None:
        self.logits = [None] * self.num_layers
        self.topk = [None] * self.num_layers

    def captured(self) -> bool:
        return all(x is not None for x in self.logits) and all(x is not None for x in self.topk)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def switch_aux_loss(logits: torch.Tensor, topk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss of one layer: E * sum_e f_e * P_e.

    f_e = share of the T*K token->expert assignments that went to e (no gradient),
    P_e = mean softmax router probability of e. Equals 1.0 for perfectly uniform routing and
    grows as routing concentrates; the gradient pushes probability away from overloaded experts.
    logits[T, E], topk[T, K].
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    # scatter_add, not bincount: CUDA bincount reads the max id back to the host (a sync per layer)
    ids = topk.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.float32, device=ids.device).scatter_add_(
        0, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    )
    f = counts / counts.sum().clamp(min=1)
    return num_experts * (f * probs.mean(dim=0)).sum()


def balance_loss(probe: RouterProbe, num_experts: int, mode: str) -> torch.Tensor | None:
    """`per_layer_aux`: mean over layers of each layer's own loss, so every layer is balanced.
    `global_aux`: transformers' formulation (all layers' logits concatenated): balances only the
    sum over layers. `none`: no loss."""
    if mode == "none":
        return None
    if mode == "per_layer_aux":
        losses = [
            switch_aux_loss(lg, tk, num_experts)
            for lg, tk in zip(probe.logits, probe.topk, strict=True)
        ]
        return torch.stack(losses).mean()
    if mode == "global_aux":
        return switch_aux_loss(torch.cat(probe.logits), torch.cat(probe.topk), num_experts)
    raise ValueError(f"training.balance.mode: {mode!r} is unknown")


def step_counts(
    probe: RouterProbe, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts of one forward pass, in slot ids:
    load[L, E] (token->expert assignments), coact[L, E, E] (tokens whose top-k held both i and j,
    zero diagonal), max_abs_logit[L]."""
    loads, coacts, maxlog = [], [], []
    for lg, tk in zip(probe.logits, probe.topk, strict=True):
        onehot = torch.zeros(tk.shape[0], num_experts, dtype=torch.float64, device=tk.device)
        onehot.scatter_(1, tk.long(), 1.0)  # [T, E]
        loads.append(onehot.sum(0))
        c = onehot.T @ onehot  # [E, E]
        c.fill_diagonal_(0)
        coacts.append(c)
        maxlog.append(lg.detach().abs().max().double())
    return torch.stack(loads), torch.stack(coacts), torch.stack(maxlog)


class RoutingAccumulator:
    """Running totals in slot ids: load[L, E], coact[L, E, E], tokens per layer."""

    def __init__(self, num_layers: int, num_experts: int, device):
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.coact = torch.zeros(
            num_layers, num_experts, num_experts, dtype=torch.float64, device=device
        )
        self.tokens = 0
        self.steps = 0

    def add(self, load: torch.Tensor, coact: torch.Tensor, tokens: int) -> None:
        self.load += load
        self.coact += coact
        self.tokens += tokens

    def state_dict(self) -> dict:
        return {
            "load": self.load.cpu(),
            "coact": self.coact.cpu(),
            "tokens": self.tokens,
            "steps": self.steps,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.load.copy_(sd["load"])
        self.coact.copy_(sd["coact"])
        self.tokens = int(sd["tokens"])
        self.steps = int(sd["steps"])

    def relabel(self, sources: list[list[int]]) -> None:
        """Re-placement: new slot ``s`` of layer ``l`` takes the counts of old slot
        ``sources[l][s]``."""
        for layer, src in enumerate(sources):
            idx = torch.as_tensor(src, device=self.load.device)
            self.load[layer] = self.load[layer][idx]
            self.coact[layer] = self.coact[layer][idx][:, idx]


class RoutingWindow:
    """The counts since the previous RoutingStats publish (the document's ``window``), in
    original expert ids: the whole-run totals at that publish are kept and subtracted."""

    def __init__(self):
        self.base: dict | None = None  # {"load", "coact", "tokens", "steps"} at the last publish

    def doc(self, load, coact, tokens: int, steps: int, samples: dict | None = None) -> dict:
        """``window`` of a document whose whole-run counts are these (original ids); with
        ``samples`` (``token_samples.samples_doc`` of the window's pool), its ``tokenSamples``."""
        import numpy as np

        b = self.base or {"load": 0, "coact": 0, "tokens": 0, "steps": 0}
        doc = {
            "fromStep": int(b["steps"]),
            "toStep": int(steps),
            "tokens": int(tokens - b["tokens"]),
            "steps": int(steps - b["steps"]),
            "load": np.rint(np.asarray(load) - b["load"]).astype(np.int64).tolist(),
            "coactivation": np.rint(np.asarray(coact) - b["coact"]).astype(np.int64).tolist(),
        }
        if samples is not None:
            doc["tokenSamples"] = samples
        return doc

    def advance(self, load, coact, tokens: int, steps: int) -> None:
        import numpy as np

        self.base = {
            "load": np.asarray(load).copy(),
            "coact": np.asarray(coact).copy(),
            "tokens": int(tokens),
            "steps": int(steps),
        }

    def state_dict(self) -> dict | None:
        return self.base

    def load_state_dict(self, sd: dict | None) -> None:
        self.base = sd


def to_original_ids(load_slot, coact_slot, permutation):
    """Reindex slot-id counts to original expert ids: orig[perm[s]] = slot[s]."""
    import numpy as np

    load_slot = np.asarray(load_slot)
    coact_slot = np.asarray(coact_slot)
    load = np.zeros_like(load_slot)
    coact = np.zeros_like(coact_slot)
    for layer, row in enumerate(permutation):
        p = np.asarray(row)
        load[layer, p] = load_slot[layer]
        coact[layer][np.ix_(p, p)] = coact_slot[layer]
    return load, coact


def load_to_original_ids(load_slot, permutation):
    """load_slot[L, E] in slot ids -> load[L, E] in original expert ids."""
    import numpy as np

    load_slot = np.asarray(load_slot)
    load = np.zeros_like(load_slot)
    for layer, row in enumerate(permutation):
        load[layer, np.asarray(row)] = load_slot[layer]
    return load


def max_mean_per_layer(load) -> list[float]:
    """load[L, E] -> max/mean expert load of each layer (1.0 = perfectly balanced)."""
    import numpy as np

    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(axis=1)
    return [float(m / a) if a > 0 else 0.0 for m, a in zip(load.max(axis=1), mean, strict=True)]
