"""What the smoke checks compare, and how close is close enough.

Tolerances are per device and dtype (``cpu-fp32``, ``cuda-bf16``, ``cuda-fp16``) and come from
``tolerances.json`` beside this module, written by ``benchmarks/smoke_tolerances.py``: the
largest deviation a *correct* run showed from the plain-PyTorch reference, over several seeds and
every compared step, times a safety factor, never below a floor (both recorded in the file, with
the measured spreads in ``benchmarks/results/smoke_tolerances_<device>.json``). A table the
derivation has not measured yet says so in its ``source``.

Quantities (docs/gate.md lists them with the tolerances):

  scalars, per step   ``loss`` / ``balance`` (this rank's mean LM / balancing loss, relative),
                      ``gradNorm`` (the global gradient norm ZeRO-3 clips with, relative),
                      ``lr`` (relative), the optimizer's step count (exact)
  per group, per step ``grad`` (at the accumulation boundary, before clipping), ``update``
                      (fp32 master weights after - before), ``expAvg`` / ``expAvgSq`` (Adam's
                      moments after the step): size ratio |ours|/|ref| within ``<q>Size``, cosine
                      within ``<q>Cos``
  per expert, per step ``expertZeroFraction``: share of exactly-zero gradient entries (experts that
                      got as many tokens as in the reference)
  routing             ``routingMismatch``: share of (token, layer) whose experts differ (the
                      ``dispatch`` check); a flip at a near-tie (within ``tieMargin`` of the
                      largest |logit|) switches the rest of the case to the table's ``nearTie``
                      set; ``tieMargin`` is measured as the widest margin of a flip
  resume              ``resumeTensor`` (relative norm of the difference, per tensor),
                      ``resumeScalar`` (loss, lr)
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import torch

from moe_trainer.gate.reference import GROUPS, group_of

TOLERANCES_FILE = Path(__file__).with_name("tolerances.json")
# A token whose k-th and (k+1)-th router logits are closer than ``tieMargin`` (a tolerance of the
# table: 16-bit activations round far more coarsely than fp32) of the largest |logit| is a near-tie:
# arithmetic noise (another reduction order, 16-bit rounding) may route it to the other expert,
# which changes that step's expert gradients by far more than the noise itself. TIE_MARGIN: for a
# table that names none.
TIE_MARGIN = 1e-3


def tie_margin(tol: dict[str, float]) -> float:
    """The near-tie margin of tolerance set ``tol``."""
    return float(tol.get("tieMargin", TIE_MARGIN))


GROUP_QUANTITIES = ("grad", "update", "expAvg", "expAvgSq")
WHAT = {
    "grad": "gradient",
    "update": "update",
    "expAvg": "Adam first moment (exp_avg)",
    "expAvgSq": "Adam second moment (exp_avg_sq)",
}


class ToleranceError(ValueError):
    """The tolerance table is missing or has no entry for this device and dtype."""


def table_key(device: str, deepspeed_config: dict) -> str:
    """``cpu-fp32`` / ``cuda-bf16`` / ``cuda-fp16`` / ``cuda-fp32`` for a plan's DeepSpeed
    config."""
    dtype = "fp32"
    for key, name in (("bf16", "bf16"), ("fp16", "fp16")):
        if (deepspeed_config.get(key) or {}).get("enabled"):
            dtype = name
    return f"{'cuda' if device == 'cuda' else 'cpu'}-{dtype}"


@cache
def _load(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ToleranceError(f"cannot read the tolerance table {path}: {exc}") from None
    if doc.get("kind") != "SmokeTolerances":
        raise ToleranceError(f"{path}: not a SmokeTolerances document")
    return doc


def tolerances(
    key: str, path: str | Path | None = None, *, near_tie: bool = False
) -> dict[str, float]:
    """The tolerance table ``key`` (``table_key``) of ``path`` (default: the packaged one);
    ``near_tie``: the looser set for a run in which a near-tie routing flip happened."""
    doc = _load(str(path or TOLERANCES_FILE))
    try:
        table = doc["tables"][key]
        return dict(table["tolerances"], **(table["nearTie"] if near_tie else {}))
    except KeyError:
        raise ToleranceError(
            f"{path or TOLERANCES_FILE}: no tolerances for {key} (has {sorted(doc['tables'])})"
        ) from None


# ---- the pieces -----------------------------------------------------------------------------
def rel(a: float, b: float) -> float:
    """|a - b| / max(|b|, tiny); inf when either is not finite."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def size_and_cos(ours: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(|ours| / |want|, cos(ours, want)) of two flat vectors, in float64."""
    a, b = ours.double(), want.double()
    na, nb = float(a.norm()), float(b.norm())
    ratio = na / nb if nb > 0 else (math.inf if na > 0 else 1.0)
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb == 0 else 0.0)
    return ratio, cos


def by_group(
    ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per group: (ours, want) concatenated flat (same names, same shapes)."""
    parts: dict[str, tuple[list, list]] = {}
    for name, w in want.items():
        o = ours[name]
        if tuple(o.shape) != tuple(w.shape):
            raise ValueError(f"{name}: engine shape {tuple(o.shape)} != reference {tuple(w.shape)}")
        g = parts.setdefault(group_of(name), ([], []))
        g[0].append(o.float().flatten().cpu())
        g[1].append(w.float().flatten().cpu())
    return {g: (torch.cat(parts[g][0]), torch.cat(parts[g][1])) for g in GROUPS if g in parts}


def compare_groups(
    ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: dict[str, float], q: str
) -> tuple[dict[str, dict[str, float]], list[str], dict[str, float]]:
    """Quantity ``q`` (``grad``/``update``/``expAvg``/``expAvgSq``) per group: (rows, problems,
    largest deviation per tolerance key: ``<q>Size`` |ratio - 1|, ``<q>Cos`` 1 - cosine). A
    problem names the group and what is wrong with it."""
    rows, problems = {}, []
    worst = {f"{q}Size": 0.0, f"{q}Cos": 0.0}
    for group, (o, w) in by_group(ours, want).items():
        ratio, cos = size_and_cos(o, w)
        rows[group] = {"size": ratio, "cos": cos, "norm": float(w.double().norm())}
        if float(w.norm()) == 0:
            continue
        ts, tc = tol[f"{q}Size"], tol[f"{q}Cos"]
        worst[f"{q}Size"] = max(worst[f"{q}Size"], abs(ratio - 1))
        worst[f"{q}Cos"] = max(worst[f"{q}Cos"], 1 - cos)
        if float(o.norm()) == 0:
            problems.append(
                f"{group}: {WHAT[q]} is zero (the reference's norm is {float(w.norm()):.3g})"
                + (": the group does not move" if q in ("grad", "update") else "")
            )
        elif not (abs(ratio - 1) <= ts and 1 - cos <= tc):
            problems.append(
                f"{group}: {WHAT[q]} differs from the reference: size x{ratio:.4g}, cosine "
                f"{cos:.6f} (tolerance: size within {ts:g}, cosine >= {1 - tc:g})"
            )
    return rows, problems, worst


def expert_zero_fractions(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per MoE layer's expert module (name prefix ``...mlp.experts``): the share of exactly-zero
    entries in each (local) expert's gradient, over that module's 3-d expert tensors
    ``[E_local, ...]``."""
    zeros: dict[str, torch.Tensor] = {}
    sizes: dict[str, int] = {}
    for name, t in tensors.items():
        if group_of(name) != "experts" or t.dim() != 3:
            continue
        layer = name.rsplit(".", 1)[0]
        z = (t.reshape(t.shape[0], -1) == 0).sum(1).double()
        zeros[layer] = zeros.get(layer, torch.zeros_like(z)) + z
        sizes[layer] = sizes.get(layer, 0) + t[0].numel()
    return {k: (zeros[k] / sizes[k]).tolist() for k in sorted(zeros)}


def compare_zero_fractions(
    ours: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    tol: float,
    layers: dict[str, tuple[int, int]],
    same_tokens: torch.Tensor,
    tokens: torch.Tensor,
) -> tuple[float, list[str]]:
    """(worst |difference|, problems naming layer and expert) of the experts' zero shares, over
    the experts that got as many tokens as in the reference (``same_tokens[L, E]``; a near-tie
    routed elsewhere legitimately empties an expert). ``layers``: expert module name -> (MoE
    layer index, slot of its local expert 0)."""
    a, b = expert_zero_fractions(ours), expert_zero_fractions(want)
    worst, problems = 0.0, []
    for layer in b:
        li, base = layers[layer]
        for e, (x, y) in enumerate(zip(a.get(layer, []), b[layer], strict=False)):
            slot = base + e
            if not bool(same_tokens[li, slot]):
                continue
            worst = max(worst, abs(x - y))
            if abs(x - y) > tol:
                problems.append(
                    f"{layer} local expert {e} (slot {slot}, {int(tokens[li, slot])} tokens): "
                    f"{x:.0%} of its gradient is zero, {y:.0%} in the reference"
                )
    if len(problems) > 3:
        problems = [*problems[:3], f"... {len(problems) - 3} more experts"]
    return worst, (["expert gradient zero counts: " + "; ".join(problems)] if problems else [])


def clipping_diagnosis(grad_norm_ref: float, clip: float, exp_avg_size: float) -> str:
    """Why the first moment is off while the gradients match: what clipping should have done."""
    if not clip or grad_norm_ref <= clip:
        return (
            f"gradient clipping (threshold {clip:g}) should not act at this step (reference "
            f"gradient norm {grad_norm_ref:.4g}), yet the gradient the optimizer stepped with "
            f"is x{exp_avg_size:.4g} the reference's"
        )
    factor = clip / (grad_norm_ref + 1e-6)
    verdict = (
        "the gradients were not clipped"
        if abs(exp_avg_size * factor - 1) < 0.1
        else "the gradients were clipped by another factor"
    )
    return (
        f"gradient clipping: the reference gradient norm {grad_norm_ref:.4g} exceeds "
        f"gradient_clipping {clip:g}, so the optimizer must step with the gradient scaled by "
        f"{factor:.4g}; its first moment is x{exp_avg_size:.4g} the reference's: {verdict}"
    )


def relative_tensor_errors(
    ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Per tensor: |ours - want| / |want| (|ours - want| where want is zero)."""
    out = {}
    for name, w in want.items():
        d = float((ours[name].double() - w.double()).norm())
        n = float(w.double().norm())
        out[name] = d / n if n > 0 else d
    return out
