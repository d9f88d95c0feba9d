"""The node agent's pod network identity: each pod gets a loopback address ``127.0.x.y`` as its
``status.podIP`` and its hostnames (``<hostname>.<subdomain>.<ns>.svc.cluster.local``, ...) in
one hosts file that every container sees at /etc/hosts, beside the API server as the in-cluster
``kubernetes`` Service. Pods reach each other by name as on a cluster with a headless Service."""

from __future__ import annotations

import threading
from pathlib import Path


class HostsFile:
    """The /etc/hosts every container sees; rewritten in place (bind mounts pin the inode)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            base = Path("/etc/hosts").read_text()
        except OSError:
            base = "127.0.0.1 localhost\n"
        self._base = (
            base.rstrip("\n") + "\n# moe_localkube: the API server as the in-cluster service\n"
            "127.0.0.1 kubernetes kubernetes.default kubernetes.default.svc "
            "kubernetes.default.svc.cluster.local\n# moe_localkube: pods\n"
        )
        self._entries: dict[str, tuple[str, list[str]]] = {}
        self._lock = threading.Lock()
        path.write_text(self._base)

    def set(self, key: str, ip: str, names: list[str]) -> None:
        with self._lock:
            self._entries[key] = (ip, names)
            self._write()

    def remove(self, key: str) -> None:
        with self._lock:
            if self._entries.pop(key, None):
                self._write()

    def _write(self) -> None:
        text = self._base + "".join(
            f"{ip} {' '.join(names)}\n" for ip, names in self._entries.values()
        )
        with open(self.path, "r+") as f:
            f.write(text)
            f.truncate()


def pod_hostnames(pod: dict) -> list[str]:
    spec, ns = pod["spec"], pod["metadata"]["namespace"]
    host = spec.get("hostname") or pod["metadata"]["name"]
    sub = spec.get("subdomain")
    names = (
        [f"{host}.{sub}.{ns}.svc.cluster.local", f"{host}.{sub}.{ns}.svc", f"{host}.{sub}"]
        if sub
        else []
    )
    return [*names, host]


class PodAddresses:
    """Loopback IPs for pods (``127.0.0.2`` up, never ``.0``/``.1``/``.255`` nor ``host_ip``; a
    released one is reused after the pool wraps) and their entries in ``hosts``."""

    def __init__(self, hosts: HostsFile, host_ip: str):
        self.hosts, self.host_ip = hosts, host_ip
        self._ips: dict[str, str] = {}
        self._next_ip = 2
        self._lock = threading.Lock()

    def alloc(self, uid: str, pod: dict) -> str:
        with self._lock:
            used = set(self._ips.values())
            while True:
                n = self._next_ip
                self._next_ip = n + 1 if n < 250 * 256 else 2
                hi, lo = divmod(n, 256)
                ip = f"127.0.{hi}.{lo}"
                if lo not in (0, 1, 255) and ip not in used and ip != self.host_ip:
                    break
            self._ips[uid] = ip
        self.hosts.set(uid, ip, pod_hostnames(pod))
        return ip

    def release(self, uid: str) -> None:
        with self._lock:
            self._ips.pop(uid, None)
        self.hosts.remove(uid)
