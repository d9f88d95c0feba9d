"""``moectl operator``: run the operator process (the container's entrypoint).

One process = leader election + kopf + two small HTTP servers, and one
:class:`~moejob_operator.controller.Controller` made from the flags (the handlers reach it
through kopf's ``memo``; nothing is passed through the environment):

- **Leader election** on a ``coordination.k8s.io`` Lease (the Kubernetes controller pattern,
  client-go semantics). kopf runs ``--standalone`` (no kopf peering, so no peering CRDs): a
  process only starts kopf once it holds the Lease, renews it every ``--retry-period`` seconds,
  and stops kopf and exits 1 when it cannot renew for ``--renew-deadline`` seconds. On SIGTERM the
  leader stops kopf and releases the Lease, so during a rolling upgrade (two replicas briefly) the
  new pod takes over within one retry period and never reconciles at the same time as the old.
  Expiry is judged on this process's monotonic clock (a record that did not change for
  ``--lease-duration`` seconds is expired), so clock skew between nodes does not matter.
- **Health** on ``--health-port``: ``/healthz`` is 200 while the process is alive and not
  wedged (a heartbeat from the election loop, or from kopf's event loop once leading);
  ``/readyz`` the same (a waiting standby is ready: readiness must not depend on leadership or a
  rolling update with ``maxUnavailable: 0`` would never finish).
- **Metrics** on ``--metrics-port``: :mod:`moejob_operator.metrics`.

Nothing here logs credentials: the kubeconfig/token is read by the Kubernetes client only.
Heavy imports (kopf, kubernetes, prometheus_client) are local, so ``moectl plan`` keeps working
with the core dependencies alone.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # for annotations only: at run time the heavy imports stay local (above)
    import urllib3
    from kubernetes.client import ApiClient

    from .controller import Controller, ControllerConfig

log = logging.getLogger("moejob_operator.run")

HANDLERS_MODULE = "moejob_operator.handlers"
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_LEASE = "moe-operator-leader"
EXIT_LOST_LEASE = 1
HEARTBEAT_STALE_SECONDS = 60.0


def _micro(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---- leader election ------------------------------------------------------------------------
class LeaseElector:
    """Acquire / renew / release one Lease (client-go ``LeaseLock`` semantics, no clock sharing).

    ``try_acquire_or_renew`` is one non-blocking round: True when this identity holds the Lease
    afterwards. Conflicts (another process wrote first) are a lost round, never an error.
    """

    def __init__(
        self,
        api_client: ApiClient,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_seconds: int = 15,
        clock: Callable[[], float] = time.monotonic,
    ):
        from kubernetes import client as k8s

        self.api = k8s.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_seconds = lease_seconds
        self.clock = clock
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, transitions)
        self._observed_at = 0.0
        self.leading = False

    def _read(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
            # _preload_content=False: urllib3's response, whatever model the annotation names
            lease: dict[str, Any] = json.loads(cast("urllib3.BaseHTTPResponse", resp).data)
            return lease
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _spec(self, transitions: int, acquire: str | None) -> dict[str, Any]:
        now = _micro(dt.datetime.now(dt.UTC))
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": acquire or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def try_acquire_or_renew(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        lease = self._read()
        try:
            if lease is None:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(0, None),
                }
                self.api.create_namespaced_lease(
                    self.namespace,
                    # the body is a dict: validate_call parses it into V1Lease (the annotation
                    # names only the model)
                    body,  # type: ignore[arg-type]
                    _preload_content=False,
                )
                return self._set(True)
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
            if record != self._observed:
                self._observed, self._observed_at = record, self.clock()
            duration = spec.get("leaseDurationSeconds") or self.lease_seconds
            expired = self.clock() - self._observed_at >= duration
            if holder and holder != self.identity and not expired:
                return self._set(False)
            transitions = int(spec.get("leaseTransitions") or 0)
            if holder != self.identity:
                transitions += 1
            lease["spec"] = self._spec(
                transitions, spec.get("acquireTime") if holder == self.identity else None
            )
            # resourceVersion stays in metadata: a concurrent writer makes this a 409
            self.api.replace_namespaced_lease(
                self.name,
                self.namespace,
                # a dict: validate_call parses it into V1Lease (the annotation names the model)
                lease,  # type: ignore[arg-type]
                _preload_content=False,
            )
            return self._set(True)
        except ApiException as exc:
            if exc.status == 409:
                return self._set(False)
            raise

    def release(self) -> None:
        """Give the Lease up (holder emptied) so a standby takes over without waiting it out."""
        if not self.leading:
            return
        lease = self._read()
        if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
            lease["spec"]["holderIdentity"] = ""
            lease["spec"]["leaseDurationSeconds"] = 1
            try:
                self.api.replace_namespaced_lease(
                    self.name,
                    self.namespace,
                    # a dict: validate_call parses it into V1Lease (as in try_acquire_or_renew)
                    lease,  # type: ignore[arg-type]
                    _preload_content=False,
                )
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                log.warning("releasing Lease %s/%s failed: %s", self.namespace, self.name, exc)
        self._set(False)

    def _set(self, leading: bool) -> bool:
        if leading != self.leading:
            log.info(
                "%s Lease %s/%s as %s",
                "acquired" if leading else "not holding",
                self.namespace,
                self.name,
                self.identity,
            )
        self.leading = leading
        from . import metrics

        metrics.set_leader(leading)
        return leading


# ---- health ---------------------------------------------------------------------------------
class Health:
    def __init__(self) -> None:
        self.beat = time.monotonic()
        self.failed: str | None = None

    def touch(self) -> None:
        self.beat = time.monotonic()

    def ok(self) -> tuple[bool, str]:
        if self.failed:
            return False, self.failed
        age = time.monotonic() - self.beat
        if age > HEARTBEAT_STALE_SECONDS:
            return False, f"no heartbeat for {age:.0f}s"
        return True, "ok"


def start_health_server(health: Health, port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/healthz", "/readyz"):
                self.send_error(404)
                return
            good, why = health.ok()
            body = why.encode()
            self.send_response(200 if good else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        # probes every few seconds: keep the log for real events
        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server


# ---- the process ----------------------------------------------------------------------------
def _lease_namespace(given: str | None) -> str | None:
    if given:
        return given
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return SA_NAMESPACE_FILE.read_text().strip() or None
    except OSError:
        return None


def _renew_loop(
    elector: LeaseElector,
    args: argparse.Namespace,
    stop: threading.Event,
    lost: threading.Event,
    health: Health,
) -> None:
    """Renew until ``stop``; set ``lost`` when renewal failed for ``renew_deadline`` seconds."""
    last_ok = time.monotonic()
    while not stop.wait(args.retry_period):
        try:
            ok = elector.try_acquire_or_renew()
        except Exception as exc:  # noqa: BLE001 - transport errors: retry until the deadline
            log.warning("renewing the Lease failed: %s", exc)
            ok = False
        if ok:
            last_ok = time.monotonic()
            continue
        if not elector.leading or time.monotonic() - last_ok >= args.renew_deadline:
            log.error(
                "lost the leader Lease (another holder or no renewal for %ss): stopping",
                args.renew_deadline,
            )
            health.failed = "lost leadership"
            lost.set()  # kopf's loop sees it within a second and stops
            return


def _own_namespace() -> str:
    """The namespace this pod runs in (its ServiceAccount's), else ``default``."""
    try:
        return SA_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def controller_config(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> ControllerConfig:
    """The controller's settings from the flags, and the passes' settings (admission policy,
    upgrade gate) from ``env`` (default: this process's environment, which the chart sets),
    read once here: nothing later reads the environment."""
    from .controller import ControllerConfig
    from .core.gate import GateError
    from .reconcile.settings import Settings

    settings = Settings.from_env(
        os.environ if env is None else env, default_namespace=_own_namespace()
    )
    if isinstance(settings.gate, GateError):
        log.error(
            "upgrade gate settings are invalid (%s): jobs that need the gate wait", settings.gate
        )
    return ControllerConfig(
        namespaces=tuple(args.namespace), workers=args.workers, settings=settings
    )


async def _run_kopf(
    args: argparse.Namespace, controller: Controller, lost: threading.Event, health: Health
) -> None:
    """kopf until a signal (kopf's own handlers) or until the Lease is lost; the handlers reach
    ``controller`` through kopf's memo.

    The stop flag is an asyncio.Event set from the renew thread through the loop: a
    threading.Event would leave kopf's waiter thread blocked and hang interpreter shutdown.
    """
    import kopf

    stop_flag = asyncio.Event()

    async def heartbeat() -> None:
        while True:
            health.touch()
            if lost.is_set():
                stop_flag.set()
            await asyncio.sleep(1)

    settings = kopf.OperatorSettings()  # handlers.configure() adjusts it at startup
    if args.namespace:
        # Watched namespaces are exact names: kopf need not list/watch namespaces (which would
        # need a cluster-wide grant and retries ~20 s on 403 before falling back).
        settings.scanning.disabled = True
    memo = kopf.Memo(controller=controller)
    beat = asyncio.get_running_loop().create_task(heartbeat())
    try:
        if args.namespace:
            await kopf.operator(
                standalone=True,
                namespaces=args.namespace,
                stop_flag=stop_flag,
                settings=settings,
                memo=memo,
            )
        else:
            await kopf.operator(
                standalone=True, clusterwide=True, stop_flag=stop_flag, settings=settings, memo=memo
            )
    finally:
        beat.cancel()


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    from . import metrics

    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL,
    )
    metrics.set_build_info(_version())
    health = Health()
    servers: list[HTTPServer] = []
    if args.metrics_port:
        servers.append(metrics.start_server(args.metrics_port, args.bind_address)[0])
    if args.health_port:
        servers.append(start_health_server(health, args.health_port, args.bind_address))
    importlib.import_module(HANDLERS_MODULE)  # registers the @kopf handlers
    from .controller import Controller

    controller = Controller(controller_config(args))

    stopping = threading.Event()
    previous = {
        s: signal.signal(s, lambda *_: stopping.set()) for s in (signal.SIGTERM, signal.SIGINT)
    }
    elector = None
    try:
        if args.leader_election:
            elector = _elect(args, health, stopping)
            if elector is None:
                return 0  # asked to stop while waiting
        else:
            metrics.set_leader(True)  # no election: this process reconciles
        for s, h in previous.items():  # kopf installs its own handlers
            signal.signal(s, h)
        done = threading.Event()
        lost = threading.Event()
        if elector is not None:
            threading.Thread(
                target=_renew_loop,
                name="lease-renew",
                daemon=True,
                args=(elector, args, done, lost, health),
            ).start()
        log.info(
            "starting kopf (%s)",
            f"namespaces {', '.join(args.namespace)}" if args.namespace else "all namespaces",
        )
        asyncio.run(_run_kopf(args, controller, lost, health))
        done.set()
        if lost.is_set():
            return EXIT_LOST_LEASE
        return 0
    finally:
        if elector is not None:
            elector.release()
        for server in servers:
            server.shutdown()
            server.server_close()


def _elect(
    args: argparse.Namespace, health: Health, stopping: threading.Event
) -> LeaseElector | None:
    from .reconcile.client import api_client_from_env

    namespace = _lease_namespace(args.lease_namespace)
    if namespace is None:
        raise SystemExit(
            "moectl operator: error: leader election needs --lease-namespace "
            "(or POD_NAMESPACE, or an in-cluster ServiceAccount)"
        )
    elector = LeaseElector(
        api_client_from_env(),
        namespace,
        args.lease_name,
        args.identity,
        lease_seconds=args.lease_duration,
    )
    log.info("waiting for the leader Lease %s/%s as %s", namespace, args.lease_name, args.identity)
    while not stopping.is_set():
        health.touch()
        try:
            if elector.try_acquire_or_renew():
                return elector
        except Exception as exc:  # noqa: BLE001 - API not reachable yet: keep trying
            log.warning("leader election round failed: %s", exc)
        stopping.wait(args.retry_period)
    return None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("moe-operator")
    except Exception:  # noqa: BLE001 - no package metadata (a source checkout): say unknown
        return "unknown"


def _default_identity() -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def add_operator(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "operator",
        help="run the operator (the container entrypoint)",
        description="Run the moe-operator controller: leader election on a Lease, "
        "kopf (standalone), /healthz and /metrics (docs/install.md).",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch MoETrainingJobs in every namespace (the default)",
    )
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable)",
    )
    p.add_argument("--health-port", type=int, default=8080, help="/healthz and /readyz (0: off)")
    p.add_argument("--metrics-port", type=int, default=9090, help="/metrics (0: off)")
    p.add_argument("--bind-address", default="0.0.0.0")
    p.add_argument(
        "--no-leader-election",
        dest="leader_election",
        action="store_false",
        help="run at once, without the Lease (one replica only, e.g. local dev)",
    )
    p.add_argument("--lease-name", default=DEFAULT_LEASE)
    p.add_argument("--lease-namespace", help="default: $POD_NAMESPACE, else the pod's namespace")
    p.add_argument("--lease-duration", type=int, default=15, help="seconds")
    p.add_argument("--renew-deadline", type=float, default=10.0, help="seconds")
    p.add_argument("--retry-period", type=float, default=2.0, help="seconds")
    p.add_argument(
        "--identity",
        default=_default_identity(),
        help="holder identity (default: $POD_NAME, else hostname_random)",
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=8,
        help="threads for new jobs' first reconcile passes (default 8: best on a "
        "small machine that also runs the API server; more when passes wait on "
        "a remote one)",
    )
    p.add_argument("--log-format", choices=("plain", "json"), default="plain")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=run_operator)
