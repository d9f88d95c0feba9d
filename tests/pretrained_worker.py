"""One rank of the pretrained-loading checks: builds the trainer from a plan whose
``model.path`` is a Hugging Face directory (``Trainer.build``: ZeRO-3 partitioned model, checkpoint
streamed in with the plan's placement, ``deepspeed.initialize``, the plan's dispatcher), runs the
trained model's forward on a fixed batch and writes ``$OUT/rank<r>.pt`` =
``{"logits", "load", "rss"}`` (``rss``: this process's peak resident memory, bytes).

argv: plan path, out dir. Env: torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
Used by tests/test_pretrained.py and benchmarks/pretrained_load.py.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

BATCH_SEED, BATCH_SHAPE = 7, (2, 24)


def batch(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(BATCH_SEED)
    return torch.randint(0, vocab, BATCH_SHAPE, generator=g)


def main() -> None:
    from moe_contracts.plan import load_plan
    from moe_trainer import distenv
    from moe_trainer.trainer import Trainer

    plan = load_plan(sys.argv[1])
    out = Path(sys.argv[2])
    env = distenv.read_env(plan.world_size, [r.gpu for r in plan.ranks], force_cpu=True)
    distenv.init_distributed(env)
    trainer = Trainer(plan, env, None)
    trainer.build()
    model = trainer.engine.module.eval()
    vocab = model.config.vocab_size
    logits = None
    if os.environ.get("MOE_SKIP_FORWARD") != "1":
        with torch.no_grad():
            logits = model(input_ids=batch(vocab)).logits.float()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.save(
        {
            "logits": logits,
            "load": trainer.load_report,
            "rss": rss,
            "dispatcher": trainer.dispatcher,
        },
        out / f"rank{env.rank}.pt",
    )
    trainer.close()
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
