"""Run one container's command as a local process in its own mount + UTS namespace.

``unshare --mount --uts --propagation private`` gives the process private bind mounts (volumes at
their real ``mountPath``, the agent's hosts file at /etc/hosts, the termination-message file) and
its own hostname, while it shares the host's network, PID space and filesystem otherwise. Needs
root. Mount points that do not exist on the host are created (and recorded, so the agent can
remove the empty ones when it stops).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

from . import procs
from .podfiles import Mount


class SandboxError(RuntimeError):
    """The container cannot be started here (not root, no unshare, no command)."""


class MountTargets:
    """Host paths created as mount points; removed (when still empty) by ``cleanup``."""

    def __init__(self) -> None:
        self._created: list[Path] = []
        self._lock = threading.Lock()

    def ensure(self, target: str, is_file: bool) -> None:
        path = Path(target)
        if path.exists() or path.is_symlink():
            return
        missing = []
        p = path if not is_file else path.parent
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            with self._lock:
                self._created.append(d)
        if is_file:
            try:
                with open(path, "x"):
                    pass
            except FileExistsError:
                return
            with self._lock:
                self._created.append(path)

    def cleanup(self) -> None:
        with self._lock:
            created, self._created = self._created, []
        for p in reversed(created):
            try:
                if p.is_dir() and not p.is_symlink():
                    p.rmdir()
                elif p.is_file() and p.stat().st_size == 0:
                    p.unlink()
            except OSError:
                pass


def check_host() -> None:
    if os.geteuid() != 0:
        raise SandboxError("the node agent runs containers in mount namespaces and needs root "
                           "(unshare --mount, mount --bind); run it as root, as CI does")
    if not shutil.which("unshare") or not shutil.which("mount"):
        raise SandboxError("unshare/mount not found (Debian package util-linux / mount)")


def _under_other(target: str, mounts: list[Mount]) -> bool:
    return any(target != m.target and target.startswith(m.target.rstrip("/") + "/") for m in mounts)


def launch(*, argv: list[str], env: dict[str, str], mounts: list[Mount], hostname: str,
           working_dir: str | None, log_path: Path, targets: MountTargets) -> subprocess.Popen:
    """Start ``argv`` in a new mount/UTS namespace with ``mounts`` bound; return the process."""
    if not argv:
        raise SandboxError("the container has no command: the node agent ignores images, so "
                           "command (and args) must name the program")
    lines = ["set -e"]
    for m in mounts:
        is_file = m.source.is_file()
        if not _under_other(m.target, mounts):
            targets.ensure(m.target, is_file)      # on the host: record it for cleanup
        q_src, q_dst = shlex.quote(str(m.source)), shlex.quote(m.target)
        if is_file:
            lines.append(f"[ -e {q_dst} ] || {{ mkdir -p \"$(dirname {q_dst})\"; : > {q_dst}; }}")
        else:
            lines.append(f"mkdir -p {q_dst}")
        lines.append(f"mount --bind {q_src} {q_dst}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {q_dst}")
    lines.append(f"hostname {shlex.quote(hostname[:63])}")
    if working_dir:
        lines.append(f"mkdir -p {shlex.quote(working_dir)} && cd {shlex.quote(working_dir)}")
    lines.append('exec "$@"')
    wrapper = [shutil.which("unshare") or "unshare", "--mount", "--uts", "--propagation", "private", "--",
               "/bin/sh", "-c", "\n".join(lines), "moe-pod", *argv]
    return procs.spawn(wrapper, log_path, env=env, cwd="/")
