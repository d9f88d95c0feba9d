"""One rank of `moe-smoke`: run a phase's checks in order, record each result as it lands.

Phase ``train``: ``imports`` (versions, the process group), then per case the phase-1 checks of
:mod:`moe_trainer.gate.checks`; phase ``resume`` (new processes): per case ``resume``, then
``fused_adam``. The first failure stops the phase. The results go to a JSON file per rank and
phase, rewritten after every check, so the parent (`moe_trainer.gate.main`) reads them even when the
rank dies later.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from moe_contracts.gate import CASE_CHECKS
from moe_trainer.gate.checks import CaseRun, CheckFailed, fused_adam


class Recorder:
    """This rank's check results (and, per case, the golden summary of its steps), rewritten to
    `path` after every check."""

    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank
        self.checks: list[dict] = []
        self.versions: dict = {}
        self.golden: dict = {}
        self.exception: str | None = None
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        doc = {
            "rank": self.rank,
            "checks": self.checks,
            "versions": self.versions,
            "golden": self.golden,
            "exception": self.exception,
        }
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)

    def run(self, name: str, case: str | None, fn) -> bool:
        t0 = time.perf_counter()
        try:
            message = fn() or "ok"
            passed = True
        except Exception as exc:  # noqa: BLE001 - any failure is the verdict, not a crash
            passed = False
            message = f"{type(exc).__name__}: {exc}".strip()
            self.exception = "".join(traceback.format_exception(exc)[-6:])[-3000:]
        self.checks.append(
            {
                "name": name,
                "case": case,
                "passed": passed,
                "seconds": round(time.perf_counter() - t0, 3),
                "message": message[:1000],
            }
        )
        self.write()
        return passed


def versions(cpu: bool) -> dict:
    """Versions of the stack and, on GPU, what the operator keys GPU verdicts by."""
    import deepspeed
    import torch
    import transformers

    cuda = torch.cuda.is_available() and not cpu
    v = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }
    if cuda:
        major, minor = torch.cuda.get_device_capability(0)
        v["computeCapability"] = f"{major}.{minor}"
        v["driver"], v["cudaDriver"] = _driver_versions()
        try:
            nccl = torch.cuda.nccl.version()
            v["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except (RuntimeError, AttributeError):
            v["nccl"] = None
    return v


def _driver_versions() -> tuple[str | None, str | None]:
    """(driver version, the driver's CUDA version "12.8") from NVML; None where NVML is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        d = pynvml.nvmlSystemGetDriverVersion()
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        return (d.decode() if isinstance(d, bytes) else d), f"{cuda // 1000}.{cuda % 1000 // 10}"
    except Exception:  # noqa: BLE001 - NVML missing: the operator then matches GPU model + capability only
        return None, None


def run_phase(
    phase: str,
    plans: dict,
    workdir: Path,
    rec: Recorder,
    *,
    cpu: bool,
    expect_deepspeed: str | None,
    tolerances: str | None = None,
    only_case: str | None = None,
) -> bool:
    """All checks of one phase on this rank, stopping at the first failure."""
    from moe_trainer import distenv

    state: dict = {"tolerances": tolerances}

    def imports() -> str:
        v = versions(cpu)
        rec.versions = v
        if not cpu and v["device"] != "cuda":
            raise CheckFailed("no CUDA device is visible (run with --cpu to test on CPU)")
        if expect_deepspeed and v["deepspeed"] != expect_deepspeed:
            raise CheckFailed(
                f"the image has deepspeed {v['deepspeed']}, the job declares {expect_deepspeed}"
            )
        first = plans["cases"][0]["plan"]
        env = distenv.read_env(
            first["worldSize"], [r["gpu"] for r in first["ranks"]], force_cpu=cpu
        )
        distenv.set_cpu_threads(env)
        distenv.init_distributed(env, timeout_s=120)
        state["env"] = env
        return (
            f"deepspeed {v['deepspeed']}, torch {v['torch']}, transformers {v['transformers']}, "
            f"cuda {v['cuda']}"
            + (
                f", {v['gpu']} (compute capability {v['computeCapability']}, driver {v['driver']})"
                if v.get("gpu")
                else ""
            )
        )

    if phase == "train" and not rec.run("imports", None, imports):
        return False
    build = _start_fused_adam_build(state["env"]) if phase == "train" else None
    try:
        return _run_cases(phase, plans, workdir, rec, state, cpu, imports, only_case)
    finally:
        if build is not None:
            build.join(timeout=600)


def _start_fused_adam_build(env):
    """GPU, local rank 0: JIT-build FusedAdam (~47 s on a fresh H200) in the background while the
    cases train; the `fused_adam` check of phase 2 then loads it from the extensions cache. A
    failed build is reported there (it builds again and fails with the compiler's message)."""
    import threading

    if env.device.type != "cuda" or env.local_rank != 0:
        return None

    def build():
        try:
            from deepspeed.ops.op_builder import FusedAdamBuilder

            FusedAdamBuilder().load(verbose=False)
        except Exception:  # noqa: BLE001 - the fused_adam check reports it
            pass

    t = threading.Thread(target=build, name="fused-adam-build", daemon=True)
    t.start()
    return t


def _run_cases(phase, plans, workdir, rec, state, cpu, imports, only_case) -> bool:
    if phase == "resume":
        try:
            imports()
        except Exception as exc:  # noqa: BLE001 - reported as the first resume check

            def failed_start(exc=exc):
                raise exc

            return rec.run("resume", plans["cases"][0]["name"], failed_start)
    for case in plans["cases"]:
        if only_case and case["name"] != only_case:
            continue
        run = None

        def make(case=case):
            nonlocal run
            run = CaseRun(
                case["name"], case["plan"], workdir, state["env"], cpu, state["tolerances"]
            )
            return run

        try:
            if phase == "train":
                checks = [(CASE_CHECKS[0], lambda: getattr(make(), CASE_CHECKS[0])())]
                # `run` is late-bound on purpose: each check runs in this iteration, after make()
                checks += [(n, (lambda n=n: getattr(run, n)())) for n in CASE_CHECKS[1:]]  # noqa: B023
            else:
                checks = [("resume", lambda: make().resume())]
            for name, fn in checks:
                ok = rec.run(name, case["name"], fn)
                if name == "numerics" and run is not None and run.golden:
                    rec.golden[case["name"]] = run.golden
                    rec.write()
                if not ok:
                    return False
        finally:
            if run is not None:
                with contextlib.suppress(Exception):  # a failed case may leave no engine to close
                    run.close()
    if phase == "resume":
        return rec.run("fused_adam", None, lambda: fused_adam(state["env"]))
    return True
