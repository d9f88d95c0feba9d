"""Rendezvous on CPU compiles nothing: DeepSpeed's shared-memory comm op is not built."""

import os
import subprocess
import sys

SCRIPT = r"""
import os
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import deepspeed.ops.op_builder.cpu.comm as m
def refuse(self, *a, **k):
    raise SystemExit("ShareMemCommBuilder.load called")
m.ShareMemCommBuilder.load = refuse
import torch
from moe_trainer import distenv
env = distenv.read_env(1, [None], force_cpu=True)
distenv.init_distributed(env)
import torch.distributed as dist
print("backend", dist.get_backend(), "nvls", os.environ["NCCL_NVLS_ENABLE"])
dist.destroy_process_group()
"""


def test_cpu_rendezvous_skips_the_shm_build():
    from moe_trainer.launch import free_port

    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + SCRIPT, str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "backend gloo nvls 0" in out.stdout


SHM_ON = r"""
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1],
                  MOE_DS_SHM_OP="1")
lock = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "deepspeed_shm_comm", "lock")
import deepspeed.ops.op_builder.cpu.comm as m
def fake_load(self, *a, **k):
    print("load called, baton present:", os.path.exists(lock))
    return None
m.ShareMemCommBuilder.load = fake_load
from moe_trainer import distenv
distenv.init_distributed(distenv.read_env(1, [None], force_cpu=True))
import torch.distributed as dist
dist.destroy_process_group()
"""


def test_enabled_shm_op_build_clears_a_stale_baton(tmp_path):
    """MOE_DS_SHM_OP=1 with `deepspeed_shm_comm/lock` left by a killed build: the build goes ahead
    (here a fake `load`) instead of waiting forever on the baton."""
    from moe_trainer.launch import free_port

    stale = tmp_path / "deepspeed_shm_comm" / "lock"
    stale.parent.mkdir()
    stale.touch()
    out = subprocess.run(
        [sys.executable, "-c", SHM_ON, str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "load called, baton present: False" in out.stdout
    assert "removing stale" in out.stderr


def test_guarded_build_waits_for_a_live_builder(tmp_path):
    """Builders take turns: while another holds the flock, the baton is not touched and the build
    waits."""
    import fcntl
    import threading
    import time

    from moe_trainer.distenv import guarded_build

    d = tmp_path / "deepspeed_shm_comm"
    d.mkdir()
    (d / "lock").touch()  # a live builder's baton
    seen = []
    wrapped = guarded_build(lambda: seen.append((d / "lock").exists()) or "module", build_dir=d)
    holder = open(tmp_path / ".deepspeed_shm_comm.moe-build.flock", "a+")  # noqa: SIM115 - held, closed below
    fcntl.flock(holder, fcntl.LOCK_EX)
    result = []
    t = threading.Thread(target=lambda: result.append(wrapped()))
    t.start()
    time.sleep(0.5)
    assert seen == [] and (d / "lock").exists()  # still waiting, baton left alone
    (d / "lock").unlink()  # the live builder finishes: baton gone, flock released
    fcntl.flock(holder, fcntl.LOCK_UN)
    holder.close()
    t.join(10)
    assert result == ["module"] and seen == [False]
