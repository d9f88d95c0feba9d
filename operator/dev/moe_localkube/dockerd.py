"""A private dockerd for image builds, and the wheelhouse it installs from. Test and dev
infrastructure (``moe_localkube.images``)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import http.server
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from . import procs


class ImageError(RuntimeError):
    """An image could not be built (the message names the log to read)."""


# ---------------------------------------------------------------- wheelhouse server


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # silence per-request logging
        pass


@contextlib.contextmanager
def serve_directory(directory: Path, port: int = 0):
    """Serve ``directory`` read-only on 127.0.0.1 (a ``--find-links`` page for pip); yield the
    URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- dockerd


def _cgroup_dirs(name: str) -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob(f"*/{name}") if p.is_dir()] + (
        [Path("/sys/fs/cgroup") / name] if (Path("/sys/fs/cgroup") / name).is_dir() else []
    )


def remove_cgroup_tree(top: Path) -> None:
    """rmdir ``top`` and everything below it, deepest first (cgroup dirs hold no files)."""
    if not top.is_dir():
        return
    for root, _dirs, _ in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(root)


def unmount_under(prefix: Path) -> list[str]:
    """Unmount every mount point at or below ``prefix`` (deepest first); return what was
    unmounted."""
    pre = os.path.realpath(str(prefix)).rstrip("/")  # /var/run/x is mounted as /run/x
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == pre or mp.startswith(pre + "/"):
                points.append(mp)
    done = []
    for mp in sorted(set(points), key=len, reverse=True):
        if subprocess.run(["umount", mp], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", mp], capture_output=True)
        done.append(mp)
    return done


class Dockerd:
    """A private dockerd: own data root (kept: the layer cache), socket and exec root (removed)."""

    CGROUP_PARENT = "moe-docker"

    def __init__(self, data_root: Path, log: Path):
        self.data_root = data_root
        self.log = log
        self.exec_root = Path(
            tempfile.mkdtemp(
                prefix="moe-dockerd-", dir="/run" if os.access("/run", os.W_OK) else None
            )
        )
        self.socket = self.exec_root / "docker.sock"
        self.host = f"unix://{self.socket}"
        self._proc: subprocess.Popen | None = None
        self._lock_fd: int | None = None

    def __enter__(self) -> Dockerd:
        for tool in ("dockerd", "docker", "containerd", "runc"):
            if not shutil.which(tool):
                raise ImageError(
                    f"{tool} not found: install Debian's docker.io, containerd and runc "
                    "(scripts/dev.sh setup does it)"
                )
        self.data_root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(
            self.data_root.parent / f".{self.data_root.name}.lock", os.O_CREAT | os.O_RDWR
        )
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # one dockerd per data root
        try:
            self._proc = procs.spawn(
                [
                    "dockerd",
                    "--data-root",
                    str(self.data_root),
                    "--exec-root",
                    str(self.exec_root),
                    "-H",
                    self.host,
                    "--pidfile",
                    str(self.exec_root / "dockerd.pid"),
                    "--iptables=false",
                    "--ip-forward=false",
                    "--ip-masq=false",
                    "--bridge=none",
                    "--storage-driver",
                    "overlay2",
                    "--cgroup-parent",
                    self.CGROUP_PARENT,
                    "--exec-opt",
                    "native.cgroupdriver=cgroupfs",
                    "--log-level",
                    "warn",
                ],
                self.log,
                die_with_parent=threading.current_thread() is threading.main_thread(),
            )
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise ImageError(f"dockerd exited with {self._proc.returncode}; log {self.log}")
                if self.socket.exists() and self.docker("version", check=False).returncode == 0:
                    return self
                time.sleep(0.2)
            raise ImageError(f"dockerd not answering after 60s; log {self.log}")
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            procs.stop(self._proc, grace_seconds=15)
            self._proc = None
        unmount_under(self.exec_root)
        unmount_under(self.data_root)
        shutil.rmtree(self.exec_root, ignore_errors=True)
        for d in _cgroup_dirs(self.CGROUP_PARENT):
            remove_cgroup_tree(d)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def docker(
        self, *args: str, check: bool = True, log: Path | None = None, input: bytes | None = None
    ) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "DOCKER_HOST": self.host,
            "DOCKER_BUILDKIT": "0",
            "DOCKER_CONFIG": str(self.exec_root / "client"),
        }
        if log is not None:
            with open(log, "ab") as f:
                res = subprocess.run(
                    ["docker", *args], env=env, stdout=f, stderr=subprocess.STDOUT, input=input
                )
        else:
            res = subprocess.run(["docker", *args], env=env, capture_output=True, input=input)
        if check and res.returncode != 0:
            where = f"; log {log}" if log else f": {res.stderr.decode(errors='replace')[-2000:]}"
            raise ImageError(f"docker {' '.join(args[:3])} ... exited {res.returncode}{where}")
        return res
