"""``moectl smoke``: run the upgrade gate's smoke test (`moe-smoke`) locally and print its verdict.

For people testing a trainer image before pushing it: the same program, the same checks and the
same SmokeVerdict the operator's gate reads (docs/gate.md). Without ``--image`` it runs the
`moe-smoke` installed next to moectl (a dev venv, or inside the trainer image); with ``--image``
it runs the image through ``docker``/``podman`` (``--gpus 1`` unless ``--cpu``). The operator
package does not import trainer code: the program runs as a separate process either way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

from .core.gate import GateError, parse_smoke_verdict


def smoke_command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """The command line that runs `moe-smoke` with the options given to moectl."""
    opts: list[str] = []
    if args.cpu:
        opts.append("--cpu")
    if args.nproc:
        opts += ["--nproc", str(args.nproc)]
    if args.steps:
        opts += ["--steps", str(args.steps)]
    if args.inject:
        opts += ["--inject", args.inject]
    if args.expect_deepspeed:
        opts += ["--expect-deepspeed", args.expect_deepspeed]
    opts += ["--timeout", f"{args.timeout:g}"]
    if args.image:
        runtime = [args.runtime, "run", "--rm", "--entrypoint", "moe-smoke", "--ipc=host"]
        if not args.cpu:      # and no silent CPU fallback when the runtime hands over no GPU
            runtime += ["--gpus", "1"] if args.runtime == "docker" else ["--device", "nvidia.com/gpu=all"]
            opts = ["--gpu"] + opts
        return runtime + [args.image] + opts
    exe = shutil.which("moe-smoke")
    return ([exe] if exe else [python, "-m", "moe_trainer.smoke"]) + opts


def format_verdict(doc: dict) -> str:
    """A readable verdict: one line per check, versions, the failure and its exception."""
    lines = []
    width = max([len(c["name"]) for c in doc["checks"]] + [10])
    for c in doc["checks"]:
        mark = "PASS" if c["passed"] else "FAIL"
        lines.append(f"  {mark}  {c['name']:<{width}} {c['seconds']:7.1f}s  {c['message']}")
    v = doc.get("versions") or {}
    stack = ", ".join(f"{k} {v[k]}" for k in ("deepspeed", "torch", "transformers", "cuda", "gpu") if v.get(k))
    head = [f"smoke test of {stack or 'unknown versions'} on {v.get('device', '?')} "
            f"({doc.get('worldSize', '?')} rank(s))"]
    if doc["passed"]:
        tail = [f"PASSED in {doc['durationSeconds']:.1f}s"]
    else:
        tail = [f"FAILED at check '{doc['failedCheck']}' after {doc['durationSeconds']:.1f}s"]
        if doc.get("exception"):
            tail += ["exception:"] + ["  " + x for x in doc["exception"].rstrip().splitlines()[-8:]]
    if doc.get("injected"):
        head.append(f"(fault injected: {doc['injected']})")
    return "\n".join(head + lines + tail)


def run_smoke(args: argparse.Namespace) -> int:
    cmd = smoke_command(args)
    if args.image and shutil.which(args.runtime) is None:
        print(f"moectl smoke: error: {args.runtime} is not installed (run without --image to use the "
              "local moe-smoke)", file=sys.stderr)
        return 2
    if args.verbose:
        print("+ " + " ".join(cmd), file=sys.stderr)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if args.verbose else subprocess.PIPE,
                           text=True, timeout=args.timeout + 60)
    except FileNotFoundError as exc:
        print(f"moectl smoke: error: cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"moectl smoke: error: no verdict after {args.timeout + 60:.0f}s", file=sys.stderr)
        return 1
    try:
        doc = parse_smoke_verdict(p.stdout)
    except GateError as exc:
        print(f"moectl smoke: error: {cmd[0]} exited with {p.returncode} and no verdict ({exc})",
              file=sys.stderr)
        if p.stderr:
            print("\n".join(p.stderr.rstrip().splitlines()[-20:]), file=sys.stderr)
        return 1
    if args.output:
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=2)
    print(json.dumps(doc, indent=2) if args.json else format_verdict(doc))
    return 0 if doc["passed"] and p.returncode == 0 else 1


def add_smoke(sub) -> None:
    p = sub.add_parser("smoke", help="run the DeepSpeed upgrade smoke test locally",
                       description="Run moe-smoke (ZeRO-3 + AutoEP on a tiny MoE: initialize, expert "
                                   "placement, train, checkpoint, FusedAdam) and print its verdict. "
                                   "Exit 0 passed, 1 failed, 2 usage.")
    p.add_argument("--image", help="run this trainer image with --runtime instead of the local moe-smoke")
    p.add_argument("--runtime", default="docker", choices=("docker", "podman"))
    p.add_argument("--cpu", action="store_true", help="CPU + gloo (2 ranks, EP size 2)")
    p.add_argument("--nproc", type=int, help="ranks (default: 2 on CPU, 1 on GPU)")
    p.add_argument("--steps", type=int, help="optimizer steps of the train check (default 6)")
    p.add_argument("--inject", choices=("native-moe", "nan"), help="fault injection, to see a failure")
    p.add_argument("--expect-deepspeed", metavar="VERSION", help="fail unless the image has this DeepSpeed")
    p.add_argument("--timeout", type=float, default=600, help="seconds (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the SmokeVerdict JSON instead")
    p.add_argument("-o", "--output", help="also write the SmokeVerdict JSON here")
    p.add_argument("-v", "--verbose", action="store_true", help="show the ranks' output")
    p.set_defaults(func=run_smoke)
