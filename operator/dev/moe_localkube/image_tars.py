"""Image archives written and read without docker: the sandbox (pause) image, the paths in a
``docker save`` archive. Test and dev infrastructure (``moe_localkube.images``)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

from . import binaries

PAUSE_IMAGE = "localhost/moe-pause:" + binaries.KUBE_VERSION


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
    write_atomic(dst, data)
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


def write_atomic(dst: Path, data: bytes) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dst)
