"""What every ``realnode_*`` module shares: one real node's spec (``RealNodeSpec``, what the user
asks for) and its record while it runs (``RealNode``: directories, ports, processes), the error
type, running a host tool, and where machine-wide state lives. No host changes happen here.

The rooms of the real nodes (``moe_localkube.realnodes`` has the layout):
``realnode_net`` (bridge, CNI, iptables, pod network namespaces), ``realnode_host`` (sysctls and
host dirs saved by the first cluster of the machine and restored by the last; reaping what a dead
cluster left), ``realnode_containerd`` (a node's mount namespace, containerd, images),
``realnode_kubelet`` (a node's cgroup root, kubelet, readiness), ``realnodes`` (the cluster:
start and stop in order).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR = Path("/run/moe-localkube")  # locks and members shared by the clusters of a machine
HOST_DIR = Path("/var/lib/moe-localkube")  # per cluster: what holds mounts (kubelet volumes, ...)


class RealNodesError(RuntimeError):
    """A node did not come up (the message names the log to read)."""


@dataclass(frozen=True)
class RealNodeSpec:
    name: str
    fixture: str | None = "nvswitch-h100-8"  # None: a plain CPU node
    extra_labels: dict[str, str] = field(default_factory=dict)


@dataclass
class RealNode:
    """One node of a running cluster: its run dir, containerd socket, cgroup root, kubelet ports
    and the processes started for it."""

    spec: RealNodeSpec
    dir: Path
    socket: Path
    cgroup_root: str
    kubelet_port: int
    healthz_port: int
    containerd: subprocess.Popen | None = None
    kubelet: subprocess.Popen | None = None
    load_error: BaseException | None = None
    holder: subprocess.Popen | None = None  # keeps the node's private mount namespace
    root: Path | None = None  # containerd root (content store, snapshots)
    root_lock: int | None = None

    def in_namespace(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the node's mount namespace (``holder`` must be running)."""
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--", *argv]


def run(
    *argv: str, check: bool = True, input: bytes | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run a host tool; with ``check``, a non-zero exit raises ``RealNodesError`` with its
    stderr."""
    res = subprocess.run(list(argv), capture_output=True, input=input, timeout=timeout)
    if check and res.returncode != 0:
        raise RealNodesError(
            f"{' '.join(argv)} exited {res.returncode}: "
            f"{res.stderr.decode(errors='replace').strip()[-2000:]}"
        )
    return res


def tail(path: Path, n: int = 3000) -> str:
    """The last ``n`` bytes of a log, for an error message."""
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "<no log>"
