"""Host state the real-node clusters of one machine share, and the cleanup of clusters that died.

The kubelet rewrites global sysctls at start (``vm.overcommit_memory``, ``kernel.panic``, ...)
and creates host directories (``/var/lib/kubelet``, ``/var/log/pods``, ...):
``SharedHostState`` saves them when the first cluster of the machine enters and restores them
when the last one leaves (members are tracked by pid under ``STATE_DIR``). A member whose process
is gone (SIGKILL, no ``stop()``) is reaped by the next cluster: ``reap_dead_cluster`` removes its
iptables rules, bridge and pod namespaces (``realnode_net``), mounts and cgroup roots.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .dockerd import remove_cgroup_tree, unmount_under
from .realnode import HOST_DIR, STATE_DIR
from .realnode_net import reap_free_bridges, reap_stale_rules

KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
HOST_PATHS = (
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet",
    "/var/log/pods",
    "/var/log/containers",
)


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


class SharedHostState:
    """Sysctls the kubelet rewrites are global: the first cluster of the machine saves them, the
    last one to stop restores them (members are tracked by pid under ``/run/moe-localkube``)."""

    def __init__(self, member: str, run_dir: Path | None = None):
        self.member = member
        self.run_dir = run_dir
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.lock_path = STATE_DIR / "host.lock"
        self.members_dir = STATE_DIR / "members"
        self.saved = STATE_DIR / "sysctl.saved.json"

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _live_members(self) -> list[Path]:
        out = []
        for p in self.members_dir.glob("*"):
            try:
                words = p.read_text().split()
                os.kill(int(words[0]), 0)
                out.append(p)
            except (OSError, ValueError, IndexError):
                # a member that died without stopping (SIGKILL): undo what it left
                with contextlib.suppress(Exception):
                    reap_dead_cluster(p.name, Path(words[1]) if len(words) > 1 else None)
                p.unlink(missing_ok=True)
        return out

    def enter(self) -> None:
        with self._locked():
            self.members_dir.mkdir(exist_ok=True)
            if not self._live_members() and self.saved.exists():
                self._restore()  # saved by clusters that all died without stopping
            if not self.saved.exists():
                values = {}
                for key in KUBELET_SYSCTLS:
                    with contextlib.suppress(OSError):
                        values[key] = _sysctl_path(key).read_text().strip()
                paths = {p: os.path.exists(p) for p in HOST_PATHS}
                self.saved.write_text(json.dumps({"sysctls": values, "paths": paths}))
            (self.members_dir / self.member).write_text(f"{os.getpid()}\n{self.run_dir or ''}\n")

    def leave(self) -> dict[str, str]:
        """Restore when this was the last member; return what was restored."""
        restored: dict[str, str] = {}
        with self._locked():
            (self.members_dir / self.member).unlink(missing_ok=True)
            if self._live_members() or not self.saved.exists():
                return restored
            return self._restore()

    def _restore(self) -> dict[str, str]:
        """Write the saved sysctls back and remove the host dirs the kubelets created (lock
        held)."""
        restored: dict[str, str] = {}
        saved = json.loads(self.saved.read_text())
        for key, value in saved.get("sysctls", {}).items():
            path = _sysctl_path(key)
            with contextlib.suppress(OSError):
                if path.read_text().strip() != value:
                    path.write_text(value)
                    restored[key] = value
        for p, existed in sorted(saved.get("paths", {}).items(), key=lambda kv: -len(kv[0])):
            if not existed and os.path.isdir(p):
                _remove_if_only_sockets(Path(p))
        self.saved.unlink(missing_ok=True)
        return restored


def _remove_if_only_sockets(path: Path) -> None:
    """Remove a host directory the kubelet created, if all it holds is sockets/empty dirs."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for f in files:
            fp = Path(root) / f
            if fp.is_socket():
                fp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.rmdir(root)


def mounts_under(prefix: Path) -> Iterator[str]:
    """Mount points at or below ``prefix`` (this process's mount namespace)."""
    pre = os.path.realpath(str(prefix)).rstrip("/")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if mp == pre or mp.startswith(pre + "/"):
                yield mp


def reap_dead_cluster(cluster_id: str, run_dir: Path | None) -> None:
    """Undo what a cluster whose process died without ``stop()`` left on the host (the next
    cluster of the machine calls this): its iptables rules, pod network namespaces and bridge
    (when its slot lock is free), mounts under its run dir, cgroup roots."""
    reap_stale_rules()
    reap_free_bridges()
    if run_dir is not None and str(run_dir).startswith(str(HOST_DIR) + "/"):
        unmount_under(run_dir)
        if not any(True for _ in mounts_under(run_dir)):
            shutil.rmtree(run_dir, ignore_errors=True)
    for d in Path("/sys/fs/cgroup").glob(f"*/moe-{cluster_id}-*"):
        remove_cgroup_tree(d)
