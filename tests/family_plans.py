"""MoEPlan documents for the tiny model of each family (tests of pretrained loading and export).

Two CPU ranks; AutoEP families at EP 2 (experts split over the ranks), the others (OLMoE) at
EP 1 through the trainer's grouped block with experts as ordinary ZeRO-3 parameters. The
placement is not the identity: each layer's experts are rotated differently, moving experts
between EP ranks (with DeepSeek-style router groups, whole groups move). ZeRO-3 keeps no parameter
whole (``stage3_param_persistence_threshold`` 0), so every one is loaded into and gathered from
real partitions.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_trainer import families
from moe_trainer.model import models

WORLD = 2


def permutation(num_layers: int, num_experts: int, n_group: int = 1) -> list[list[int]]:
    """Layer l: groups rotated by l + 1 and reversed inside each group (never the identity)."""
    gs = num_experts // n_group
    rows = []
    for layer in range(num_layers):
        order = [(g + layer + 1) % n_group for g in range(n_group)] if n_group > 1 else [0]
        row = []
        for g in order:
            block = list(range(g * gs, (g + 1) * gs))
            row += block[::-1] if n_group > 1 else block[layer + 1 :] + block[: layer + 1]
        rows.append(row[::-1] if n_group == 1 and layer % 2 else row)
    return rows


def plan_doc(
    family: str,
    hf_config: dict | None = None,
    *,
    path: str | None = None,
    dispatcher: str = "autoep",
    steps: int = 2,
    output: dict | None = None,
    ckpt_every: int = 100,
    lr: float = 3e-3,
) -> dict:
    fam = families.get(family)
    cfg = dict(hf_config or fam.tiny_config)
    model = models.build_model(cfg, seed=0)  # shapes only
    n_layers = len(models.find_moe_layers(model))
    E = models.num_experts_of(model)
    grouped_router = cfg.get("model_type") == "deepseek_v3" or cfg.get("topk_method") == (
        "group_limited_greedy"
    )
    n_group = int(cfg.get("n_group") or 1) if grouped_router else 1
    autoep = fam.autoep_preset is not None
    ep = WORLD if autoep else 1
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * WORLD,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if autoep:
        ds["expert_parallel"] = {
            "enabled": True,
            "autoep_size": ep,
            "preset_model": fam.autoep_preset,
        }
    doc = {
        "kind": "MoEPlan",
        "version": 1,
        "job": {"namespace": "default", "name": f"tiny-{family}"},
        "device": "cpu",
        "model": {"family": family, "preset": None, "path": path, "hfConfig": cfg},
        "worldSize": WORLD,
        "epSize": ep,
        "ranks": [
            {"rank": r, "node": f"node-{r}", "nodeRank": r, "localRank": 0, "gpu": None, "group": r}
            for r in range(WORLD)
        ],
        "placement": {
            "strategy": "test",
            "numLayers": n_layers,
            "numExperts": E,
            "epSize": ep,
            "permutation": permutation(n_layers, E, n_group),
            "dispatcher": dispatcher if autoep else "autoep",
        },
        "deepspeed": ds,
        "training": {
            "steps": steps,
            "seqLen": 32,
            "microBatch": 2,
            "gradAccum": 1,
            "lr": lr,
            "warmupSteps": 0,
            "checkpointEverySteps": ckpt_every,
            "seed": 1234,
            "balance": {"mode": "per_layer_aux", "coef": 0.01},
            "data": {"kind": "synthetic"},
            "moeImpl": "hf" if autoep else "grouped",
            "routingSampleTokens": 0,
        },
    }
    if output is not None:
        doc["output"] = output
    return doc


def write_plan(tmp: Path, name: str, doc: dict) -> Path:
    p = tmp / f"plan-{name}.json"
    p.write_text(json.dumps(doc))
    return p
