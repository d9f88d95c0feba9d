"""Binary resolution and hash verification (temp dirs only: no real build, no cluster)."""

from __future__ import annotations

import hashlib
import lzma
import os

import pytest

from moe_localkube import binaries
from moe_localkube.binaries import KUBE_BINARIES, BinaryError


def _fake_release(tmp_path, corrupt: str | None = None, compress: bool = False):
    """A folder shaped like ../shared/k8s/bin: binaries (or .xz) + SHA256SUMS of the plain files."""
    src = tmp_path / "src"
    src.mkdir()
    lines = []
    for name in KUBE_BINARIES:
        data = f"#!/bin/sh\necho {name}\n".encode()
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}")
        if name == corrupt:
            data = data.replace(b"echo", b"evil")
        if compress:
            (src / f"{name}.xz").write_bytes(lzma.compress(data))
        else:
            (src / name).write_bytes(data)
            (src / name).chmod(0o755)
    (src / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return src


def test_verify_dir_accepts_good_binaries(tmp_path):
    src = _fake_release(tmp_path)
    paths = binaries.verify_dir(src)
    assert set(paths) == set(KUBE_BINARIES)
    assert all(p.parent == src for p in paths.values())


def test_verify_dir_rejects_a_corrupted_binary(tmp_path):
    src = _fake_release(tmp_path, corrupt="kube-scheduler")
    with pytest.raises(BinaryError, match=r"kube-scheduler: sha256 [0-9a-f]{64} does not match"):
        binaries.verify_dir(src)


def test_verified_stamp_is_voided_by_a_change(tmp_path):
    src = _fake_release(tmp_path)
    binaries.verify_dir(src)
    target = src / "kube-apiserver"
    target.write_bytes(b"#!/bin/sh\necho tampered\n")  # same path, new content and mtime
    os.utime(target, ns=(1, 1))
    with pytest.raises(BinaryError, match="kube-apiserver: sha256"):
        binaries.verify_dir(src)


def test_unpack_xz_verifies_after_decompressing(tmp_path):
    src = _fake_release(tmp_path, compress=True)
    out = binaries.unpack_xz_dir(src, tmp_path / "cache")
    assert (out["kube-apiserver"]).read_bytes() == b"#!/bin/sh\necho kube-apiserver\n"
    assert os.access(out["kube-apiserver"], os.X_OK)
    assert (tmp_path / "cache" / "SHA256SUMS").exists()


def test_unpack_xz_rejects_corrupted_archive_content(tmp_path):
    src = _fake_release(tmp_path, corrupt="kube-controller-manager", compress=True)
    with pytest.raises(BinaryError, match="kube-controller-manager: sha256"):
        binaries.unpack_xz_dir(src, tmp_path / "cache")


def test_unpack_replaces_a_corrupted_cached_copy(tmp_path):
    src = _fake_release(tmp_path, compress=True)
    cache = tmp_path / "cache"
    binaries.unpack_xz_dir(src, cache)
    (cache / "kube-scheduler").write_bytes(b"garbage")
    os.utime(cache / "kube-scheduler", ns=(2, 2))
    out = binaries.unpack_xz_dir(src, cache)
    assert out["kube-scheduler"].read_bytes() == b"#!/bin/sh\necho kube-scheduler\n"


def test_resolution_order_env_dir_first(tmp_path, monkeypatch):
    src = _fake_release(tmp_path)
    monkeypatch.setenv(binaries.ENV_BIN_DIR, str(src))
    assert (
        binaries.resolve_kube_binaries(allow_build=False)["kube-apiserver"]
        == src / "kube-apiserver"
    )


def test_env_dir_with_corrupted_binary_is_rejected(tmp_path, monkeypatch):
    src = _fake_release(tmp_path, corrupt="kube-apiserver")
    monkeypatch.setenv(binaries.ENV_BIN_DIR, str(src))
    with pytest.raises(BinaryError, match="kube-apiserver: sha256"):
        binaries.resolve_kube_binaries(allow_build=False)


def test_cache_used_when_no_shared_dir_and_corruption_detected(tmp_path, monkeypatch):
    monkeypatch.delenv(binaries.ENV_BIN_DIR, raising=False)
    monkeypatch.setattr(binaries, "shared_bin_dir", lambda: tmp_path / "nowhere")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(BinaryError, match=r"no Kubernetes v1.20.2 binaries"):
        binaries.resolve_kube_binaries(allow_build=False)
    cache = binaries.kube_cache_dir()
    assert cache == tmp_path / "xdg" / "moe-operator" / "kube-v1.20.2"
    binaries.unpack_xz_dir(_fake_release(tmp_path, compress=True), cache)
    assert (
        binaries.resolve_kube_binaries(allow_build=False)["kube-scheduler"]
        == cache / "kube-scheduler"
    )
    (cache / "kube-scheduler").write_bytes(b"bitrot")
    with pytest.raises(BinaryError, match="kube-scheduler: sha256"):
        binaries.resolve_kube_binaries(allow_build=False)


def test_bad_sums_file_is_reported(tmp_path):
    (tmp_path / "SHA256SUMS").write_text("not a hash line\n")
    with pytest.raises(BinaryError, match=r"SHA256SUMS:1: not a sha256sum line"):
        binaries.read_sums(tmp_path / "SHA256SUMS")


def test_missing_etcd_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(binaries.shutil, "which", lambda name: None)
    monkeypatch.setattr(binaries.os, "access", lambda *a: False)
    with pytest.raises(BinaryError, match="apt-get install etcd-server"):
        binaries.etcd_binary()


def test_build_script_parses_and_follows_the_recipe():
    import subprocess

    assert subprocess.run(["bash", "-n", str(binaries.BUILD_SCRIPT)]).returncode == 0
    script = binaries.BUILD_SCRIPT.read_text()
    for needle in (
        "GO111MODULE=off",
        "make gen_openapi",
        "golang-github-modern-go-reflect2-dev",
        "k8s.io/kubernetes/cmd/$b",
        "gitVersion=$version",
        "sha256sum",
    ):
        assert needle in script
