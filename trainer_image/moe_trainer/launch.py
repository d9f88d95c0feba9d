"""Start the ranks of one node: the worker pod's entry point, and local runs for tests/laptops.

In a worker pod ``moe-train`` is this launcher (``NPROC_PER_NODE`` is set, ``RANK`` is not: see
``moe_trainer.train.main``). It reads the pod's env (``NODE_RANK``, ``NNODES``,
``NPROC_PER_NODE``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) and the plan, and starts one
``python -m moe_trainer.train`` per rank the plan puts on this node rank, with torchrun-style env:

    RANK = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK,  LOCAL_RANK,  LOCAL_WORLD_SIZE = NPROC_PER_NODE

and the device the plan's ``ranks[RANK].gpu`` names (``moe_trainer.distenv``). The plan's GPU
index counts the GPUs this container sees, in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``):
with the NVIDIA device plugin the container sees only the GPUs it was given, renumbered from 0.

Process handling (``moe_trainer.gang``): output lines prefixed ``[rank<R>]``, SIGTERM/SIGINT
forwarded to every rank with a bounded grace period, the first rank that exits non-zero stops
the others and its code becomes the pod's (65/75/78 keep their meaning), one termination message
for the pod (``/dev/termination-log``: the first failing rank's TrainerExit document).

Local runs (tests, benchmarks):

    python -m moe_trainer.launch --nproc 2 -- --plan plan.json --checkpoint-dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_contracts import env as E
from moe_contracts.errors import DocumentError
from moe_contracts.exit import TERMINATION_LIMIT, exit_doc, parse_trainer_exit
from moe_trainer import gang

if TYPE_CHECKING:
    from moe_contracts.plan import RankSpec

log = logging.getLogger("moe_trainer.launch")

TRAINER = (sys.executable, "-m", "moe_trainer.train")
TERMINATION_LOG = "/dev/termination-log"
EXIT_CONFIG = 78


class LaunchError(ValueError):
    """The pod's env and the plan disagree (permanent: exit 78)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) of an AF_INET socket
        return port


def rank_env(
    base: dict[str, str], *, rank: int, local_rank: int, local_world: int, world: int
) -> dict[str, str]:
    """``base`` plus one rank's torchrun-style variables."""
    return dict(
        base,
        **{
            E.RANK: str(rank),
            E.LOCAL_RANK: str(local_rank),
            E.LOCAL_WORLD_SIZE: str(local_world),
            E.WORLD_SIZE: str(world),
        },
        PYTHONUNBUFFERED="1",
    )


# ---- local runs --------------------------------------------------------------------------------
def local_world_envs(nproc: int, base: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """The environments of ``nproc`` ranks of one world on this machine: ``base`` (default: this
    process's environment) with one rendezvous (``127.0.0.1`` and a free port) and each rank's
    torchrun-style variables; ``[r]`` is rank ``r``'s."""
    env = dict(os.environ if base is None else base)
    env.update({E.MASTER_ADDR: "127.0.0.1", E.MASTER_PORT: str(free_port())})
    env.pop(E.NPROC_PER_NODE, None)
    return [
        rank_env(env, rank=r, local_rank=r, local_world=nproc, world=nproc) for r in range(nproc)
    ]


def launch(
    nproc: int,
    trainer_args: list[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    log_prefix: str | None = None,
) -> list[int]:
    """Run ``nproc`` ranks of moe_trainer.train on this machine to completion; returns their exit
    codes by rank (128+N: killed by signal N). One failed rank stops the others. ``log_prefix``:
    each rank's output goes to ``<log_prefix>.rank<R>.log`` instead of this process's stdout."""
    envs = local_world_envs(nproc, env)
    logs = [f"{log_prefix}.rank{r}.log" for r in range(nproc)] if log_prefix else None
    res = gang.Gang(
        [[*TRAINER, *trainer_args]] * nproc, envs, log_paths=logs, timeout=timeout
    ).run()
    if res.timed_out:
        raise TimeoutError(f"trainer ranks still running after {timeout}s")
    codes = [c for c in res.codes if c is not None]
    if len(codes) != nproc:  # not reached: Gang.run waits for every rank unless it timed out
        raise RuntimeError(f"trainer ranks without an exit code: {res.codes}")
    return codes


# ---- the worker pod ----------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeRank:
    rank: int
    local_rank: int
    gpu: int | None


def _int(env: dict[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise LaunchError(f"{name} is not set")
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None


def node_ranks(
    env: dict[str, str], plan_ranks: Sequence[RankSpec], plan_world_size: int
) -> list[NodeRank]:
    """This node rank's ranks, by local rank, checked against the plan (``plan_ranks``: the
    trainer's ``RankSpec`` list, ordered by rank)."""
    nproc, node_rank = _int(env, E.NPROC_PER_NODE), _int(env, E.NODE_RANK)
    nnodes, world = _int(env, E.NNODES), _int(env, E.WORLD_SIZE)
    if nproc < 1 or nnodes < 1:
        raise LaunchError(f"NPROC_PER_NODE={nproc} and NNODES={nnodes} must be >= 1")
    if world != nnodes * nproc:
        raise LaunchError(f"WORLD_SIZE={world} is not NNODES x NPROC_PER_NODE = {nnodes} x {nproc}")
    if world != plan_world_size:
        raise LaunchError(f"WORLD_SIZE={world} differs from the plan's worldSize={plan_world_size}")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"NODE_RANK={node_rank} is outside 0..{nnodes - 1}")
    mine = sorted((r for r in plan_ranks if r.node_rank == node_rank), key=lambda r: r.local_rank)
    if len(mine) != nproc:
        raise LaunchError(
            f"the plan puts {len(mine)} rank(s) on node rank {node_rank}, NPROC_PER_NODE is {nproc}"
        )
    out = []
    for local, r in enumerate(mine):
        want = node_rank * nproc + local
        if r.local_rank != local or r.rank != want:
            raise LaunchError(
                f"plan ranks[{r.rank}] is local rank {r.local_rank} of node rank "
                f"{node_rank}; expected rank {want} = {node_rank} x {nproc} + {local}"
            )
        out.append(NodeRank(rank=r.rank, local_rank=local, gpu=r.gpu))
    gpus = [r.gpu for r in out if r.gpu is not None]
    if len(set(gpus)) != len(gpus):
        raise LaunchError(f"the plan gives node rank {node_rank} the GPUs {gpus}: one rank per GPU")
    return out


def write_termination_message(doc: dict[str, Any], path: str | None = None) -> None:
    """The pod's one termination message (the kubelet shows it in the container's status; the
    operator reads TrainerExit documents from it). Written only where the file exists: the kubelet
    creates it in a pod, a local run has none."""
    path = path or os.environ.get(E.TERMINATION_LOG) or TERMINATION_LOG
    if not os.path.exists(path):
        return
    text = json.dumps(doc)
    if len(text.encode()) > TERMINATION_LIMIT:
        doc = dict(doc, message=str(doc.get("message", ""))[-(TERMINATION_LIMIT // 2) :])
        text = json.dumps(doc)[:TERMINATION_LIMIT]
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        log.warning("termination message not written: %s", exc)


def failure_document(
    res: gang.Result,
    labels: Sequence[str],
    ranks: Sequence[NodeRank],
    node_rank: int,
    rank_docs: Sequence[str],
) -> dict[str, Any]:
    """TrainerExit v1 for the pod: the first failing rank's own document (``rank_docs[i]``: what it
    wrote to its termination file), its message prefixed with the gang's summary; a rank that
    wrote none (killed by a signal) gets cause ``Signalled`` (128 + N) or ``Unexpected``."""
    i = res.first_failure if res.first_failure is not None else 0
    summary = f"node rank {node_rank}: {res.describe(labels)}"
    try:
        doc = parse_trainer_exit(rank_docs[i])
    except DocumentError:
        code = res.exit_code
        tail = "\n".join(list(res.tails[i])[-5:]) if i < len(res.tails) else ""
        doc = exit_doc("Signalled" if code > 128 else "Unexpected", code, tail, rank=ranks[i].rank)
    return dict(
        doc,
        exitCode=res.exit_code,
        nodeRank=node_rank,
        message=f"{summary}: {doc.get('message', '')}"[-3000:],
    )


def node_main(argv: Sequence[str] | None = None) -> int:
    """``moe-train`` in a worker pod: the ranks of this node; returns the pod's exit code."""
    from moe_contracts.plan import PlanError, load_plan, resolve_plan_path

    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=os.environ.get("MOE_LOG_LEVEL", "INFO"),
        format="%(asctime)s launcher %(levelname)s %(message)s",
    )
    env = dict(os.environ)
    plan_arg = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--plan"), None)
    try:
        plan = load_plan(resolve_plan_path(plan_arg))
        ranks = node_ranks(env, plan.ranks, plan.world_size)
    except (PlanError, LaunchError) as exc:
        log.error("cannot start the ranks: %s", exc)
        write_termination_message(exit_doc("BadConfig", EXIT_CONFIG, f"launcher: {exc}"))
        return EXIT_CONFIG
    node_rank, nproc = int(env[E.NODE_RANK]), len(ranks)
    planned = plan.ranks[ranks[0].rank].node
    if env.get(E.NODE_NAME) and planned and env[E.NODE_NAME] != planned:
        log.warning(
            "node rank %d runs on node %s, the plan made it for %s: its GPU indices and "
            "NVLink groups are that node's",
            node_rank,
            env[E.NODE_NAME],
            planned,
        )
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    for name in (E.RANK, E.LOCAL_RANK, E.LOCAL_WORLD_SIZE):
        env.pop(name, None)
    envs = [
        rank_env(
            env, rank=r.rank, local_rank=r.local_rank, local_world=nproc, world=plan.world_size
        )
        for r in ranks
    ]
    labels = [f"rank{r.rank}" for r in ranks]
    cpu = "--cpu" in argv or plan.device == "cpu"  # as moe_trainer.train decides
    log.info(
        "node rank %d: starting %s",
        node_rank,
        ", ".join(
            f"rank {r.rank} (local {r.local_rank}, "
            f"{'CPU' if cpu or r.gpu is None else 'GPU ' + str(r.gpu)})"
            for r in ranks
        ),
    )
    # each rank reports its TrainerExit into a file of its own; the pod gets one message
    term_dir = Path(tempfile.mkdtemp(prefix="moe-launch-"))
    term_files = [term_dir / f"{label}.json" for label in labels]
    for f, e in zip(term_files, envs, strict=True):
        f.touch()
        e[E.TERMINATION_LOG] = str(f)
    try:
        res = gang.Gang([[*TRAINER, *argv]] * nproc, envs, labels=labels).run()
        rank_docs = [f.read_text(errors="replace") for f in term_files]
    finally:
        shutil.rmtree(term_dir, ignore_errors=True)
    summary = f"node rank {node_rank}: {res.describe(labels)}"
    (log.info if res.exit_code == 0 else log.error)("%s", summary)
    if res.exit_code != 0:
        write_termination_message(failure_document(res, labels, ranks, node_rank, rank_docs))
    return res.exit_code


def is_pod_entry(env: Mapping[str, str] | None = None) -> bool:
    """``moe-train`` started by a worker pod (node launcher) rather than as one rank."""
    env = os.environ if env is None else env
    return E.NPROC_PER_NODE in env and E.RANK not in env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("trainer_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.trainer_args[1:] if a.trainer_args[:1] == ["--"] else a.trainer_args
    codes = launch(a.nproc, args)
    print("exit codes:", codes)
    sys.exit(next((c for c in codes if c), 0))


if __name__ == "__main__":
    main()
