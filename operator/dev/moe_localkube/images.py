"""Container images from the repository's Dockerfiles, built on this machine without Docker Hub.
Test and dev infrastructure, not product.

    builder = ImageBuilder()
    images = builder.build_all()          # {"operator": BuiltImage, "trainer": BuiltImage}
    images["trainer"].tar                 # `docker save` archive, ready for `ctr images import`

How (docs/localkube.md, "Real nodes"):

- **Base image**: a Debian bookworm root filesystem made with ``mmdebstrap`` (minbase + python3,
  python3-venv, ca-certificates, passwd; a venv at ``/usr/local/py`` first on ``PATH``, so
  ``pip``/``python`` behave as in the ``python:*-slim`` image), imported with ``docker import``
  and passed to both Dockerfiles as ``--build-arg BASE_IMAGE=...``. The Dockerfiles keep their
  public default bases for users. ``extra_ca_certs`` (optional, default none) adds certificates
  (e.g. ``/usr/local/share/ca-certificates/*.crt`` of a TLS-inspecting network) to that base.
- **Python packages**: ``pip download`` on the host (whatever index the host's pip uses) into a
  wheelhouse, served read-only on a loopback port while the build runs; the builds see it through
  the Dockerfiles' ``PIP_NO_INDEX``/``PIP_FIND_LINKS`` build arguments (``--network host``). The
  trainer's ``torch==2.13.0`` then resolves to the wheelhouse's CPU build (``2.13.0+cpu``):
  that is the CPU variant the tests run.
- **dockerd** (Debian's ``docker.io``) runs only while something must be built, with its own
  data root (a cache: its layer cache survives), socket and exec root, and without touching the
  host's network (``--iptables=false --ip-forward=false --bridge=none``); builds use the host
  network. Its cgroups live under ``/moe-docker`` and are removed when it stops.
- **Cache by content**: every image's key hashes what goes into it (Dockerfile, the files it
  COPYs, the base image key, the wheelhouse). A key whose ``docker save`` archive is in the cache
  costs no build and no dockerd: a rerun takes seconds.

The cache lives in ``$XDG_CACHE_HOME/moe-operator/images`` (default ``~/.cache/...``); concurrent
builders share it (a lock per dockerd data root; archives are written atomically).
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import functools
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import binaries, procs

REPO_ROOT = binaries.REPO_ROOT
DOCKERFILES = {
    "operator": REPO_ROOT / "Dockerfile",
    "trainer": REPO_ROOT / "trainer_image" / "Dockerfile",
}
# Tags the tests and examples use; every image also gets a content tag (``:<key>``).
DEFAULT_TAGS = {"operator": ("moe-operator:local",), "trainer": ("moe-trainer:local",)}
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
BASE_SUITE = "bookworm"
BASE_VENV = "/usr/local/py"
PAUSE_IMAGE = "localhost/moe-pause:" + binaries.KUBE_VERSION
SKIP_PARTS = {"__pycache__", ".pytest_cache"}


class ImageError(RuntimeError):
    """An image could not be built (the message names the log to read)."""


def images_cache_dir() -> Path:
    return binaries.cache_root() / "images"


def debian_mirror() -> str:
    """The Debian mirror apt uses on this host (deb822 or one-line sources), else deb.debian.org."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        m = re.search(r"^URIs:\s*(\S+)", path.read_text(), re.MULTILINE)
        if m and "security" not in m.group(1):
            return m.group(1)
    try:
        m = re.search(
            r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+",
            Path("/etc/apt/sources.list").read_text(),
            re.MULTILINE,
        )
        if m:
            return m.group(1)
    except OSError:
        pass
    return "http://deb.debian.org/debian"


def _sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_PARTS and not d.endswith(".egg-info"))
        out += [Path(root) / f for f in sorted(files) if not f.endswith(".pyc")]
    return out


def copied_sources(dockerfile: Path) -> list[str]:
    """The build-context paths a Dockerfile COPYs or ADDs (``--from=`` copies excluded)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        words = line.split()
        if (
            len(words) >= 3
            and words[0].upper() in ("COPY", "ADD")
            and not any(w.startswith("--from=") for w in words)
        ):
            out += [w for w in words[1:-1] if not w.startswith("--")]
    return out


def dockerfile_pins() -> list[str]:
    """``name==version`` arguments of the Dockerfiles' ``pip install`` commands."""
    out = []
    for path in DOCKERFILES.values():
        for cmd in re.findall(r"pip install([^&]*)", re.sub(r"\\\n", " ", path.read_text())):
            out += [
                w.strip('"') for w in cmd.split() if re.fullmatch(r'"?[A-Za-z0-9_.-]+==[^ "]+"?', w)
            ]
    return sorted(set(out))


def dockerignore(context: Path = REPO_ROOT) -> list[str]:
    try:
        lines = (context / ".dockerignore").read_text().splitlines()
    except OSError:
        return []
    return [ln.strip().rstrip("/") for ln in lines if ln.strip() and not ln.startswith(("#", "!"))]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """The subset of .dockerignore matching used here: a pattern matches the path or a parent."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(
        fnmatch.fnmatch(p, pat)
        or fnmatch.fnmatch(p, pat.removeprefix("**/"))
        or (fnmatch.fnmatch(parts[i - 1], pat.removeprefix("**/")) and pat.startswith("**/"))
        for pat in patterns
        for i, p in enumerate(prefixes, 1)
    )


def context_digest(dockerfile: Path, context: Path = REPO_ROOT) -> str:
    """Hash of the Dockerfile and every file it copies from ``context`` (names and contents),
    without what ``.dockerignore`` keeps out of the build context."""
    ignore = dockerignore(context)
    parts: list[bytes | str] = [dockerfile.read_bytes(), "\n".join(ignore)]
    for src in copied_sources(dockerfile):
        for f in _files_under(context / src):
            rel = str(f.relative_to(context))
            if not _ignored(rel, ignore):
                parts += [rel, f.read_bytes()]
    return _sha(*parts)


@dataclass
class BuiltImage:
    name: str
    key: str  # content key (sha256 hex)
    tar: Path  # `docker save` archive of every tag
    tags: tuple[str, ...]
    seconds: float = 0.0  # time spent here (0-ish on a cache hit)
    cached: bool = False

    @property
    def ref(self) -> str:  # the content tag
        return self.tags[0]


@dataclass
class BuildReport:
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    cached: dict[str, bool] = field(default_factory=dict)


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


# ---------------------------------------------------------------- pause image (no docker)


def _tar_bytes(members: list[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pause_image_tar(dst: Path, pause_binary: Path, ref: str = PAUSE_IMAGE) -> Path:
    """A ``docker save``-format archive of the sandbox image: ``FROM scratch`` + the static
    ``pause`` binary, user 65535 (what upstream's pause image is), written without docker."""
    layer = _tar_bytes([("pause", pause_binary.read_bytes(), 0o755)])
    layer_id = hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
            "history": [{"created_by": "moe_localkube.images.pause_image_tar"}],
        },
        sort_keys=True,
    ).encode()
    config_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps(
        [{"Config": f"{config_id}.json", "RepoTags": [ref], "Layers": [f"{layer_id}/layer.tar"]}]
    ).encode()
    data = _tar_bytes(
        [
            (f"{layer_id}/layer.tar", layer, 0o644),
            (f"{config_id}.json", config, 0o644),
            ("manifest.json", manifest, 0o644),
        ]
    )
    _write_atomic(dst, data)
    return dst


def archive_paths(tar: Path) -> set[str]:
    """Every file path in the image a ``docker save`` archive holds (the union of its layers'
    members, whiteouts not applied: a path any layer added counts), read without docker."""
    out: set[str] = set()
    with tarfile.open(tar) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))
        for image in manifest:
            for layer in image["Layers"]:
                with tarfile.open(fileobj=outer.extractfile(layer), mode="r|*") as inner:
                    out.update(m.name for m in inner if not m.isdir())
    return out


def _write_atomic(dst: Path, data: bytes) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dst)


# ---------------------------------------------------------------- builder


class ImageBuilder:
    """Builds the base, operator and trainer images (cached by content); see the module doc."""

    def __init__(
        self,
        cache_dir: Path | None = None,
        *,
        log_dir: Path | None = None,
        extra_ca_certs: list[Path] | None = None,
        mirror: str | None = None,
    ):
        self.cache_dir = Path(cache_dir) if cache_dir else images_cache_dir()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(log_dir) if log_dir else self.cache_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.extra_ca_certs = sorted(Path(p) for p in (extra_ca_certs or ()))
        self.mirror = mirror or debian_mirror()
        self.report = BuildReport()
        self._dockerd: Dockerd | None = None
        self._stack = contextlib.ExitStack()

    # ---- keys
    def base_key(self) -> str:
        return _sha(
            "base-v1",
            BASE_SUITE,
            self.mirror,
            *BASE_PACKAGES,
            BASE_VENV,
            *(c.read_bytes() for c in self.extra_ca_certs),
        )[:16]

    def wheelhouse_key(self) -> str:
        return _sha(
            "wheels-v1",
            (REPO_ROOT / "pyproject.toml").read_bytes(),
            (REPO_ROOT / "constraints.txt").read_bytes(),
            *dockerfile_pins(),
            sys.version.split()[0],
        )[:16]

    def image_key(self, name: str) -> str:
        return _sha(
            "image-v1",
            name,
            context_digest(DOCKERFILES[name]),
            self.base_key(),
            self.wheelhouse_key(),
        )[:16]

    # ---- stages
    def _timed(self, stage: str, cached: bool, t0: float) -> float:
        dt = time.monotonic() - t0
        if self.report.cached.get(stage, True):  # a stage that did work keeps that timing
            self.report.timings[stage] = round(dt, 2)
            self.report.cached[stage] = cached
        return dt

    def base_rootfs(self) -> Path:
        """``mmdebstrap`` tarball of the base image (cached)."""
        t0 = time.monotonic()
        dst = self.cache_dir / f"base-{self.base_key()}.tar"
        if dst.is_file():
            self._timed("base image", True, t0)
            return dst
        if not shutil.which("mmdebstrap"):
            raise ImageError(
                "mmdebstrap not found: install Debian's mmdebstrap (scripts/dev.sh setup)"
            )
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        hooks = []
        for cert in self.extra_ca_certs:
            hooks += ["--customize-hook", f"copy-in {cert} /usr/local/share/ca-certificates/"]
        if self.extra_ca_certs:
            hooks += ["--customize-hook", 'chroot "$1" update-ca-certificates']
        hooks += [
            "--customize-hook",
            f'chroot "$1" python3 -m venv {BASE_VENV}',
            "--customize-hook",
            'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin',
        ]
        log = self.log_dir / "base.log"
        with open(log, "wb") as f:
            rc = subprocess.call(
                [
                    "nice",
                    "-n",
                    "5",
                    "mmdebstrap",
                    "--variant=minbase",
                    "--format=tar",
                    f"--include={','.join(BASE_PACKAGES)}",
                    *hooks,
                    BASE_SUITE,
                    str(tmp),
                    self.mirror,
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        if rc != 0:
            tmp.unlink(missing_ok=True)
            raise ImageError(f"mmdebstrap exited {rc}; log {log}")
        os.replace(tmp, dst)
        self._timed("base image", False, t0)
        return dst

    def wheelhouse(self) -> Path:
        """``pip download`` of everything both images install (cached by pyproject+constraints)."""
        t0 = time.monotonic()
        dst = self.cache_dir / f"wheels-{self.wheelhouse_key()}"
        if (dst / ".complete").is_file():
            self._timed("wheelhouse", True, t0)
            return dst
        tmp = Path(tempfile.mkdtemp(prefix=".wheels-", dir=self.cache_dir))
        build_reqs = re.search(
            r"requires\s*=\s*\[(.*?)\]", (REPO_ROOT / "pyproject.toml").read_text(), re.DOTALL
        )
        reqs = (
            re.findall(r'"([^"]+)"', build_reqs.group(1)) if build_reqs else ["setuptools", "wheel"]
        )
        reqs += dockerfile_pins()
        log = self.log_dir / "wheelhouse.log"
        with open(log, "wb") as f:
            # --no-build-isolation: DeepSpeed's sdist imports torch to compute its metadata.
            rc = subprocess.call(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-build-isolation",
                    "-d",
                    str(tmp),
                    "-c",
                    str(REPO_ROOT / "constraints.txt"),
                    f"{REPO_ROOT}[operator,trainer]",
                    *reqs,
                    "pip",
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
            )
        if rc != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ImageError(f"pip download exited {rc}; log {log}")
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(tmp, dst)
        self._timed("wheelhouse", False, t0)
        return dst

    def dockerd(self) -> Dockerd:
        if self._dockerd is None:
            self._dockerd = self._stack.enter_context(
                Dockerd(self.cache_dir / "docker", self.log_dir / "dockerd.log")
            )
        return self._dockerd

    def close(self) -> None:
        self._stack.close()
        self._dockerd = None

    def __enter__(self) -> ImageBuilder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def base_ref(self) -> str:
        return f"localhost/moe-base:{self.base_key()}"

    def _ensure_base_in_docker(self) -> str:
        d = self.dockerd()
        ref = self.base_ref()
        if d.docker("image", "inspect", ref, check=False).returncode != 0:
            rootfs = self.base_rootfs()
            path = f"{BASE_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
            d.docker(
                "import",
                "--change",
                f"ENV PATH={path}",
                "--change",
                "ENV LANG=C.UTF-8",
                "--change",
                'CMD ["python3"]',
                str(rootfs),
                ref,
                log=self.log_dir / "base.log",
            )
        return ref

    def build(self, name: str, tags: tuple[str, ...] | None = None) -> BuiltImage:
        """Build ``name`` ("operator" or "trainer") from its Dockerfile unless its archive is
        cached."""
        if name not in DOCKERFILES:
            raise ValueError(f"unknown image {name!r}; known: {sorted(DOCKERFILES)}")
        t0 = time.monotonic()
        key = self.image_key(name)
        repo = f"moe-{name}"
        all_tags = (f"{repo}:{key}", *(tags if tags is not None else DEFAULT_TAGS[name]))
        tar = self.cache_dir / f"{name}-{key}.tar"
        stage = f"{name} image"
        if tar.is_file():
            return BuiltImage(name, key, tar, all_tags, self._timed(stage, True, t0), True)
        self.base_rootfs()
        wheels = self.wheelhouse()
        t0 = time.monotonic()  # the build itself (base and wheelhouse are timed apart)
        d = self.dockerd()
        base = self._ensure_base_in_docker()
        log = self.log_dir / f"{name}.log"
        log.write_text("")
        with serve_directory(wheels, port=self._stable_port()) as url:
            d.docker(
                "build",
                "--network",
                "host",
                "-f",
                str(DOCKERFILES[name]),
                "--build-arg",
                f"BASE_IMAGE={base}",
                "--build-arg",
                "PIP_NO_INDEX=1",
                "--build-arg",
                f"PIP_FIND_LINKS={url}",
                *(a for t in all_tags for a in ("-t", t)),
                str(REPO_ROOT),
                log=log,
            )
        tmp = tar.with_name(f".{tar.name}.{os.getpid()}.tmp")
        d.docker("save", "-o", str(tmp), *all_tags, log=log)
        os.replace(tmp, tar)
        return BuiltImage(name, key, tar, all_tags, self._timed(stage, False, t0), False)

    @staticmethod
    def _stable_port() -> int:
        """A port that stays the same between runs (the build argument is part of docker's layer
        cache key); ``serve_directory`` falls back to a free one when it is taken."""
        return 38000 + int(hashlib.sha256(str(REPO_ROOT).encode()).hexdigest(), 16) % 1000

    def build_all(self) -> dict[str, BuiltImage]:
        built = {name: self.build(name) for name in DOCKERFILES}
        if self._dockerd is not None:
            self._prune_docker({t for img in built.values() for t in img.tags} | {self.base_ref()})
        return built

    def _prune_docker(self, keep: set[str]) -> None:
        """Untag this builder's older images and drop dangling ones: the data root would grow by
        an image per change otherwise (the layers of the kept images stay: the build cache)."""
        d = self.dockerd()
        out = d.docker("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.decode().split()
        old = [
            ref
            for ref in out
            if ref.split(":")[0] in ("moe-operator", "moe-trainer", "localhost/moe-base")
            and ref not in keep
        ]
        if old:
            d.docker("rmi", *old, check=False)
        d.docker("image", "prune", "-f", check=False)

    def pause_tar(self) -> Path:
        pause = binaries.resolve_kube_binaries(("pause",))["pause"]
        dst = self.cache_dir / f"pause-{binaries.sha256_file(pause)[:16]}.tar"
        return dst if dst.is_file() else pause_image_tar(dst, pause)

    def prune(self, keep: int = 2) -> None:
        """Keep the newest ``keep`` archives per image (the cache would grow with every change)."""
        for prefix in ("operator-", "trainer-", "base-", "pause-"):
            tars = sorted(
                self.cache_dir.glob(f"{prefix}*.tar"), key=lambda p: p.stat().st_mtime, reverse=True
            )
            for old in tars[keep:]:
                old.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_localkube.images``: build (or find cached) both images; print timings."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--extra-ca-cert",
        action="append",
        default=[],
        help="add this CA certificate to the base image (TLS-inspecting networks)",
    )
    ap.add_argument("images", nargs="*", default=list(DOCKERFILES))
    args = ap.parse_args(argv)
    with ImageBuilder(extra_ca_certs=[Path(p) for p in args.extra_ca_cert]) as b:
        for name in args.images:
            img = b.build(name)
            print(
                f"{name}: {img.tar} ({'cached' if img.cached else f'built in {img.seconds:.0f}s'}) "
                f"tags {', '.join(img.tags)}",
                flush=True,
            )
        print(json.dumps(b.report.timings), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
