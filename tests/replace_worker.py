"""One rank of the in-place re-placement checks (``moe_trainer.replace``), CPU / gloo.

Builds the trainer of ``argv[1]`` (a plan) twice in this process: a reference run of all its
steps, then a run that re-places every layer to ``$NEW`` (JSON; default: the plan's permutation
reversed) after step ``$SWITCH``, checking that the fp32 masters and Adam states of every
slot-indexed tensor, read in original expert order, are the same before and after the switch. Writes
``argv[2]/rank<r>.json``: ``{"reference": losses, "switched": losses, "states": [...],
"weights_rel_diff": {tensor: max relative difference}, "permutation"}`` (the final fp32 masters
and optimizer states of both runs in original order, compared).
Env: torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Used by
tests/test_replace.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

SWITCH = int(os.environ.get("SWITCH", "2"))


def original_order(trainer) -> dict[str, torch.Tensor]:
    """name -> [E, ...] fp32 master / optimizer state of every slot-indexed tensor, original
    expert order (EP slots gathered over the EP group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from moe_trainer import replace

    keys = replace.optimizer_state_keys(trainer.engine)
    out = {}
    for layer, block in enumerate(trainer.blocks):
        inv = torch.argsort(torch.as_tensor(trainer.permutation[layer]))
        E = len(trainer.permutation[layer])
        for target in replace.layer_targets(block, E):
            t = target.tensor
            if not isinstance(t, torch.nn.Parameter):
                continue
            shape = tuple(t.ds_shape)
            for key in [None, *keys]:
                full = (
                    safe_get_full_fp32_param(t)
                    if key is None
                    else safe_get_full_optimizer_state(t, key)
                ).view(shape)
                if target.expert_parallel:
                    parts = [torch.empty_like(full) for _ in range(block.ep_size)]
                    dist.all_gather(parts, full.contiguous(), group=block.ep_group)
                    full = torch.cat(parts)
                out[f"{layer}.{target.name}.{key or 'fp32'}"] = full.index_select(0, inv).clone()
    return out


def build(plan, env):
    from moe_trainer.trainer import Trainer

    trainer = Trainer(plan, env, None)
    trainer.build()
    for layer, block in enumerate(trainer.blocks):  # a router bias that decides the top-k
        for name, buf in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                g = torch.Generator().manual_seed(layer)
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
    return trainer


def main() -> None:
    from moe_contracts.plan import load_plan
    from moe_trainer import distenv, replace
    from moe_trainer.replan import switch_state

    plan = load_plan(sys.argv[1])
    out = Path(sys.argv[2])
    env = distenv.read_env(plan.world_size, [r.gpu for r in plan.ranks], force_cpu=True)
    distenv.init_distributed(env)
    ref = build(plan, env)
    ref.run()
    ref_final = original_order(ref)
    ref.close()

    trainer = build(plan, env)
    new = json.loads(os.environ.get("NEW", "null")) or [
        list(reversed(row)) for row in trainer.permutation
    ]
    states: list[dict] = []

    def on_step(step: int) -> None:
        if step != SWITCH:
            return
        before = original_order(trainer)
        summary = replace.apply(trainer.engine, trainer.blocks, trainer.permutation, new)
        switch_state(trainer, new)
        after = original_order(trainer)
        states.append(
            {
                "summary": summary,
                "names": sorted(before),
                "equal": all(torch.equal(before[k], after[k]) for k in before),
            }
        )

    trainer.on_step = on_step
    trainer.run()
    final = original_order(trainer)
    weights_equal = {
        k: float((final[k] - ref_final[k]).abs().max() / (ref_final[k].abs().max() + 1e-30))
        for k in final
    }
    doc = {
        "reference": ref.losses,
        "switched": trainer.losses,
        "states": states,
        "weights_rel_diff": weights_equal,
        "permutation": trainer.permutation,
    }
    (out / f"rank{env.rank}.json").write_text(json.dumps(doc))
    trainer.close()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
