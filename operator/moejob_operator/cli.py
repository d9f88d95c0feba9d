"""``moectl``: the command line of moe-operator.

Subcommands register themselves in ``COMMANDS``: a function that adds a subparser and sets
``func`` (``args -> exit code``). Bad input of any kind (arguments, documents, a plan that does
not fit) prints one line ``moectl <command>: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .core.errors import DocumentError
from .run import add_operator
from .smoke_cli import add_smoke

if TYPE_CHECKING:  # for annotations only: the commands import the core when they run
    from moe_contracts.topology import TopologyReport

    from .core.sizing import AutoFields

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command line (argparse would otherwise print usage and call sys.exit)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


# ---- moectl plan ---------------------------------------------------------------------------


def _load_reports(refs: Sequence[str]) -> list[TopologyReport]:
    """``FILE``, ``FIXTURE`` or ``FILE|FIXTURE@NODE`` (renames the node: one fixture, many
    nodes)."""
    from .core.topology import load_topology

    reports = []
    for ref in refs:
        source, _, node = ref.partition("@")
        report = load_topology(source)
        reports.append(report.model_copy(update={"node": node}) if node else report)
    return reports


def _json_arg(text: str, what: str) -> dict[str, Any]:
    """A JSON object given inline or as ``@path``."""
    try:
        raw = Path(text[1:]).read_text() if text.startswith("@") else text
        value = json.loads(raw)
    except (OSError, json.JSONDecodeError) as exc:
        raise DocumentError(f"{what}: {text!r} is not a JSON object or @file ({exc})") from None
    if not isinstance(value, dict):
        raise DocumentError(f"{what}: {text!r} is not a JSON object")
    return value


def _run_plan(args: argparse.Namespace) -> int:
    from moe_contracts.routing import read_routing_stats

    from .core import dsconfig, models, plan

    model = models.resolve_model(args.model)
    stats = read_routing_stats(args.stats) if args.stats else None
    overrides: dict[str, Any] = {}
    for text in args.ds_override:
        overrides = dsconfig.deep_merge(overrides, _json_arg(text, "--ds-override"))
    nodes = [n for n in (args.nodes or "").split(",") if n] or None
    training = plan.TrainingOptions(
        steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        checkpoint_every_steps=args.checkpoint_every,
        grad_clip=args.grad_clip,
        activation_checkpointing=bool(args.activation_checkpointing),
        data=_json_arg(args.data, "--data") if args.data else {"kind": "synthetic"},
    )
    procs, memory, reports = 1, 0, None
    if args.cpu:
        procs = args.procs_per_node
        memory = (
            int(args.cpu_memory_gib * 2**30)
            if args.cpu_memory_gib
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // procs
        )
    elif not args.topology:
        raise UsageError("moectl plan: error: --topology is required (or --cpu)")
    else:
        reports = _load_reports(args.topology)
    request = plan.PlanRequest(
        args.job,
        args.namespace,
        model,
        reports,
        nodes=nodes,
        device="cpu" if args.cpu else "cuda",
        gpus_per_node=None if args.cpu else args.gpus_per_node,
        procs_per_node=procs,
        cpu_memory_bytes=memory,
        strategy=args.strategy,
        routing_stats=stats,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        ep_size=args.ep_size,
        training=training,
        autoep=not args.no_autoep,
        ds_overrides=overrides,
        performance=not args.no_performance,
        dispatcher=args.dispatcher,
        replicas=_replicas_arg(args.replicas),
        max_expert_memory_overhead=args.max_expert_memory_overhead,
    )
    if args.auto:
        from .core import sizing

        result = sizing.plan_sized(request, _auto_fields(args, overrides))
    else:
        result = plan.build_plan(request)
    if args.export:
        # the plan's ``output``: where the trainer writes the trained model (docs/contracts.md)
        result.document["output"] = {"path": args.export, "everyCheckpoints": args.export_every}
    print(result.summary())
    if result.sizing is not None:
        from .core.sizing_text import sizing_table

        print(sizing_table(result.document["sizing"], result.gpu.name))
    if args.output:
        plan.write_plan(result, args.output)
        print(f"wrote {args.output}")
    return 0


def _auto_fields(args: argparse.Namespace, overrides: dict[str, Any]) -> AutoFields:
    """``--auto``: every sizing field the command line does not give."""
    from .core.sizing import AutoFields

    zero = overrides.get("zero_optimization") or {}
    return AutoFields(
        nodes=not args.nodes,
        gpus_per_node=args.gpus_per_node is None,
        ep_size=args.ep_size is None,
        micro_batch=args.micro_batch is None,
        activation_checkpointing=args.activation_checkpointing is None,
        persistence="stage3_param_persistence_threshold" not in zero,
    )


def add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .core.placement import strategies
    from .core.plan import TrainingOptions

    defaults = TrainingOptions()

    p = sub.add_parser(
        "plan",
        help="plan a training job: placement, DeepSpeed config, memory",
        description="Plan a MoE training job offline from topology reports and "
        "write the MoEPlan v1 document (docs/planning.md).",
    )
    p.add_argument(
        "--topology",
        action="append",
        default=[],
        metavar="FILE|FIXTURE[@NODE]",
        help="a TopologyReport file or shipped fixture, once per node; @NODE renames",
    )
    p.add_argument("--model", required=True, help="preset name or path of a HF config.json")
    p.add_argument("--stats", help="RoutingStats v1 file of an earlier run")
    p.add_argument("--strategy", default=strategies.DEFAULT.name, choices=strategies.NAMES)
    p.add_argument("--nodes", help="comma-separated node names to use (default: all)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: all)")
    p.add_argument(
        "--ep-size", type=int, help="expert-parallel size (default: largest inside NVLink groups)"
    )
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, help="sequences per rank per forward")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=defaults.checkpoint_every_steps,
        help="optimizer steps between checkpoints (default %(default)s, as the CRD's "
        "spec.checkpoint.everySteps)",
    )
    p.add_argument("--grad-clip", type=float, default=defaults.grad_clip)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute each layer's activations in backward (default: off; with --auto chosen)",
    )
    p.add_argument(
        "--auto",
        action="store_true",
        help="size the job: nodes, GPUs per node, EP size, micro-batch, activation "
        "checkpointing and the persistence threshold, each unless given here, chosen by "
        "predicted tokens/s among the shapes that fit (docs/planning.md, Sizing)",
    )
    p.add_argument("--no-autoep", action="store_true", help="ZeRO-3 without expert parallelism")
    p.add_argument(
        "--no-performance",
        action="store_true",
        help="stock configuration: no planner speed choices (training.performance, "
        "moeImpl, one-rank ZeRO-3 knobs); see docs/performance.md",
    )
    p.add_argument(
        "--dispatcher",
        choices=["autoep", "dedup"],
        help="expert-parallel dispatcher (default: dedup when EP > 1, docs/dispatch.md)",
    )
    p.add_argument(
        "--replicas",
        default="none",
        metavar="auto|none|N",
        help="extra copies of hot experts (spec.placement.replicas; docs/placement.md)",
    )
    p.add_argument(
        "--max-expert-memory-overhead",
        type=int,
        default=25,
        metavar="PERCENT",
        help="replicas' memory budget, percent of a rank's experts (default 25)",
    )
    p.add_argument(
        "--ds-override",
        action="append",
        default=[],
        metavar="JSON|@FILE",
        help="DeepSpeed config merged last (repeatable)",
    )
    p.add_argument("--data", metavar="JSON|@FILE", help='training.data, e.g. {"kind": "synthetic"}')
    p.add_argument("--cpu", action="store_true", help="CPU mode (local demo): gloo, fp32")
    p.add_argument("--procs-per-node", type=int, default=2, help="CPU mode: processes per node")
    p.add_argument("--cpu-memory-gib", type=float, help="CPU mode: memory per process")
    p.add_argument(
        "--export",
        metavar="DIR",
        help="absolute path where the trainer writes the trained model as a Hugging Face "
        "directory (the plan's output)",
    )
    p.add_argument(
        "--export-every",
        type=int,
        default=0,
        metavar="N",
        help="also export at every N-th checkpoint (default 0: only at the end)",
    )
    p.add_argument("--job", default="local", help="job name written into the plan")
    p.add_argument("--namespace", default="default")
    p.add_argument("-o", "--output", help="write the plan here")
    p.set_defaults(func=_run_plan)


# ---- moectl export -------------------------------------------------------------------------


def _run_export(args: argparse.Namespace) -> int:
    """Run the trainer package's ``moe-export`` (torch and DeepSpeed live there, not here: the
    operator package never imports them)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("moe_trainer") is None or importlib.util.find_spec("torch") is None:
        raise UsageError(
            "moectl export: error: needs the trainer package (torch, DeepSpeed, transformers); "
            "run it where the trainer is installed (the trainer image: moe-export CHECKPOINT OUT)"
        )
    cmd = [sys.executable, "-m", "moe_trainer.export_cli", args.checkpoint, args.out]
    cmd += ["--plan", args.plan] if args.plan else []
    cmd += ["--step", str(args.step)] if args.step is not None else []
    cmd += ["--cpu"] if args.cpu else []
    return subprocess.call(cmd)


def add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="write a Hugging Face model directory from a trainer checkpoint",
        description="Export a trainer checkpoint directory as a Hugging Face model directory "
        "(safetensors, config.json, tokenizer files; experts in their original order). Runs "
        "moe-export of the trainer package, one process per rank of the checkpoint's plan.",
    )
    p.add_argument("checkpoint", help="the trainer's checkpoint dir (holds ds/ and plan.json)")
    p.add_argument("out", help="the directory to write")
    p.add_argument("--plan", help="MoEPlan file (default: CHECKPOINT/plan.json)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--cpu", action="store_true", help="run the ranks on the CPU (gloo)")
    p.set_defaults(func=_run_export)


# ---- entry point ---------------------------------------------------------------------------

COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    add_plan,
    add_operator,
    add_smoke,
    add_export,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moectl", description="moe-operator command line")
    sub: argparse._SubParsersAction[argparse.ArgumentParser] = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser
    )
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        rc: int = args.func(args)  # the subcommand's exit code (the module docstring)
        return rc
    except UsageError as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return EXIT_USAGE
    except DocumentError as exc:
        command = getattr(locals().get("args"), "command", "")
        print(f"moectl {command}: error: {exc}".replace("  ", " "), file=sys.stderr)
        return EXIT_USAGE


def _replicas_arg(value: str) -> int | str | None:
    """``--replicas``: ``auto``, ``none`` or a count of extra copies per layer."""
    v = value.strip().lower()
    if v in ("auto", "none"):
        return None if v == "none" else v
    if v.isdigit():
        return int(v)
    raise SystemExit(f"--replicas: {value!r} is not auto, none or a number of copies")


if __name__ == "__main__":
    sys.exit(main())
