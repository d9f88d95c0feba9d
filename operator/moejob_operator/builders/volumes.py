"""The job's volumes as pod ``volumes`` + container ``volumeMounts``: one place that turns a
spec volume (PersistentVolumeClaim, hostPath, ConfigMap) into both, for every pod that mounts it
(inspection, data-prepare, workers). How a hostPath is mounted is decided here only: the allowed
prefix admission bound it to is the volume, the rest of the path a ``subPath`` (docs/security.md).

Mount paths are the spec's, the same in every pod: a path a pod writes into a document (the
prepared data directory, the model directory) is the path the workers read.
"""

from __future__ import annotations

import posixpath
from typing import Any

from moe_contracts.data import PREPARED_DIR

from .. import constants as C
from ..spec import CheckpointVolume, DataVolume, HostPathSource, JobSpec

Pair = tuple[dict[str, Any], dict[str, Any]]


def source(
    src: CheckpointVolume | DataVolume, *, read_only: bool, host_type: str = "Directory"
) -> dict[str, Any]:
    """The pod volume's source (without its name). A hostPath is its allowed prefix: the path
    itself is reached through :func:`host_sub_path`."""
    pvc = src.persistent_volume_claim
    if pvc is not None:
        claim: dict[str, Any] = {"claimName": pvc.claim_name}
        if read_only or getattr(pvc, "read_only", False):
            claim["readOnly"] = True
        return {"persistentVolumeClaim": claim}
    if src.host_path is not None:
        return {"hostPath": {"path": _prefix(src.host_path), "type": host_type}}
    cm = getattr(src, "config_map", None)
    if cm is not None:
        return {"configMap": {"name": cm.name}}
    raise ValueError("volume: no source")  # the spec's validators make this unreachable


def _prefix(hp: HostPathSource) -> str:
    if hp.allowed_prefix is None:  # fail closed: only admission decides which prefix applies
        raise ValueError(f"hostPath {hp.path!r}: not admitted (no allowed prefix bound)")
    return hp.allowed_prefix


def host_sub_path(hp: HostPathSource) -> str | None:
    """``hp.path`` relative to its allowed prefix (None: the prefix itself). The kubelet opens
    a subPath component by component inside the volume and refuses one that a symlink takes
    outside it, so a link planted under the prefix cannot mount the host's root."""
    rel = posixpath.relpath(posixpath.normpath(hp.path), _prefix(hp))
    return None if rel == "." else rel


def volume_and_mount(
    name: str,
    src: CheckpointVolume | DataVolume,
    mount_path: str,
    *,
    read_only: bool,
    sub_path: str | None = None,
    host_type: str = "Directory",
) -> Pair:
    mount: dict[str, Any] = {"name": name, "mountPath": mount_path}
    if read_only:
        mount["readOnly"] = True
    base = host_sub_path(src.host_path) if src.host_path is not None else None
    full = "/".join(x.strip("/") for x in (base, sub_path) if x)
    if full:
        mount["subPath"] = full
    return {"name": name, **source(src, read_only=read_only, host_type=host_type)}, mount


def checkpoint(spec: JobSpec, *, read_only: bool = False) -> Pair:
    ck = spec.checkpoint.volume
    if ck is None:
        vol: dict[str, Any] = {"name": C.CHECKPOINT_VOLUME, "emptyDir": {}}
        return vol, {"name": C.CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.path}
    return volume_and_mount(
        C.CHECKPOINT_VOLUME,
        ck,
        spec.checkpoint.path,
        read_only=read_only,
        host_type="DirectoryOrCreate",
    )


def data(spec: JobSpec) -> Pair | None:
    dv = spec.data.volume
    if dv is None:
        return None
    return volume_and_mount(C.DATA_VOLUME, dv, spec.data.path, read_only=True)


def model(spec: JobSpec) -> Pair | None:
    """The model directory, read-only at ``spec.model.path`` (None: preset, hfConfig, or a
    directory in the image)."""
    m = spec.model
    if m.path is None or m.volume is None:
        return None
    return volume_and_mount(C.MODEL_VOLUME, m.volume, m.path, read_only=True, sub_path=m.sub_path)


def cache(spec: JobSpec, *, read_only: bool) -> Pair | None:
    """``spec.data.cache`` (None: the prepared data goes to the checkpoint volume)."""
    c = spec.data.cache
    if c is None:
        return None
    return volume_and_mount(
        C.CACHE_VOLUME, c.volume, c.path, read_only=read_only, host_type="DirectoryOrCreate"
    )


def output(spec: JobSpec) -> Pair | None:
    o = spec.output
    if o is None:
        return None
    return volume_and_mount(
        C.OUTPUT_VOLUME,
        o.volume,
        o.path,
        read_only=False,
        sub_path=o.sub_path,
        host_type="DirectoryOrCreate",
    )


def prepared_root(spec: JobSpec) -> str:
    """Where prepared data directories go (``<root>/<key>``), as every pod sees it."""
    base = spec.data.cache.path if spec.data.cache is not None else spec.checkpoint.path
    return f"{base.rstrip('/')}/{PREPARED_DIR}"
