"""Run one container's command as a local process in its own mount + UTS namespace.

``unshare --mount --uts --propagation private`` gives the process private bind mounts (volumes at
their real ``mountPath``, the agent's hosts file at /etc/hosts, the termination-message file) and
its own hostname, while it shares the host's network, PID space and filesystem otherwise. Needs
root. Mount points that do not exist on the host are created (and recorded, so the agent can
remove the empty ones when it stops).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from . import procs
from .podfiles import Mount


class SandboxError(RuntimeError):
    """The container cannot be started here (not root, no unshare, no command)."""


STATE_DIR = Path("/run/moe-localkube")


class MountTargets:
    """Host paths created as mount points, removed (when still empty) by the last agent to stop.

    Several agents (parallel test sessions) may share a mount point such as /etc/moe; removing it
    while another agent's container has it mounted would detach that container's volume. So the
    list of created paths and the set of live agents live in ``state_dir`` (under a file lock),
    and only the last live agent removes them.
    """

    def __init__(self, state_dir: Path = STATE_DIR) -> None:
        self.state_dir = state_dir
        self._agents = state_dir / "agents"
        self._agents.mkdir(parents=True, exist_ok=True)
        self._me = self._agents / f"{os.getpid()}-{secrets.token_hex(4)}"
        self._me.touch()
        self._list = state_dir / "targets"
        self._lock_path = state_dir / "lock"

    def _locked(self):
        f = open(self._lock_path, "a")  # noqa: SIM115 - returned: the caller's `with` closes it
        fcntl.flock(f, fcntl.LOCK_EX)
        return f

    def _record(self, path: Path) -> None:
        with self._locked(), open(self._list, "a") as f:
            f.write(f"{path}\n")

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
            self._record(d)
        if is_file:
            try:
                with open(path, "x"):
                    pass
            except FileExistsError:
                return
            self._record(path)

    @staticmethod
    def _alive(agent_file: Path) -> bool:
        try:
            os.kill(int(agent_file.name.split("-")[0]), 0)
            return True
        except (ValueError, ProcessLookupError):
            return False
        except PermissionError:
            return True

    def cleanup(self) -> None:
        with self._locked():
            self._me.unlink(missing_ok=True)
            if any(self._alive(a) for a in self._agents.iterdir()):
                return
            try:
                created = self._list.read_text().split("\n")
            except FileNotFoundError:
                return
            for line in reversed([c for c in created if c]):
                p = Path(line)
                try:
                    if p.is_dir() and not p.is_symlink():
                        p.rmdir()
                    elif p.is_file() and p.stat().st_size == 0:
                        p.unlink()
                except OSError:
                    pass
            self._list.write_text("")
            for stale in self._agents.iterdir():
                stale.unlink(missing_ok=True)


def check_host() -> None:
    if os.geteuid() != 0:
        raise SandboxError(
            "the node agent runs containers in mount namespaces and needs root "
            "(unshare --mount, mount --bind); run it as root, as CI does"
        )
    if not shutil.which("unshare") or not shutil.which("mount"):
        raise SandboxError("unshare/mount not found (Debian package util-linux / mount)")


def _under_other(target: str, mounts: list[Mount]) -> bool:
    return any(target != m.target and target.startswith(m.target.rstrip("/") + "/") for m in mounts)


# The packages whose source folders are part of the "image" under the node agent (an editable
# install points the venv at them).
# The product, and the dev package (pods here run from the venv, which has it: the fake NVML,
# the fault hooks).
IMAGE_PACKAGES = ("moejob_operator", "moe_trainer", "moe_localkube", "moe_fake_nvml", "moe_faults")


def image_paths() -> list[str]:
    """What stands in for the container image here: the agent's Python (venv and base
    installation), the project's package sources and PYTHONPATH. A volume mounted above one of
    them (the chart's /tmp emptyDir over a checkout or venv under /tmp) must not hide it."""
    paths = {
        sys.prefix,
        sys.base_prefix,
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    }
    for name in IMAGE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            paths.add(str(Path(loc).parent))
        if spec and spec.origin and not spec.submodule_search_locations:  # a plain module
            paths.add(str(Path(spec.origin).parent))
    return sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))


def launch(
    *,
    argv: list[str],
    env: dict[str, str],
    mounts: list[Mount],
    hostname: str,
    working_dir: str | None,
    log_path: Path,
    targets: MountTargets,
) -> subprocess.Popen:
    """Start ``argv`` in a new mount/UTS namespace with ``mounts`` bound; return the process."""
    if not argv:
        raise SandboxError(
            "the container has no command: the node agent ignores images, so "
            "command (and args) must name the program"
        )
    # Open every source before mounting anything: a volume at /tmp (the chart's emptyDir) would
    # otherwise hide sources that live under /tmp (the agent's run dir) from the mounts after it
    # (`mount` exit 32, a crash loop). `mount -c --bind /proc/self/fd/N` binds the opened file.
    lines = ["set -e"]
    for i, m in enumerate(mounts):
        lines.append(f"exec {{src{i}}}<{shlex.quote(str(m.source))}")
    # image paths a volume would hide: opened now, bound back over the volume after it
    hidden = [p for p in image_paths() if _under_other(p, mounts)]
    for j, p in enumerate(hidden):
        lines.append(f"exec {{img{j}}}<{shlex.quote(p)}")
    for i, m in enumerate(mounts):
        is_file = m.source.is_file()
        if not _under_other(m.target, mounts):
            targets.ensure(m.target, is_file)  # on the host: record it for cleanup
        q_dst = shlex.quote(m.target)
        if is_file:
            lines.append(f'[ -e {q_dst} ] || {{ mkdir -p "$(dirname {q_dst})"; : > {q_dst}; }}')
        else:
            lines.append(f"mkdir -p {q_dst}")
        lines.append(f'mount --no-canonicalize --bind "/proc/self/fd/${{src{i}}}" {q_dst}')
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {q_dst}")
    for j, p in enumerate(hidden):
        lines.append(f"mkdir -p {shlex.quote(p)}")
        lines.append(f'mount --no-canonicalize --bind "/proc/self/fd/${{img{j}}}" {shlex.quote(p)}')
    lines += [f"exec {{src{i}}}<&-" for i in range(len(mounts))]
    lines += [f"exec {{img{j}}}<&-" for j in range(len(hidden))]
    lines.append(f"hostname {shlex.quote(hostname[:63])}")
    if working_dir:
        lines.append(f"mkdir -p {shlex.quote(working_dir)} && cd {shlex.quote(working_dir)}")
    lines.append('exec "$@"')
    wrapper = [
        shutil.which("unshare") or "unshare",
        "--mount",
        "--uts",
        "--propagation",
        "private",
        "--",
        shutil.which("bash") or "/bin/bash",
        "-c",
        "\n".join(lines),
        "moe-pod",
        *argv,
    ]
    # die_with_parent: the pod worker thread outlives its containers (it kills them before it
    # ends), so the kernel's parent-death signal only fires if the whole agent process is killed.
    return procs.spawn(wrapper, log_path, env=env, cwd="/", die_with_parent=True)
