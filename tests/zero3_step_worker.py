"""CPU, gloo, one process per rank: a small model under DeepSpeed ZeRO-3 (bf16, fp32 masters) with
torch's fused AdamW and gradient clipping that triggers. ``argv[1]``: ``stock`` (DeepSpeed as is),
``patched`` (``install_zero3_fused_step``), ``grads`` (``install_single_rank_grads``), ``flat``
(``install_flat_sub_group_grads``) or ``lean`` (all three, as the trainer installs them);
``argv[2]``: gradient accumulation steps (default 1); ``argv[3]``: the clipping threshold
(default 0.05, which the gradient norms exceed every step); ``argv[4]``: DeepSpeed's gradient
accumulation dtype (``bf16`` default, or ``fp32``). One Linear sits in a ZeRO-3 leaf module
(its gradients reach the optimizer through the leaf hook, not the per-parameter one).
Prints JSON: the fp32 master weights after each step, the global gradient norms, what the
optimizer was handed as ``grad_scale``, and how often DeepSpeed's own gradient path and its fp32
gradient preparation ran.
Used by tests/test_perf.py."""

import json
import os
import sys

import deepspeed
import torch
from torch import nn

from moe_trainer.model import perf

mode = sys.argv[1]
accumulation = int(sys.argv[2]) if len(sys.argv) > 2 else 1
clipping = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
accum_dtype = sys.argv[4] if len(sys.argv) > 4 else "bf16"
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)


class Leaf(nn.Sequential):
    pass


model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), Leaf(nn.Linear(256, 64)), nn.Linear(64, 8))
deepspeed.utils.set_z3_leaf_modules(model, [Leaf])
cfg = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": accumulation,
    "gradient_clipping": clipping,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 10000,
    },
    "zero_allow_untested_optimizer": True,
    "data_types": {"grad_accum_dtype": accum_dtype},
}
engine, _, _, _ = deepspeed.initialize(
    model=model,
    model_parameters=model.parameters(),
    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    config=cfg,
)
calls = {}


def count_calls(obj, attr):
    """Replace obj.attr by a wrapper that counts calls in calls[attr]."""
    original = getattr(obj, attr)
    calls[attr] = 0

    def counted(*args, **kwargs):
        calls[attr] += 1
        return original(*args, **kwargs)

    setattr(obj, attr, counted)


count_calls(engine.optimizer, "reduce_independent_p_g_buckets_and_remove_grads")
count_calls(engine.optimizer, "_prepare_fp32_grad_for_sub_group")
installed = {
    "stock": lambda o: [],
    "patched": perf.install_zero3_fused_step,
    "grads": perf.install_single_rank_grads,
    "flat": perf.install_flat_sub_group_grads,
    "lean": lambda o: (
        perf.install_zero3_fused_step(o)
        + perf.install_single_rank_grads(o)
        + perf.install_flat_sub_group_grads(o)
    ),
}[mode](engine.optimizer)
inner = engine.optimizer.optimizer
scales, norms, masters = [], [], []
orig_step = inner.step


def spy_step(*a, **kw):
    gs = getattr(inner, "grad_scale", None)
    scales.append(None if gs is None else float(gs.reshape(-1)[0]))
    return orig_step(*a, **kw)


inner.step = spy_step
g = torch.Generator().manual_seed(1)
for _ in range(4):
    for _micro in range(accumulation):
        x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
        y = torch.randn(16, 8, generator=g).to(torch.bfloat16)
        loss = ((engine(x) - y).float() ** 2).mean() * 100
        engine.backward(loss)
        engine.step()
    norms.append(float(engine.get_global_grad_norm()))
    masters.append(
        [float(v) for f in engine.optimizer.fp32_partitioned_groups_flat for v in f.detach()[:50]]
    )
print(
    json.dumps(
        {
            "installed": installed,
            "scales": scales,
            "norms": norms,
            "masters": masters,
            "subGroups": len(engine.optimizer.fp32_partitioned_groups_flat),
            "stockGradPathCalls": calls["reduce_independent_p_g_buckets_and_remove_grads"],
            "stockPrepareCalls": calls["_prepare_fp32_grad_for_sub_group"],
            "accumDtype": str(engine.optimizer.grad_partitions_flat_buffer.dtype),
        }
    )
)
# Skip interpreter teardown, as moe-train does: on a loaded machine the process-group threads can
# still be running when it destroys them ("terminate called without an active exception", SIGABRT).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
