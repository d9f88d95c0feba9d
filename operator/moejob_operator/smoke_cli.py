"""``moectl smoke``: run the upgrade gate's smoke test (`moe-smoke`) locally and print its verdict.

For people testing a trainer image before pushing it: the same program, the same checks and the
same SmokeVerdict the operator's gate reads (docs/gate.md), on the same plans: moectl renders the
SmokePlans with the planning core (:mod:`.core.smoke_plans`) into a file and hands it over.
Without ``--image`` it runs the `moe-smoke` installed next to moectl (a dev venv, or inside the
trainer image); with ``--image`` it runs the image through ``docker``/``podman`` (``--gpus 1``
unless ``--cpu``, the plans file mounted at /etc/moe-smoke/plans.json). The operator package does
not import trainer code: the program runs as a separate process either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_contracts import env as E
from moe_contracts.gate import parse_smoke_verdict

from .core.dsconfig import GpuCaps
from .core.errors import DocumentError
from .core.smoke_plans import smoke_plans

IMAGE_PLANS = E.SMOKE_PLANS_PATH


def _gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def local_gpu(compute_capability: str | None = None) -> GpuCaps:
    """The first GPU as nvidia-smi reports it (name, memory, compute capability)."""
    name, mem, cc = "gpu", 0, compute_capability
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,compute_cap",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        first = out.stdout.strip().splitlines()[0].split(", ")
        name, mem, cc = first[0], int(float(first[1])) * 2**20, cc or first[2]
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        pass
    return GpuCaps(name, mem, cc or "8.0")


def render_plans(args: argparse.Namespace) -> dict[str, Any]:
    """The SmokePlans the operator would mount: CPU, or the GPU this run uses."""
    if args.cpu or (not args.image and not args.gpu and not _gpu_visible()):
        return smoke_plans("cpu")
    return smoke_plans("cuda", local_gpu(args.compute_capability))


def smoke_command(
    args: argparse.Namespace, plans_file: str, python: str = sys.executable
) -> list[str]:
    """The command line that runs `moe-smoke` on ``plans_file`` with the options given to moectl."""
    opts: list[str] = []
    if args.cpu:
        opts.append("--cpu")
    elif args.gpu:
        opts.append("--gpu")
    if args.expect_deepspeed:
        opts += ["--expect-deepspeed", args.expect_deepspeed]
    opts += ["--timeout", f"{args.timeout:g}"]
    if args.image:
        runtime = [
            args.runtime,
            "run",
            "--rm",
            "--entrypoint",
            "moe-smoke",
            "--ipc=host",
            "-v",
            f"{os.path.abspath(plans_file)}:{IMAGE_PLANS}:ro",
        ]
        if not args.cpu:  # and no silent CPU fallback when the runtime hands over no GPU
            runtime += (
                ["--gpus", "1"] if args.runtime == "docker" else ["--device", "nvidia.com/gpu=all"]
            )
            opts = ["--gpu"] + [o for o in opts if o != "--gpu"]
        return [*runtime, args.image, *opts, "--plans", IMAGE_PLANS]
    exe = shutil.which("moe-smoke")
    return (
        ([exe] if exe else [python, "-m", "moe_trainer.gate.main"]) + opts + ["--plans", plans_file]
    )


def format_verdict(doc: dict[str, Any]) -> str:
    """A readable verdict: one line per check, versions, the failure and its exception."""
    lines = []
    label = [c["name"] + (f" [{c['case']}]" if c.get("case") else "") for c in doc["checks"]]
    width = max([len(x) for x in label] + [10])
    for c, name in zip(doc["checks"], label, strict=True):
        mark = "PASS" if c["passed"] else "FAIL"
        lines.append(f"  {mark}  {name:<{width}} {c['seconds']:7.1f}s  {c['message']}")
    v = doc.get("versions") or {}
    stack = ", ".join(
        f"{k} {v[k]}" for k in ("deepspeed", "torch", "transformers", "cuda", "gpu") if v.get(k)
    )
    head = [
        (
            f"smoke test of {stack or 'unknown versions'} on {v.get('device', '?')} "
            f"({doc.get('worldSize', '?')} rank(s))"
        )
    ]
    if doc["passed"]:
        tail = [f"PASSED in {doc['durationSeconds']:.1f}s"]
    else:
        case = f" of case '{doc['failedCase']}'" if doc.get("failedCase") else ""
        tail = [f"FAILED at check '{doc['failedCheck']}'{case} after {doc['durationSeconds']:.1f}s"]
        if doc.get("exception"):
            tail += ["exception:"] + ["  " + x for x in doc["exception"].rstrip().splitlines()[-8:]]
    return "\n".join(head + lines + tail)


def run_smoke(args: argparse.Namespace) -> int:
    if args.cpu and args.gpu:
        print("moectl smoke: error: --cpu and --gpu exclude each other", file=sys.stderr)
        return 2
    try:
        plans = render_plans(args)
    except DocumentError as exc:
        print(f"moectl smoke: error: cannot render the smoke plans: {exc}", file=sys.stderr)
        return 2
    if args.write_plans:
        Path(args.write_plans).write_text(json.dumps(plans, indent=1) + "\n")
        print(f"wrote {len(plans['cases'])} smoke plans ({plans['device']}) to {args.write_plans}")
        return 0
    if args.image and shutil.which(args.runtime) is None:
        print(
            f"moectl smoke: error: {args.runtime} is not installed (run without --image to use the "
            "local moe-smoke)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="moectl-smoke-") as tmp:
        plans_file = str(Path(tmp) / "plans.json")
        Path(plans_file).write_text(json.dumps(plans))
        return _run(args, smoke_command(args, plans_file))


def _run(args: argparse.Namespace, cmd: list[str]) -> int:
    if args.verbose:
        print("+ " + " ".join(cmd), file=sys.stderr)
    try:
        p = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=None if args.verbose else subprocess.PIPE,
            text=True,
            timeout=args.timeout + 60,
        )
    except FileNotFoundError as exc:
        print(f"moectl smoke: error: cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"moectl smoke: error: no verdict after {args.timeout + 60:.0f}s", file=sys.stderr)
        return 1
    try:
        doc = parse_smoke_verdict(p.stdout)
    except DocumentError as exc:
        print(
            f"moectl smoke: error: {cmd[0]} exited with {p.returncode} and no verdict ({exc})",
            file=sys.stderr,
        )
        if p.stderr:
            print("\n".join(p.stderr.rstrip().splitlines()[-20:]), file=sys.stderr)
        return 1
    if args.output:
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=2)
    print(json.dumps(doc, indent=2) if args.json else format_verdict(doc))
    return 0 if doc["passed"] and p.returncode == 0 else 1


def add_smoke(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "smoke",
        help="run the DeepSpeed upgrade smoke test locally",
        description="Run moe-smoke on the planner's smoke plans (ZeRO-3 + AutoEP, every "
        "model family: initialize, partitioning, expert placement, numerics "
        "against plain PyTorch, train, checkpoint, resume in a new process, "
        "FusedAdam) and print its verdict. Exit 0 passed, 1 failed, 2 usage.",
    )
    p.add_argument(
        "--image", help="run this trainer image with --runtime instead of the local moe-smoke"
    )
    p.add_argument("--runtime", default="docker", choices=("docker", "podman"))
    p.add_argument("--cpu", action="store_true", help="CPU + gloo (2 ranks; the CPU plans)")
    p.add_argument("--gpu", action="store_true", help="fail unless a GPU is used (the GPU plans)")
    p.add_argument(
        "--compute-capability",
        metavar="X.Y",
        help="GPU plans for this compute capability (default: what nvidia-smi reports)",
    )
    p.add_argument(
        "--write-plans", metavar="FILE", help="only write the SmokePlans document to FILE"
    )
    p.add_argument(
        "--expect-deepspeed", metavar="VERSION", help="fail unless the image has this DeepSpeed"
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the SmokeVerdict JSON instead")
    p.add_argument("-o", "--output", help="also write the SmokeVerdict JSON here")
    p.add_argument("-v", "--verbose", action="store_true", help="show the ranks' output")
    p.set_defaults(func=run_smoke)
