"""`moe-train`: the trainer entry point every worker pod runs.

Exit codes (docs/contracts.md): 0 finished; 75 retryable (lost peer, rendezvous timeout, I/O);
78 bad plan/config/model; 65 non-finite loss; anything else is unexpected (treated as retryable).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from moe_trainer.plan import PlanError, load_plan, resolve_plan_path

log = logging.getLogger("moe_trainer")

EXIT_OK, EXIT_DATAERR, EXIT_RETRYABLE, EXIT_CONFIG, EXIT_UNEXPECTED = 0, 65, 75, 78, 1


# Communication failures surface as plain RuntimeErrors from gloo (and sometimes NCCL): a lost
# peer is retryable, the gang restarts from the latest checkpoint.
COMM_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo",
                        "NCCL", "ProcessGroup", "c10d", "remote worker", "timed out", "Timed out")


def is_comm_failure(exc: BaseException) -> bool:
    import torch.distributed as dist
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in COMM_FAILURE_MARKERS)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moe-train", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", help="MoEPlan v1 JSON (default $MOE_PLAN, then /etc/moe/plan.json)")
    ap.add_argument("--checkpoint-dir", help="default $MOE_CHECKPOINT_DIR, then the plan's training.checkpointDir")
    ap.add_argument("--cpu", action="store_true", help="ignore GPUs (gloo on CPU)")
    return ap.parse_args(argv)


def run(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("MOE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # torch 2.13 deprecates the collectives DeepSpeed 0.19.8 calls every step; keep logs readable.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    try:
        plan = load_plan(resolve_plan_path(args.plan))
    except PlanError as exc:
        log.error("bad plan: %s", exc)
        return EXIT_CONFIG

    from moe_trainer import distenv
    from moe_trainer.data import DataError
    from moe_trainer.models import ModelError
    from moe_trainer.trainer import NonFiniteLoss, Trainer

    ckpt_dir = args.checkpoint_dir or os.environ.get("MOE_CHECKPOINT_DIR") or plan.training.checkpoint_dir
    try:
        force_cpu = args.cpu or plan.raw.get("device") == "cpu"
        env = distenv.read_env(plan.world_size, [r.gpu for r in plan.ranks], force_cpu=force_cpu)
    except distenv.RendezvousError as exc:
        log.error("rendezvous: %s", exc)
        return EXIT_CONFIG
    distenv.set_cpu_threads(env)
    trainer = None
    try:
        try:
            distenv.init_distributed(env)
        except (RuntimeError, OSError, TimeoutError) as exc:
            log.error("rendezvous failed: %s", exc)
            return EXIT_RETRYABLE
        trainer = Trainer(plan, env, ckpt_dir)
        try:
            trainer.build()
        except (ModelError, DataError, PlanError, ValueError) as exc:
            log.error("bad model/data/config: %s", exc)
            return EXIT_CONFIG
        trainer.resume()
        return trainer.run()
    except NonFiniteLoss as exc:
        log.error("%s", exc)
        return EXIT_DATAERR
    except (PlanError, ModelError, DataError) as exc:
        log.error("bad config: %s", exc)
        return EXIT_CONFIG
    except (OSError, TimeoutError) as exc:
        log.error("retryable failure: %s", exc)
        return EXIT_RETRYABLE
    except Exception as exc:
        if is_comm_failure(exc):
            log.error("retryable failure (lost peer / communication): %s", exc)
            return EXIT_RETRYABLE
        log.exception("unexpected failure")
        return EXIT_UNEXPECTED
    finally:
        if trainer is not None:
            trainer.close()


def main(argv=None) -> None:
    code = run(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: process-group destructors can hang when a peer is gone.
    os._exit(code)


if __name__ == "__main__":
    main()
