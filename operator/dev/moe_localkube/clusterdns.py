"""A minimal cluster DNS for the real nodes: A records of ``cluster.local`` names, answered from
the API server at query time. Test and dev infrastructure, not product.

Answers (the subset of the Kubernetes DNS specification the operator's pods use):

- ``<hostname>.<subdomain>.<ns>.svc.cluster.local`` -> the IP of the pod in ``<ns>`` whose
  ``spec.hostname``/``spec.subdomain`` are those (worker rendezvous: ``MASTER_ADDR``);
- ``<service>.<ns>.svc.cluster.local`` -> the Service's ClusterIP, or for a headless Service the
  IPs of its ready pods.

Everything else (search-list expansions, outside names: there is no outside network) gets
NXDOMAIN; AAAA and other types of a known name get an empty answer. UDP only, as glibc asks.
"""

from __future__ import annotations

import socket
import struct
import threading

DOMAIN = "cluster.local"
TTL = 5
_A, _IN = 1, 1


def _parse_question(msg: bytes) -> tuple[int, int, str, int, int] | None:
    """(id, flags, name, qtype, end offset of the question) of a one-question query."""
    if len(msg) < 12:
        return None
    qid, flags, qdcount = struct.unpack("!HHH", msg[:6])
    if qdcount != 1 or flags & 0x8000:
        return None
    labels, i = [], 12
    while True:
        if i >= len(msg):
            return None
        n = msg[i]
        if n == 0:
            i += 1
            break
        if n & 0xC0:
            return None
        labels.append(msg[i + 1 : i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    if i + 4 > len(msg):
        return None
    qtype, _qclass = struct.unpack("!HH", msg[i : i + 4])
    return qid, flags, ".".join(labels).lower(), qtype, i + 4


def _reply(msg: bytes, qid: int, flags: int, end: int, rcode: int, ips: list[str]) -> bytes:
    rd = flags & 0x0100
    header = struct.pack("!HHHHHH", qid, 0x8000 | 0x0400 | rd | 0x0080 | rcode, 1, len(ips), 0, 0)
    answers = b"".join(
        struct.pack("!HHHIH", 0xC00C, _A, _IN, TTL, 4) + socket.inet_aton(ip) for ip in ips
    )
    return header + msg[12:end] + answers


class ClusterDNS:
    """Serves on ``(address, port)`` in a daemon thread until ``stop()``; ``lookup(name)`` returns
    ``None`` (NXDOMAIN) or a list of IPv4 addresses."""

    def __init__(self, api_client, address: str, port: int = 53):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.address, self.port = address, port
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.queries = 0

    def lookup(self, name: str) -> list[str] | None:
        name = name.rstrip(".")
        suffix = f".svc.{DOMAIN}"
        if not name.endswith(suffix):
            return None
        parts = name[: -len(suffix)].split(".")
        try:
            if len(parts) == 3:  # hostname.subdomain.namespace
                host, sub, ns = parts
                pods = self.core.list_namespaced_pod(ns, _request_timeout=5).items
                ips = [
                    p.status.pod_ip
                    for p in pods
                    if p.spec.hostname == host
                    and p.spec.subdomain == sub
                    and p.status.pod_ip
                    and p.status.phase not in ("Succeeded", "Failed")
                ]
                return ips or None
            if len(parts) == 2:  # service.namespace
                svc_name, ns = parts
                svc = self.core.read_namespaced_service(svc_name, ns, _request_timeout=5)
                if svc.spec.cluster_ip and svc.spec.cluster_ip != "None":
                    return [svc.spec.cluster_ip]
                sel = ",".join(f"{k}={v}" for k, v in (svc.spec.selector or {}).items())
                pods = self.core.list_namespaced_pod(
                    ns, label_selector=sel, _request_timeout=5
                ).items
                return [
                    p.status.pod_ip for p in pods if p.status.pod_ip and p.status.phase == "Running"
                ] or []
        except Exception:  # noqa: BLE001 - unknown namespace/service, API hiccup: not found
            return None
        return None

    def handle(self, msg: bytes) -> bytes | None:
        q = _parse_question(msg)
        if q is None:
            return None
        qid, flags, name, qtype, end = q
        self.queries += 1
        ips = self.lookup(name)
        if ips is None:
            return _reply(msg, qid, flags, end, 3, [])  # NXDOMAIN
        return _reply(msg, qid, flags, end, 0, ips if qtype == _A else [])

    def start(self) -> ClusterDNS:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((self.address, self.port))
        self._sock.settimeout(0.5)
        self._thread = threading.Thread(
            target=self._serve, name=f"clusterdns-{self.address}", daemon=True
        )
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                msg, peer = self._sock.recvfrom(1500)
            except (TimeoutError, OSError):
                continue
            # Lookups call the API server: answer each query in its own thread.
            threading.Thread(target=self._answer, args=(msg, peer), daemon=True).start()

    def _answer(self, msg: bytes, peer) -> None:
        try:
            out = self.handle(msg)
            if out is not None and self._sock is not None:
                self._sock.sendto(out, peer)
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
