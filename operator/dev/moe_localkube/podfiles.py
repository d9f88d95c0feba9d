"""What a kubelet prepares before starting a container: the environment (``env``, ``envFrom``,
``valueFrom``, ``$(VAR)`` expansion) and the volumes, written as plain files under the pod's
run directory (``configMap``, ``secret``, ``emptyDir``, ``hostPath``, ``downwardAPI``,
``projected``, ``persistentVolumeClaim`` as a folder shared by the agent's nodes).

Pods are plain dicts in API (camelCase) form. Missing objects raise ``ConfigError`` (the kubelet's
``CreateContainerConfigError``: retried until the object exists or the pod goes away).
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException


class ConfigError(RuntimeError):
    """A referenced ConfigMap/Secret/key is missing, or the pod uses something we cannot play."""


@dataclass(frozen=True)
class Mount:
    source: Path  # host path (file or folder) to bind
    target: str  # mountPath inside the container
    read_only: bool


_FIELD_RE = re.compile(r"^metadata\.(labels|annotations)\['([^']*)'\]$")
_EXPAND_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes, others stay."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _EXPAND_RE.sub(sub, text)


def field_value(pod: dict, path: str) -> str:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
    }
    if path in simple:
        return simple[path] or ""
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    m = _FIELD_RE.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ConfigError(f"fieldRef {path!r} is not supported by the node agent")


def resource_value(container: dict | None, ref: dict) -> str:
    res = (container or {}).get("resources") or {}
    name = ref["resource"]  # e.g. limits.cpu, requests.memory
    kind, _, key = name.partition(".")
    value = (res.get(kind) or {}).get(key) or (res.get("limits") or {}).get(key)
    return str(value) if value is not None else "0"


class PodFiles:
    """Reads ConfigMaps/Secrets through ``core`` (CoreV1Api) and materialises one pod."""

    def __init__(self, core, pod: dict, pod_dir: Path, shared_dir: Path):
        self.core, self.pod, self.pod_dir, self.shared_dir = core, pod, pod_dir, shared_dir
        self.ns = pod["metadata"]["namespace"]
        self._cache: dict[tuple[str, str], dict | None] = {}

    # ------------------------------------------------------------ API objects
    def _get(self, kind: str, name: str, optional: bool) -> dict | None:
        key = (kind, name)
        if key not in self._cache:
            try:
                if kind == "configmap":
                    obj = self.core.read_namespaced_config_map(name, self.ns)
                    data = dict(obj.data or {})
                    data.update(
                        {k: base64.b64decode(v) for k, v in (obj.binary_data or {}).items()}
                    )
                else:
                    obj = self.core.read_namespaced_secret(name, self.ns)
                    data = {k: base64.b64decode(v) for k, v in (obj.data or {}).items()}
                self._cache[key] = data
            except ApiException as exc:
                if exc.status != 404:
                    raise
                self._cache[key] = None
        data = self._cache[key]
        if data is None and not optional:
            raise ConfigError(f'{kind} "{name}" not found')
        return data

    def _key(self, kind: str, ref: dict) -> str | None:
        data = self._get(kind, ref["name"], bool(ref.get("optional")))
        if data is None:
            return None
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(f"couldn't find key {ref['key']} in {kind} {self.ns}/{ref['name']}")
        value = data[ref["key"]]
        return value.decode(errors="replace") if isinstance(value, bytes) else value

    # ------------------------------------------------------------ env
    def env(self, container: dict, base: dict[str, str]) -> dict[str, str]:
        """The container's environment on top of ``base`` (service env, PATH, ...)."""
        env = dict(base)
        for src in container.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, field in (("configmap", "configMapRef"), ("secret", "secretRef")):
                if field in src:
                    data = (
                        self._get(kind, src[field]["name"], bool(src[field].get("optional"))) or {}
                    )
                    for k, v in data.items():
                        env[prefix + k] = v.decode(errors="replace") if isinstance(v, bytes) else v
        for item in container.get("env") or []:
            name, vf = item["name"], item.get("valueFrom")
            if vf is None:
                env[name] = expand(item.get("value", ""), env)
            elif "fieldRef" in vf:
                env[name] = field_value(self.pod, vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                env[name] = resource_value(container, vf["resourceFieldRef"])
            elif "configMapKeyRef" in vf:
                value = self._key("configmap", vf["configMapKeyRef"])
                if value is not None:
                    env[name] = value
            elif "secretKeyRef" in vf:
                value = self._key("secret", vf["secretKeyRef"])
                if value is not None:
                    env[name] = value
            else:
                raise ConfigError(f"env {name}: unsupported valueFrom {sorted(vf)}")
        return env

    # ------------------------------------------------------------ volumes
    def _write(self, path: Path, data: str | bytes, mode: int | None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        path.chmod(mode if mode is not None else 0o644)

    def _write_keys(
        self, root: Path, data: dict, items: list | None, default_mode: int | None, what: str
    ) -> None:
        if items:
            for it in items:
                if it["key"] not in data:
                    raise ConfigError(f"{what}: no key {it['key']!r}")
                self._write(root / it["path"], data[it["key"]], it.get("mode", default_mode))
        else:
            for k, v in data.items():
                self._write(root / k, v, default_mode)

    def _downward(self, root: Path, items: list, default_mode: int | None) -> None:
        for it in items:
            if "fieldRef" in it:
                value = field_value(self.pod, it["fieldRef"]["fieldPath"])
            else:
                ref = it["resourceFieldRef"]
                container = next(
                    (
                        c
                        for c in self.pod["spec"]["containers"]
                        if c["name"] == ref.get("containerName")
                    ),
                    None,
                )
                value = resource_value(container, ref)
            self._write(root / it["path"], value, it.get("mode", default_mode))

    def _sa_token(self, root: Path, src: dict, default_mode: int | None) -> None:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec: dict[str, Any] = {"expirationSeconds": src.get("expirationSeconds", 3600)}
        if src.get("audience"):
            spec["audiences"] = [src["audience"]]
        res = self.core.create_namespaced_service_account_token(sa, self.ns, {"spec": spec})
        self._write(root / src["path"], res.status.token, default_mode)

    def volume(self, vol: dict) -> Path:
        """Materialise one volume; return the host path that stands for it."""
        name = vol["name"]
        root = self.pod_dir / "volumes" / name
        if "hostPath" in vol:
            hp = vol["hostPath"]
            path, typ = Path(hp["path"]), hp.get("type", "")
            if typ == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif typ == "FileOrCreate" and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            elif typ in ("Directory", "File") and not path.exists():
                raise ConfigError(f"hostPath {path} (type {typ}) does not exist")
            return path
        if "persistentVolumeClaim" in vol:
            path = self.shared_dir / "pvc" / self.ns / vol["persistentVolumeClaim"]["claimName"]
            path.mkdir(parents=True, exist_ok=True)
            return path
        if "emptyDir" in vol and vol["emptyDir"].get("medium") == "Memory":
            root = memory_dir(self.pod["metadata"]["uid"]) / name  # tmpfs, like the kubelet
        root.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in vol:
            return root
        if "configMap" in vol:
            cm = vol["configMap"]
            data = self._get("configmap", cm["name"], bool(cm.get("optional"))) or {}
            self._write_keys(
                root, data, cm.get("items"), cm.get("defaultMode"), f"configMap {cm['name']}"
            )
            return root
        if "secret" in vol:
            sec = vol["secret"]
            data = self._get("secret", sec["secretName"], bool(sec.get("optional"))) or {}
            self._write_keys(
                root, data, sec.get("items"), sec.get("defaultMode"), f"secret {sec['secretName']}"
            )
            return root
        if "downwardAPI" in vol:
            dw = vol["downwardAPI"]
            self._downward(root, dw.get("items") or [], dw.get("defaultMode"))
            return root
        if "projected" in vol:
            pr = vol["projected"]
            mode = pr.get("defaultMode")
            for src in pr.get("sources") or []:
                if "configMap" in src:
                    cm = src["configMap"]
                    data = self._get("configmap", cm["name"], bool(cm.get("optional"))) or {}
                    self._write_keys(root, data, cm.get("items"), mode, f"configMap {cm['name']}")
                elif "secret" in src:
                    sec = src["secret"]
                    data = self._get("secret", sec["name"], bool(sec.get("optional"))) or {}
                    self._write_keys(root, data, sec.get("items"), mode, f"secret {sec['name']}")
                elif "downwardAPI" in src:
                    self._downward(root, src["downwardAPI"].get("items") or [], mode)
                elif "serviceAccountToken" in src:
                    self._sa_token(root, src["serviceAccountToken"], mode)
                else:
                    raise ConfigError(
                        f"volume {name}: projected source {sorted(src)} not supported"
                    )
            return root
        kinds = sorted(k for k in vol if k != "name")
        raise ConfigError(f"volume {name}: type {kinds} is not supported by the node agent")

    def volumes(self) -> dict[str, Path]:
        return {v["name"]: self.volume(v) for v in self.pod["spec"].get("volumes") or []}


def memory_dir(uid: str) -> Path:
    """Where a pod's ``emptyDir: {medium: Memory}`` volumes live (removed when the pod ends)."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))) / "moe-localkube" / uid


def _sub_path(volume: Path, sub: str, container: str) -> Path:
    """``volume/sub``, created when missing, refused (like the kubelet's "subpath ... not within
    volume path") when ``..`` or a symlink on the way leads outside the volume."""
    if os.path.isabs(sub) or ".." in sub.split("/"):
        raise ConfigError(f"container {container}: subPath {sub!r} must be a relative path")
    root = volume.resolve()
    src = volume / sub
    for depth in range(1, len(Path(sub).parts) + 1):
        part = volume.joinpath(*Path(sub).parts[:depth])
        if part.is_symlink() and not part.resolve().is_relative_to(root):
            raise ConfigError(
                f"container {container}: subpath {str(src)!r} not within volume path {str(root)!r}"
            )
    if not src.exists():
        src.mkdir(parents=True)
    return src


def container_mounts(container: dict, volumes: dict[str, Path]) -> list[Mount]:
    """``volumeMounts`` -> bind mounts, parents before children."""
    mounts = []
    for vm in container.get("volumeMounts") or []:
        if vm["name"] not in volumes:
            raise ConfigError(
                f"container {container['name']}: volumeMount {vm['name']!r} names no volume"
            )
        src = volumes[vm["name"]]
        if vm.get("subPath"):
            src = _sub_path(src, vm["subPath"], container["name"])
        mounts.append(
            Mount(
                source=src,
                target=os.path.normpath(vm["mountPath"]),
                read_only=bool(vm.get("readOnly")),
            )
        )
    return sorted(mounts, key=lambda m: m.target.count("/"))


def save_meta(pod_dir: Path, pod: dict) -> None:
    meta = {
        "namespace": pod["metadata"]["namespace"],
        "name": pod["metadata"]["name"],
        "uid": pod["metadata"]["uid"],
        "node": pod["spec"].get("nodeName"),
        "initContainers": [c["name"] for c in pod["spec"].get("initContainers") or []],
        "containers": [c["name"] for c in pod["spec"]["containers"]],
    }
    pod_dir.mkdir(parents=True, exist_ok=True)
    (pod_dir / "pod.json").write_text(json.dumps(meta, indent=1))
