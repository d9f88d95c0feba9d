"""Rendezvous on CPU compiles nothing: DeepSpeed's shared-memory comm op is not built."""

import subprocess
import sys

SCRIPT = r'''
import os
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
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
'''


def test_cpu_rendezvous_skips_the_shm_build():
    from moe_trainer.launch import free_port
    out = subprocess.run([sys.executable, "-c", "import sys\n" + SCRIPT, str(free_port())], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "backend gloo nvls 0" in out.stdout
