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
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import binaries
from .dockerd import Dockerd, ImageError, remove_cgroup_tree, serve_directory, unmount_under
from .image_context import (
    DOCKERFILES,
    REPO_ROOT,
    context_digest,
    copied_sources,
    debian_mirror,
    dockerfile_pins,
    dockerignore,
    sha,
)
from .image_tars import PAUSE_IMAGE, archive_paths, pause_image_tar

__all__ = [  # what callers import from here (the pieces live in the modules above)
    "DOCKERFILES",
    "PAUSE_IMAGE",
    "BuildReport",
    "BuiltImage",
    "Dockerd",
    "ImageBuilder",
    "ImageError",
    "archive_paths",
    "context_digest",
    "copied_sources",
    "debian_mirror",
    "dockerfile_pins",
    "dockerignore",
    "pause_image_tar",
    "remove_cgroup_tree",
    "serve_directory",
    "unmount_under",
]

# Tags the tests and examples use; every image also gets a content tag (``:<key>``).
DEFAULT_TAGS = {"operator": ("moe-operator:local",), "trainer": ("moe-trainer:local",)}
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
BASE_SUITE = "bookworm"
BASE_VENV = "/usr/local/py"


def images_cache_dir() -> Path:
    return binaries.cache_root() / "images"


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


# ---------------------------------------------------------------- pause image (no docker)


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
        return sha(
            "base-v1",
            BASE_SUITE,
            self.mirror,
            *BASE_PACKAGES,
            BASE_VENV,
            *(c.read_bytes() for c in self.extra_ca_certs),
        )[:16]

    def wheelhouse_key(self) -> str:
        return sha(
            "wheels-v1",
            (REPO_ROOT / "pyproject.toml").read_bytes(),
            (REPO_ROOT / "constraints.txt").read_bytes(),
            *dockerfile_pins(),
            sys.version.split()[0],
        )[:16]

    def image_key(self, name: str) -> str:
        return sha(
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
