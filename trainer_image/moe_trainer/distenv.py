"""Rendezvous from torchrun-style env (no SSH, no `deepspeed` launcher) and device selection.

RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are read by `deepspeed.init_distributed`.
GPUs: NCCL, device = the plan's `ranks[rank].gpu` (else LOCAL_RANK), NCCL_NVLS_ENABLE=0 unless
the environment already sets it (NVLink SHARP multicast is left off on the lent machines).
CPU: gloo. DeepSpeed's TorchBackend JIT-builds a shared-memory all-reduce op (`deepspeed_shm_comm`)
at init; it serves only `inference_all_reduce`, never training, so on CPU the trainer skips the
build (MOE_DS_SHM_OP=1 restores it; the build is cached in TORCH_EXTENSIONS_DIR either way).
When it is built, a build killed half-way leaves torch's baton file
`<TORCH_EXTENSIONS_DIR>/deepspeed_shm_comm/lock`, and every later build waits on it forever:
the trainer builds under an flock of its own (released by the kernel when a builder dies), so a
baton found while holding that flock is stale and is removed.
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

_ARCH = re.compile(r"(\d+)\.(\d+)[a-z]*(\+PTX)?")


def deepspeed_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT op builder can read it. It parses entries as
    ``X.Y[+PTX]`` and raises on torch's arch-specific suffixes (``9.0a``, ``10.0f``:
    ``int("0a")``), which GPU images set; those entries become ``9.0`` / ``10.0`` (the ops
    DeepSpeed builds, FusedAdam and the like, use no arch-specific instructions). Other entries
    are kept."""
    if not value:
        return value
    out = []
    for entry in value.replace(" ", ";").split(";"):
        m = _ARCH.fullmatch(entry.strip())
        e = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else entry.strip()
        if e and e not in out:
            out.append(e)
    return ";".join(out)


def fix_arch_list_for_deepspeed() -> None:
    """Rewrite ``TORCH_CUDA_ARCH_LIST`` in this process (:func:`deepspeed_arch_list`) before a
    DeepSpeed op is JIT-built (:func:`init_distributed` does, on GPUs: the trainer, the smoke
    test's FusedAdam build and check, the export all start there)."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    fixed = deepspeed_arch_list(value)
    if fixed != value and fixed is not None:
        logging.getLogger(__name__).info(
            "TORCH_CUDA_ARCH_LIST %r -> %r for DeepSpeed", value, fixed
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed


class RendezvousError(RuntimeError):
    """Rendezvous env is missing or inconsistent with the plan (permanent: exit 78)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _int_env(name: str, default: int | None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise RendezvousError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise RendezvousError(f"{name}={raw!r} is not an integer") from None


def read_env(plan_world_size: int, rank_gpus: list[int | None], force_cpu: bool = False) -> DistEnv:
    world = _int_env("WORLD_SIZE", 1)
    rank = _int_env("RANK", 0)
    local_rank = _int_env("LOCAL_RANK", rank)
    if world != plan_world_size:
        raise RendezvousError(
            f"WORLD_SIZE={world} differs from the plan's worldSize={plan_world_size}"
        )
    if not 0 <= rank < world:
        raise RendezvousError(f"RANK={rank} is outside 0..{world - 1}")
    use_cuda = torch.cuda.is_available() and not force_cpu
    if use_cuda:
        planned = rank_gpus[rank] if rank < len(rank_gpus) else None
        gpu = planned if planned is not None else local_rank
        if gpu >= torch.cuda.device_count():
            raise RendezvousError(
                f"plan puts rank {rank} on GPU {gpu}, this pod sees "
                f"{torch.cuda.device_count()} GPU(s)"
            )
        return DistEnv(rank, world, local_rank, torch.device("cuda", gpu), "nccl")
    return DistEnv(rank, world, local_rank, torch.device("cpu"), "gloo")


log = logging.getLogger("moe_trainer.distenv")

SHM_OP_NAME = "deepspeed_shm_comm"


def _no_shm_op() -> None:
    return None


def extension_build_dir(name: str = SHM_OP_NAME) -> Path:
    """Where torch JIT-builds extension `name` (TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions/<py>_<acc>)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


_P = ParamSpec("_P")
_R = TypeVar("_R")


def guarded_build(build: Callable[_P, _R], build_dir: Path | None = None) -> Callable[_P, _R]:
    """`build` wrapped so that builders on this machine take turns under an flock next to the build
    dir, and a baton `lock` file found while holding it (left by a killed build) is removed."""

    def wrapped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        d = Path(build_dir) if build_dir is not None else extension_build_dir()
        d.mkdir(parents=True, exist_ok=True)
        with open(d.parent / f".{d.name}.moe-build.flock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                baton = d / "lock"
                if baton.exists():
                    log.warning(
                        "removing stale %s (a killed build left it; no trainer is building now)",
                        baton,
                    )
                    baton.unlink(missing_ok=True)
                return build(*args, **kwargs)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    return wrapped


def init_distributed(env: DistEnv, timeout_s: int = 600) -> None:
    """Start the process group (also for world size 1: DeepSpeed ZeRO needs one)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
        fix_arch_list_for_deepspeed()  # before any DeepSpeed op is JIT-built in this process
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    import deepspeed

    # Not `import deepspeed.comm.torch as m`: `deepspeed.comm` star-exports PyTorch as `torch`,
    # so that spelling binds the torch package instead of DeepSpeed's backend module.
    # Any: DeepSpeed has no type information (it is Any here too, see pyproject.toml).
    ds_torch_comm: Any = importlib.import_module("deepspeed.comm.torch")
    if env.device.type == "cpu" and os.environ.get("MOE_DS_SHM_OP", "0") != "1":
        ds_torch_comm.build_shm_op = _no_shm_op
    elif (
        env.device.type == "cpu"
        and getattr(ds_torch_comm.build_shm_op, "__name__", "") != "wrapped"
    ):
        ds_torch_comm.build_shm_op = guarded_build(ds_torch_comm.build_shm_op)
    deepspeed.init_distributed(
        dist_backend=env.backend,
        auto_mpi_discovery=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def set_cpu_threads(env: DistEnv) -> None:
    """Share the host's cores between the local ranks instead of oversubscribing them."""
    if env.device.type != "cpu":
        return
    local_world = _int_env("LOCAL_WORLD_SIZE", env.world_size)
    n = int(os.environ.get("MOE_CPU_THREADS", max(1, (os.cpu_count() or 1) // max(1, local_world))))
    torch.set_num_threads(n)
