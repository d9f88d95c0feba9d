"""Start N local trainer processes with torchrun-style env (tests, laptops; not used in pods).

    python -m moe_trainer.launch --nproc 2 -- --plan plan.json --checkpoint-dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, trainer_args: list[str], env: dict | None = None, timeout: float | None = None,
           log_prefix: str | None = None) -> list[int]:
    """Run `nproc` ranks of moe_trainer.train to completion; returns their exit codes by rank.
    If one rank fails, the others are killed (a real gang would be restarted as a whole)."""
    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc))
    procs = []
    for rank in range(nproc):
        e = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        out = open(f"{log_prefix}.rank{rank}.log", "w") if log_prefix else None
        procs.append((subprocess.Popen([sys.executable, "-m", "moe_trainer.train", *trainer_args], env=e,
                                       stdout=out, stderr=subprocess.STDOUT if out else None), out))
    codes: list[int | None] = [None] * nproc
    import time
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(c is None for c in codes):
            for i, (p, _) in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                time.sleep(2)      # give the others a moment to exit on their own
                for i, (p, _) in enumerate(procs):
                    if p.poll() is None:
                        p.kill()
                    codes[i] = p.wait()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"trainer ranks still running after {timeout}s")
            time.sleep(0.2)
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if out:
                out.close()
    return [int(c) for c in codes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("trainer_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.trainer_args[1:] if a.trainer_args[:1] == ["--"] else a.trainer_args
    codes = launch(a.nproc, args)
    print("exit codes:", codes)
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
