"""`moe-export CHECKPOINT OUT`: a Hugging Face model directory from a trainer checkpoint, offline.

``CHECKPOINT`` is a trainer checkpoint directory (what ``--checkpoint-dir`` / the checkpoint
volume holds: ``ds/<tag>`` and the ``plan.json`` the trainer copied there). The DeepSpeed
checkpoint is partitioned the way the job ran (ZeRO-3 over ``worldSize`` ranks, AutoEP experts over
the EP groups), and DeepSpeed's own ``zero_to_fp32`` refuses AutoEP checkpoints, so this program
restores it the way the trainer resumes: one process per rank of the plan (started here, on this
machine: ``--cpu`` runs them on the CPU over gloo, otherwise on the plan's GPUs), the model built
partitioned and empty, ``load_checkpoint``, then the same export as the end of training
(``moe_trainer.model.export``: tensor by tensor, original expert order, the family's checkpoint
layout, atomic). ``moectl export`` runs this program.

Exit codes: 0 written; 78 bad plan, no checkpoint, unusable output path; 1 anything else.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from moe_contracts import env as E
from moe_contracts.plan import PlanError, load_plan

log = logging.getLogger("moe_trainer.model.export")
EXIT_OK, EXIT_CONFIG, EXIT_UNEXPECTED = 0, 78, 1
PLAN_FILE = "plan.json"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moe-export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="the trainer's checkpoint directory")
    ap.add_argument("out", help="the Hugging Face directory to write (replaced when it exists)")
    ap.add_argument("--plan", help=f"MoEPlan file (default: CHECKPOINT/{PLAN_FILE})")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--cpu", action="store_true", help="run the ranks on the CPU (gloo)")
    return ap.parse_args(argv)


def _plan_path(args: argparse.Namespace) -> Path:
    return Path(args.plan) if args.plan else Path(args.checkpoint) / PLAN_FILE


def rank_main(args: argparse.Namespace) -> int:
    """One rank: restore the checkpoint, export."""
    from moe_trainer import checkpoint as ckpt
    from moe_trainer import distenv
    from moe_trainer.model.export import ExportError, export_model
    from moe_trainer.model.model_setup import hf_config_of
    from moe_trainer.model.models import ModelError
    from moe_trainer.trainer import Trainer

    plan = load_plan(_plan_path(args))
    step = args.step if args.step is not None else ckpt.latest_step(args.checkpoint)
    if step is None or not (ckpt.ds_dir(args.checkpoint) / ckpt.tag_for(step)).is_dir():
        log.error("no checkpoint %s in %s", step, ckpt.ds_dir(args.checkpoint))
        return EXIT_CONFIG
    force_cpu = args.cpu or plan.device == "cpu"
    env = distenv.read_env(plan.world_size, [r.gpu for r in plan.ranks], force_cpu=force_cpu)
    distenv.set_cpu_threads(env)
    distenv.init_distributed(env)
    trainer = Trainer(plan, env, args.checkpoint)
    try:
        trainer.build()
        ckpt.load(trainer.engine, args.checkpoint, step, env.rank)
        export_model(
            trainer.engine.module,
            hf_config_of(plan),
            trainer.permutation,
            os.path.abspath(args.out),
            step,
            sources=[plan.model.path, plan.training.data.tokenizer],
        )
    except (ModelError, ExportError, ValueError) as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    finally:
        trainer.close()
    return EXIT_OK


def launch_ranks(args: argparse.Namespace, argv: list[str]) -> int:
    """Start the plan's ranks on this machine, each ``python -m moe_trainer.export_cli``."""
    from moe_trainer import checkpoint as ckpt
    from moe_trainer import gang
    from moe_trainer.launch import free_port, rank_env

    world = load_plan(_plan_path(args)).world_size
    step = args.step if args.step is not None else ckpt.latest_step(args.checkpoint)
    if step is None or not (ckpt.ds_dir(args.checkpoint) / ckpt.tag_for(step)).is_dir():
        log.error("no checkpoint %s in %s", step, ckpt.ds_dir(args.checkpoint))
        return EXIT_CONFIG
    base = dict(os.environ, **{E.MASTER_ADDR: "127.0.0.1", E.MASTER_PORT: str(free_port())})
    envs = [
        rank_env(base, rank=r, local_rank=r, local_world=world, world=world) for r in range(world)
    ]
    cmd = [sys.executable, "-m", "moe_trainer.export_cli", *argv]
    return gang.Gang([cmd] * world, envs).run().exit_code


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("MOE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        code = rank_main(args) if E.RANK in os.environ else launch_ranks(args, argv)
    except PlanError as exc:
        log.error("bad plan: %s", exc)
        code = EXIT_CONFIG
    except Exception:
        log.exception("export failed")
        code = EXIT_UNEXPECTED
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: process-group destructors can hang


if __name__ == "__main__":
    main()
