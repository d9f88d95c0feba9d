"""The slice of the kubelet's HTTPS API that ``kubectl logs`` needs: ``/containerLogs``.

The API server proxies ``kubectl logs`` to ``https://<node InternalIP>:<daemonEndpoints port>``;
the node agent serves it from the per-container log files, for all its nodes on one port.
Supported: ``follow``, ``tailLines``, ``limitBytes``, ``previous``. Not supported: exec, attach,
port-forward (501).
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from . import pki

# (namespace, pod, container, previous) -> (log file or None, still running?)
LogLookup = Callable[[str, str, str, bool], tuple[Path | None, Callable[[], bool]]]


def _tail_lines(data: bytes, n: int) -> bytes:
    if n <= 0:
        return b""
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:])


class _Handler(BaseHTTPRequestHandler):
    server: KubeletApi._Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # http.server's naming
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if parts == ["healthz"]:
            return self._send(200, b"ok")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._send(
                501, f"moe_localkube node agent: {url.path} is not supported\n".encode()
            )
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        ns, pod, container = parts[1:]
        path, running = self.server.lookup(ns, pod, container, q.get("previous") == "true")
        if path is None:
            return self._send(
                404, f"container {container} of pod {ns}/{pod} has no logs here\n".encode()
            )
        data = path.read_bytes()
        if "tailLines" in q:
            data = _tail_lines(data, int(q["tailLines"]))
        limit = int(q["limitBytes"]) if "limitBytes" in q else None
        if q.get("follow") != "true":
            return self._send(200, data[:limit] if limit is not None else data)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Connection", "close")
        self.end_headers()
        offset = path.stat().st_size
        sent = 0
        try:
            chunk = data if limit is None else data[:limit]
            self.wfile.write(chunk)
            sent += len(chunk)
            while (
                running() and not self.server.stopping.is_set() and (limit is None or sent < limit)
            ):
                time.sleep(0.2)
                with open(path, "rb") as f:
                    f.seek(offset)
                    new = f.read()
                offset += len(new)
                if new:
                    new = new if limit is None else new[: limit - sent]
                    self.wfile.write(new)
                    self.wfile.flush()
                    sent += len(new)
            with open(path, "rb") as f:  # whatever came after the last poll
                f.seek(offset)
                rest = f.read()
            if rest and (limit is None or sent < limit):
                self.wfile.write(rest if limit is None else rest[: limit - sent])
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class KubeletApi:
    """HTTPS server on ``host:port`` (port 0: a free one) answering ``/containerLogs``."""

    class _Server(ThreadingHTTPServer):
        daemon_threads = True
        lookup: LogLookup
        stopping: threading.Event

    def __init__(self, lookup: LogLookup, cert_dir: Path, host: str = "127.0.0.1", port: int = 0):
        keys = pki.make_pki(cert_dir)
        self._server = self._Server((host, port), _Handler)
        self._server.lookup = lookup
        self._server.stopping = threading.Event()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(keys.server_cert), str(keys.server_key))
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kubelet-api", daemon=True
        )

    def start(self) -> KubeletApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.stopping.set()
        self._server.shutdown()
        self._server.server_close()
