"""`moe-smoke`: short real ZeRO-3 + AutoEP runs of the planner's own plans, checking what
DeepSpeed / torch / transformers upgrades break.

The operator's upgrade gate runs it as a Job before the first launch on a trainer image it has
not verified (docs/gate.md); `moectl smoke` runs it on a workstation. Its input is a `SmokePlans`
document (docs/contracts.md): one `MoEPlan` per case, rendered by the operator's planning core
exactly as for a job (`moejob_operator.core.smoke_plans`), mounted at /etc/moe-smoke/plans.json.
The cases cover every model family the planner supports, gradient accumulation, activation
checkpointing, the per-layer balancing loss and (on CPU) EP < world.

Two phases of rank processes (torchrun-style env, no launcher; `moe_trainer.gate.runner`):
  train   imports, then per case: capabilities, initialize, partition, permutation, numerics,
          dispatch, checkpoint
  resume  new processes, per case: load the checkpoint and continue; then fused_adam
(`moe_trainer.gate.checks` describes each check). The run stops at the first failure.

Verdict (docs/contracts.md, `SmokeVerdict` v3): JSON on stdout (and `--output`), compacted into
`/dev/termination-log` when that file exists (the kubelet creates it), so the operator reads the
verdict from the pod status. It carries each case's golden values (per step: loss, gradient norm,
per-group update norms); with ``--golden`` (the values of the last image that passed on the same
plans and hardware, which the operator keeps) also their drift. Exit code 0 passed, 1 failed,
2 usage.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from moe_contracts import env
from moe_contracts.errors import DocumentError
from moe_contracts.gate import (
    SMOKE_KIND,
    SMOKE_VERSION,
    expected_checks,
    golden_drift,
    parse_smoke_golden,
    parse_smoke_plans,
)
from moe_trainer.gang import Gang
from moe_trainer.launch import free_port, rank_env

DEFAULT_PLANS = env.SMOKE_PLANS_PATH
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LIMIT = 4096  # bytes the kubelet keeps of a termination message
EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "did not finish this check")


class PlansError(ValueError):
    """The SmokePlans document is missing or invalid."""


def read_plans(path: str) -> dict:
    """A SmokePlans v1 document (``moe_contracts.gate.parse_smoke_plans``: every case a MoEPlan
    the trainer's reader accepts, one world size)."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlansError(
            f"cannot read the smoke plans {path}: {exc.strerror or exc} (the operator mounts "
            "them; locally `moectl smoke` renders them)"
        ) from None
    except ValueError as exc:
        raise PlansError(f"{path}: not JSON ({exc})") from None
    try:
        parse_smoke_plans(doc)
    except DocumentError as exc:
        raise PlansError(f"{path}: {exc}") from None
    return doc


def worker_main(args: argparse.Namespace) -> int:
    import logging
    import warnings

    from moe_trainer.gate.runner import Recorder, run_phase

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=os.environ.get("MOE_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s smoke rank{os.environ.get('RANK', '0')} %(levelname)s %(message)s",
    )
    warnings.filterwarnings("ignore")
    rank = int(os.environ.get("RANK", "0"))
    rec = Recorder(Path(args.workdir) / f"{args.phase}-rank{rank}.json", rank)
    plans = json.loads(Path(args.plans).read_text())
    ok = run_phase(
        args.phase,
        plans,
        Path(args.workdir),
        rec,
        cpu=args.cpu,
        expect_deepspeed=args.expect_deepspeed,
        tolerances=args.tolerances,
    )
    return EXIT_PASS if ok else EXIT_FAIL


# ---- the parent: start the ranks, merge their results into one verdict ---------------------
def run_ranks(
    args: argparse.Namespace, nproc: int, phase: str, timeout: float
) -> tuple[list[int | None], list[collections.deque], bool]:
    """Start `nproc` worker ranks of `phase` (``moe_trainer.gang``: output prefixed
    ``[<phase> rank<R>]`` on stderr; when one rank fails the others are stopped after a few
    seconds: they may wait forever in a collective the failed rank never joins); returns exit
    codes (128+N: killed by signal N), output tails, and whether the timeout hit."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = (
        [
            sys.executable,
            "-m",
            "moe_trainer.gate.main",
            "--worker",
            phase,
            "--workdir",
            args.workdir,
            "--plans",
            args.plans,
        ]
        + (["--cpu"] if args.cpu else [])
        + (["--expect-deepspeed", args.expect_deepspeed] if args.expect_deepspeed else [])
        + (["--tolerances", args.tolerances] if args.tolerances else [])
    )
    envs = [
        rank_env(env, rank=r, local_rank=r, local_world=nproc, world=nproc) for r in range(nproc)
    ]
    res = Gang(
        [cmd] * nproc,
        envs,
        labels=[f"{phase} rank{r}" for r in range(nproc)],
        out=sys.stderr,
        timeout=timeout,
    ).run()
    return res.codes, res.tails, res.timed_out


def merge(
    results: list[dict | None],
    codes: list[int | None],
    tails: list,
    timed_out: bool,
    timeout: float,
    duration: float,
    expected: list[tuple[str, str | None]],
) -> dict:
    """One SmokeVerdict from the ranks' check lists (both phases concatenated per rank): a check
    passed when every rank passed it; `expected` is the (check, case) list of a passing run."""
    checks, failed, exception = [], None, None
    for name, case in expected:
        entries = [
            (r, c)
            for r, res in enumerate(results)
            for c in (res or {}).get("checks", ())
            if c["name"] == name and c.get("case") == case
        ]
        if not entries:
            break
        bad = [(r, c) for r, c in entries if not c["passed"]]
        if len(entries) < len(results) and not bad:
            missing = sorted(set(range(len(results))) - {r for r, _ in entries})
            bad = [(r, {"message": "did not finish this check"}) for r in missing]
        if bad:
            # the rank that broke, not one that lost its peer because of it
            r, c = min(bad, key=lambda rc: (any(s in rc[1]["message"] for s in _PEER_LOST), rc[0]))
            msg = c["message"] if len(results) == 1 else f"rank {r}: {c['message']}"
            checks.append(
                {
                    "name": name,
                    "case": case,
                    "passed": False,
                    "seconds": max(x["seconds"] for _, x in entries),
                    "message": msg,
                }
            )
            failed = (name, case)
            exception = (results[r] or {}).get("exception")
            break
        main = entries[0][1]
        checks.append(
            {
                "name": name,
                "case": case,
                "passed": True,
                "seconds": max(c["seconds"] for _, c in entries),
                "message": main["message"],
            }
        )
    if failed is None and len(checks) < len(expected):
        failed = expected[len(checks)]
        dead = [(r, c) for r, c in enumerate(codes) if c != 0]
        r, code = dead[0] if dead else (0, None)
        why = (
            f"timed out after {timeout:.0f}s" if timed_out else f"rank {r} exited with code {code}"
        )
        checks.append(
            {
                "name": failed[0],
                "case": failed[1],
                "passed": False,
                "seconds": 0.0,
                "message": f"{why} before finishing this check",
            }
        )
        exception = "\n".join(list(tails[r])[-15:])[-3000:] if tails else None
    versions = next((res["versions"] for res in results if res and res.get("versions")), {})
    golden = (results[0] or {}).get("golden") if results else None
    return {
        "kind": SMOKE_KIND,
        "version": SMOKE_VERSION,
        "passed": failed is None,
        "failedCheck": failed[0] if failed else None,
        "failedCase": failed[1] if failed else None,
        "cases": [c for c in dict.fromkeys(case for _, case in expected) if c],
        "checks": checks,
        "exception": exception,
        "versions": versions,
        "worldSize": len(results),
        "durationSeconds": round(duration, 2),
        "golden": golden or None,
    }


def compact(verdict: dict, limit: int = TERMINATION_LIMIT) -> str:
    """The verdict as JSON of at most `limit` bytes: trims the exception, then check messages."""
    v = json.loads(json.dumps(verdict))
    text = json.dumps(v, separators=(",", ":"))
    for cap in (2000, 1000, 400, 160, 60, 0):
        if len(text.encode()) <= limit:
            return text
        if v.get("exception"):
            v["exception"] = v["exception"][-cap:] if cap else None
        for c in v["checks"]:
            if not c["passed"] and len(c["message"]) > max(cap, 200):
                c["message"] = c["message"][: max(cap, 200)]
            elif c["passed"]:
                c["message"] = c["message"][:cap]
        text = json.dumps(v, separators=(",", ":"))
    for key in ("goldenDrift", "golden"):  # the drift is in the numerics messages as well
        if len(text.encode()) <= limit:
            return text
        v[key] = None
        text = json.dumps(v, separators=(",", ":"))
    return text[:limit] if len(text.encode()) > limit else text


def read_golden(path: str) -> dict:
    """A SmokeGolden v1 document (``moe_contracts.gate.parse_smoke_golden``)."""
    try:
        return parse_smoke_golden(Path(path).read_text())
    except OSError as exc:
        raise PlansError(f"cannot read the golden values {path}: {exc.strerror or exc}") from None
    except DocumentError as exc:
        raise PlansError(f"{path}: {exc}") from None


def add_drift(verdict: dict, golden: dict) -> None:
    """The drift of this run's golden values from ``golden`` (the last image that passed the same
    plans on the same hardware): in the verdict, and appended to each case's numerics message."""
    drift = golden_drift(verdict.get("golden"), golden["cases"])
    against = golden.get("against") or {}
    who = against.get("digest") or against.get("image") or "?"
    verdict["goldenDrift"] = {"against": against, "cases": drift}
    for c in verdict["checks"]:
        d = drift.get(c.get("case") or "")
        if c["name"] == "numerics" and d:
            c["message"] += (
                f"; drift from the golden values of {who} ({against.get('verifiedAt', '?')}): "
                f"loss {d['loss']:.2g}, gradient norm {d['gradNorm']:.2g}, update norms "
                f"{d['update']:.2g} (largest relative change over the steps)"
            )


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moe-smoke", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--plans",
        default=DEFAULT_PLANS,
        help="SmokePlans document (default %(default)s; `moectl smoke` renders one)",
    )
    ap.add_argument("--cpu", action="store_true", help="CPU + gloo even when a GPU is present")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="fail unless a GPU is used (no silent CPU fallback; the operator's GPU smoke Job)",
    )
    ap.add_argument(
        "--expect-deepspeed", metavar="VERSION", help="fail unless this DeepSpeed is installed"
    )
    ap.add_argument("--output", "-o", help="also write the verdict JSON here")
    ap.add_argument(
        "--termination-log",
        default=TERMINATION_LOG,
        help="compact verdict here when the file exists (default %(default)s)",
    )
    ap.add_argument(
        "--timeout", type=float, default=600, help="seconds before the ranks are killed"
    )
    ap.add_argument("--workdir", help="scratch dir (checkpoints, rank results); default a temp dir")
    ap.add_argument(
        "--golden",
        metavar="FILE",
        help="SmokeGolden values of the last image that passed these plans on this hardware: "
        "the verdict reports the drift from them (the operator mounts them when it has some)",
    )
    ap.add_argument(
        "--tolerances",
        metavar="FILE",
        help="a SmokeTolerances table instead of the packaged one (benchmarks/smoke_tolerances.py "
        "measures the spread of correct runs with unbounded ones)",
    )
    ap.add_argument("--worker", choices=("train", "resume"), help=argparse.SUPPRESS)
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_PASS
    if args.worker:
        args.phase = args.worker
        return worker_main(args)

    t0 = time.perf_counter()
    if args.cpu and args.gpu:
        print("moe-smoke: error: --cpu and --gpu exclude each other", file=sys.stderr)
        return EXIT_USAGE
    try:
        plans = read_plans(args.plans)
        golden = read_golden(args.golden) if args.golden else None
    except PlansError as exc:
        print(f"moe-smoke: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.cpu and not args.gpu and not _cuda_visible():
        print("moe-smoke: no GPU visible: running on CPU (gloo)", file=sys.stderr)
        args.cpu = True
    if args.cpu != (plans.get("device") == "cpu"):
        print(
            f"moe-smoke: error: the plans are for device {plans.get('device')!r}, this run is on "
            f"{'cpu' if args.cpu else 'cuda'}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    nproc = plans["cases"][0]["plan"]["worldSize"]
    expected = expected_checks([c["name"] for c in plans["cases"]])
    with tempfile.TemporaryDirectory(prefix="moe-smoke-") as tmp:
        args.workdir = args.workdir or tmp
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        results: list[dict | None] = [None] * nproc
        tails: list = []
        codes: list = []
        timed_out = False
        for phase in ("train", "resume"):
            left = args.timeout - (time.perf_counter() - t0)
            codes, tails, timed_out = run_ranks(args, nproc, phase, max(left, 1.0))
            for r in range(nproc):
                try:
                    doc = json.loads((Path(args.workdir) / f"{phase}-rank{r}.json").read_text())
                except (OSError, ValueError):
                    continue
                if results[r] is None:
                    results[r] = doc
                else:
                    results[r]["checks"] += doc["checks"]
                    results[r]["exception"] = doc["exception"] or results[r]["exception"]
            if any(c != 0 for c in codes):
                break
    verdict = merge(
        results, codes, tails, timed_out, args.timeout, time.perf_counter() - t0, expected
    )
    if golden is not None:
        add_drift(verdict, golden)
    text = json.dumps(verdict, indent=2)
    print(text, flush=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    term = Path(args.termination_log)
    if term.exists():
        try:
            term.write_text(compact(verdict))
        except OSError as exc:
            print(f"moe-smoke: cannot write {term}: {exc}", file=sys.stderr)
    return EXIT_PASS if verdict["passed"] else EXIT_FAIL


def _cuda_visible() -> bool:
    """Without importing torch in the parent (keeps its memory and start-up small)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def main(argv=None) -> None:
    code = run(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
