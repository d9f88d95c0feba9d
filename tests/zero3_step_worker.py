"""One process, CPU, gloo: a small model under DeepSpeed ZeRO-3 (bf16, fp32 masters) with torch's
fused AdamW and gradient clipping that triggers; with or without ``install_zero3_fused_step``.
Prints JSON: the fp32 master weights after each step, the global gradient norms, and what the
optimizer was handed as ``grad_scale``. Used by tests/test_perf.py."""

import json
import sys

import deepspeed
import torch
from torch import nn

from moe_trainer import perf

patched = sys.argv[1] == "patched"
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 8))
cfg = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_clipping": 0.05,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 10000,
    },
    "zero_allow_untested_optimizer": True,
}
engine, _, _, _ = deepspeed.initialize(
    model=model,
    model_parameters=model.parameters(),
    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    config=cfg,
)
installed = perf.install_zero3_fused_step(engine.optimizer) if patched else []
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
        }
    )
)
