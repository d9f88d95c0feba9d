"""A real Kubernetes v1.20.2 control plane on loopback: etcd, kube-apiserver, controller manager,
scheduler. Test and dev infrastructure, not product.

    with ControlPlane() as cp:
        subprocess.run([kubectl, "--kubeconfig", cp.kubeconfig, "get", "ns"])

Every process runs in its own process group and is stopped (SIGTERM, then SIGKILL) when the
``with`` block ends, on exceptions, on SIGINT/SIGTERM of this process (when started from the main
thread) and at interpreter exit. There is no kubelet: see ``moe_localkube.nodeagent``.
"""

from __future__ import annotations

import atexit
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from . import binaries, pki, procs

SERVICE_CIDR = "10.0.0.0/24"
SA_ISSUER = "https://kubernetes.default.svc"
ADMIN_USER = "moe-admin"


class ControlPlaneError(RuntimeError):
    """The control plane did not come up (the message names the log to read)."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback TCP ports (held open together while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "<no log>"


def write_kubeconfig(path: Path, server: str, ca_path: Path, token: str, user: str) -> Path:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "moe-local",
                "cluster": {"server": server, "certificate-authority": str(ca_path)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "moe-local", "context": {"cluster": "moe-local", "user": user}}],
        "current-context": "moe-local",
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)
    return path


class ControlPlane:
    """etcd + kube-apiserver (+ controller manager + scheduler) on free loopback ports.

    Attributes after ``start()``: ``server`` (https URL), ``port``, ``ca_path``, ``kubeconfig``
    (admin token, group ``system:masters``), ``admin_token``, ``run_dir`` (logs, certs),
    ``startup_seconds`` and ``pids`` (every process group it started).
    """

    def __init__(
        self,
        run_dir: Path | str | None = None,
        *,
        controller_manager: bool = True,
        scheduler: bool = True,
        ready_timeout: float = 90.0,
    ):
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="moe-localkube-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._want_cm, self._want_sched = controller_manager, scheduler
        self.ready_timeout = ready_timeout
        self._procs: dict[str, subprocess.Popen] = {}
        self.pids: set[int] = set()
        self._etcd_dir: Path | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._prev_sigterm = None
        self.server = ""
        self.port = 0
        self.ca_path = self.run_dir / "pki" / "ca.crt"
        self.kubeconfig = self.run_dir / "kubeconfig"
        self.admin_token = secrets.token_hex(24)
        self.startup_seconds = 0.0

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        t0 = time.monotonic()
        self._install_signal_handlers()
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        main = threading.current_thread() is threading.main_thread()
        proc = procs.spawn(argv, self.run_dir / "logs" / f"{name}.log", die_with_parent=main)
        self._procs[name] = proc
        self.pids.add(proc.pid)

    def _start(self) -> None:
        kube = binaries.resolve_kube_binaries()
        etcd = binaries.etcd_binary()
        keys = pki.make_pki(self.run_dir / "pki")
        etcd_port, peer_port, self.port = free_ports(3)
        self.server = f"https://127.0.0.1:{self.port}"
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        self._etcd_dir = Path(tempfile.mkdtemp(prefix="moe-etcd-", dir=shm))
        etcd_url, peer_url = f"http://127.0.0.1:{etcd_port}", f"http://127.0.0.1:{peer_port}"
        self._spawn(
            "etcd",
            [
                str(etcd),
                "--name",
                "moe",
                "--data-dir",
                str(self._etcd_dir),
                "--listen-client-urls",
                etcd_url,
                "--advertise-client-urls",
                etcd_url,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"moe={peer_url}",
                "--logger",
                "zap",
                "--log-level",
                "warn",
            ],
        )
        tokens = self.run_dir / "tokens.csv"
        tokens.write_text(f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        tokens.chmod(0o600)
        self._spawn(
            "kube-apiserver",
            [
                str(kube["kube-apiserver"]),
                "--etcd-servers",
                etcd_url,
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                "--secure-port",
                str(self.port),
                "--insecure-port",
                "0",
                "--tls-cert-file",
                str(keys.server_cert),
                "--tls-private-key-file",
                str(keys.server_key),
                "--client-ca-file",
                str(keys.ca_cert),
                "--token-auth-file",
                str(tokens),
                "--authorization-mode",
                "RBAC",
                "--service-account-issuer",
                SA_ISSUER,
                "--service-account-key-file",
                str(keys.sa_pub),
                "--service-account-signing-key-file",
                str(keys.sa_key),
                "--service-cluster-ip-range",
                SERVICE_CIDR,
                "--endpoint-reconciler-type",
                "none",
                # kubectl logs: reach the node agent's kubelet API at the node's InternalIP.
                "--kubelet-preferred-address-types",
                "InternalIP",
                "--allow-privileged=true",
                "--profiling=false",
                "--v",
                "1",
            ],
        )
        write_kubeconfig(self.kubeconfig, self.server, keys.ca_cert, self.admin_token, ADMIN_USER)
        self._wait_ready()
        common = [
            "--kubeconfig",
            str(self.kubeconfig),
            "--leader-elect=false",
            "--port",
            "0",
            "--secure-port",
            "0",
            "--v",
            "1",
        ]
        if self._want_cm:
            self._spawn(
                "kube-controller-manager",
                [
                    str(kube["kube-controller-manager"]),
                    *common,
                    "--service-account-private-key-file",
                    str(keys.sa_key),
                    "--root-ca-file",
                    str(keys.ca_cert),
                    "--use-service-account-credentials=false",
                    # A loaded 2-core machine must not turn the fake nodes NotReady.
                    "--node-monitor-grace-period",
                    "90s",
                    "--profiling=false",
                ],
            )
        if self._want_sched:
            self._spawn(
                "kube-scheduler", [str(kube["kube-scheduler"]), *common, "--profiling=false"]
            )

    def _wait_ready(self) -> None:
        """/readyz answers 200, then the ``default`` namespace exists: the API server's bootstrap
        controller creates it asynchronously, and a loaded CI machine once saw /readyz pass
        before it (a client using ``default`` at once got 404s)."""
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        auth = {"Authorization": f"Bearer {self.admin_token}"}
        checks = [
            urllib.request.Request(f"{self.server}/readyz", headers=auth),
            urllib.request.Request(f"{self.server}/api/v1/namespaces/default", headers=auth),
        ]
        deadline = time.monotonic() + self.ready_timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    log = self.run_dir / "logs" / f"{name}.log"
                    raise ControlPlaneError(
                        f"{name} exited with {proc.returncode} during start-up; "
                        f"log {log}:\n{_tail(log)}"
                    )
            try:
                while checks:
                    with urllib.request.urlopen(checks[0], context=ctx, timeout=2) as resp:
                        if resp.status != 200:
                            break
                    checks.pop(0)
                if not checks:
                    return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.1)
        log = self.run_dir / "logs" / "kube-apiserver.log"
        raise ControlPlaneError(
            f"kube-apiserver not ready after {self.ready_timeout}s ({last}); "
            f"log {log}:\n{_tail(log)}"
        )

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        # Reverse start order: clients first, etcd last.
        for name in reversed(list(self._procs)):
            procs.stop(self._procs[name], grace_seconds=5.0)
        if self._etcd_dir:
            shutil.rmtree(self._etcd_dir, ignore_errors=True)
        atexit.unregister(self.stop)
        self._restore_signal_handlers()

    # ------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        prev = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            # Stop now, then unwind like Ctrl-C: KeyboardInterrupt (not SystemExit) also makes
            # pytest end the session and run every fixture's teardown.
            self.stop()
            if callable(prev):
                prev(signum, frame)
            raise KeyboardInterrupt(f"signal {signum}")

        self._prev_sigterm = prev
        signal.signal(signal.SIGTERM, on_sigterm)
        # SIGINT already raises KeyboardInterrupt, which unwinds through __exit__/stop().

    def _restore_signal_handlers(self) -> None:
        if self._prev_sigterm is None or threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._prev_sigterm)
        self._prev_sigterm = None

    # ------------------------------------------------------------ clients
    def token_kubeconfig(
        self, token: str, path: Path | str | None = None, user: str = "user"
    ) -> Path:
        """A kubeconfig for another identity (e.g. a ServiceAccount token); returns its path."""
        path = Path(path) if path else self.run_dir / f"kubeconfig-{secrets.token_hex(4)}"
        return write_kubeconfig(path, self.server, self.ca_path, token, user)

    def api_client(self, token: str | None = None):
        """A ``kubernetes.client.ApiClient`` for the admin (or for ``token``)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.server
        cfg.ssl_ca_cert = str(self.ca_path)
        cfg.api_key = {"BearerToken": token or self.admin_token}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
        cfg.connection_pool_maxsize = 32
        return client.ApiClient(cfg)

    def kubectl_env(self) -> dict[str, str]:
        """Environment for kubectl/helm subprocesses: KUBECONFIG set, kubectl and helm on PATH."""
        import os

        kubectl = binaries.kubectl_binary()
        binaries.helm_binary()
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{kubectl.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def logs(self, component: str) -> str:
        return (self.run_dir / "logs" / f"{component}.log").read_text(errors="replace")


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_localkube.controlplane``: run a control plane until Ctrl-C."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)
    with ControlPlane(args.run_dir) as cp:
        print(
            f"control plane ready in {cp.startup_seconds:.1f}s\n  server     {cp.server}\n"
            f"  kubeconfig {cp.kubeconfig}\n  logs       {cp.run_dir / 'logs'}",
            flush=True,
        )
        try:
            while all(p.poll() is None for p in cp._procs.values()):
                time.sleep(1)
            print("a control-plane process exited; stopping", flush=True)
            return 1
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
