"""A node agent that plays the kubelet for fake GPU nodes on this machine.

Test and dev infrastructure, not product. It registers Node objects that look like GPU nodes
(capacity ``nvidia.com/gpu``, GPU Feature Discovery labels, annotation
``moe-operator.io/fake-topology: <NVML recording>``; or this machine's real GPUs for a node
``NAME:nvml``), heartbeats them (Lease + Ready condition), hands each container the GPUs it was
granted as the NVIDIA device plugin + runtime do (``moe_localkube.gpus``),
and runs the pods the scheduler binds to them as local processes (see ``podworker``), each in its
own mount + UTS namespace, with a distinct loopback IP ``127.0.x.y`` as ``status.podIP`` and a
shared hosts file at /etc/hosts that maps pod hostnames to those IPs. Images are ignored: the
container's ``command`` + ``args`` run with this interpreter's ``bin`` folder first on PATH.

This module is the agent (the pod watch, the services its pod workers call); beside it:
``nodelease`` (Node registration, Leases, heartbeats), ``podnet`` (pod IPs, the hosts file),
``podworker`` + ``podfiles`` + ``sandbox`` (running one pod), ``podlogs``, ``kubeletapi``.

In-process:   agent = NodeAgent(api_client, [NodeSpec("node-a", "nvswitch-h100-8")]); agent.start()
Stand-alone:  python -m moe_localkube.nodeagent --kubeconfig KC --nodes
node-a:nvswitch-h100-8,node-b
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlparse

from kubernetes import watch
from kubernetes.client import CoordinationV1Api, CoreV1Api
from kubernetes.client.exceptions import ApiException

from . import procs, sandbox
from .gpus import REAL_NVML, Gpu, GpuAllocator, read_gpus, visible_env
from .imageids import ImageIds
from .kubeletapi import KubeletApi
from .nodelease import heartbeat_until, register_node
from .nodes import FAKE_NVML_ENV, NodeSpec
from .podfiles import Mount
from .podlogs import log_file, read_log
from .podnet import HostsFile, PodAddresses
from .podworker import PodWorker

log = logging.getLogger("moe_localkube.nodeagent")
# PYTHONPATH: a development checkout's code (a git worktree sharing one venv) runs in the pods
# too, not the venv's installed copy.
PASS_ENV = (
    "TMPDIR",
    "XDG_CACHE_HOME",
    "TORCH_EXTENSIONS_DIR",
    "TERM",
    "LANG",
    "LC_ALL",
    "PYTHONPATH",
)


class NodeAgent:
    """Plays the kubelet for ``nodes``; ``start()``/``stop()``, or use it as a context manager."""

    def __init__(
        self,
        api_client,
        nodes: list[NodeSpec],
        *,
        run_dir: Path | str | None = None,
        api_server: str | None = None,
        host_ip: str = "127.0.0.1",
        extra_env: dict[str, str] | None = None,
        bind_fallback_seconds: float = 15.0,
        resync_seconds: float = 10.0,
        heartbeat_seconds: float = 10.0,
        image_ids: dict[str, dict[str, str]] | None = None,
    ):
        self.api = api_client
        self.core = CoreV1Api(api_client)
        self.coordination = CoordinationV1Api(api_client)
        self.nodes = {n.name: n for n in nodes}
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="moe-nodeagent-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        server = urlparse(api_server or api_client.configuration.host)
        self.api_host, self.api_port = server.hostname or "127.0.0.1", str(server.port or 443)
        self.host_ip = host_ip
        # the digest each node reports for an image (imageID); tests change it (a re-push)
        self.image_ids = ImageIds(image_ids)
        self.extra_env = dict(extra_env or {})
        self.bind_fallback_seconds = bind_fallback_seconds
        self.resync_seconds, self.heartbeat_seconds = resync_seconds, heartbeat_seconds
        self.pids: set[int] = set()
        self.mount_targets: sandbox.MountTargets | None = None
        self.hosts: HostsFile | None = None
        self.addresses: PodAddresses | None = None
        self.kubelet_api: KubeletApi | None = None
        self._workers: dict[str, PodWorker] = {}
        self.gpus: dict[str, GpuAllocator] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> NodeAgent:
        sandbox.check_host()
        self.mount_targets = sandbox.MountTargets()
        self.hosts = HostsFile(self.run_dir / "hosts")
        self.addresses = PodAddresses(self.hosts, self.host_ip)
        self.kubelet_api = KubeletApi(
            self._log_lookup, self.run_dir / "kubelet-pki", host=self.host_ip
        ).start()
        for spec in self.nodes.values():
            self._register(spec)
        self._started = True
        for target, name in (
            (self._watch_loop, "nodeagent-watch"),
            (self._heartbeat_loop, "nodeagent-heartbeat"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.shutdown()
        for w in workers:
            w.join(timeout=15)
        for pgid in procs.survivors(self.pids):  # a worker that did not finish in time
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        if self.mount_targets:
            self.mount_targets.cleanup()
        if self.kubelet_api:
            self.kubelet_api.stop()

    # ------------------------------------------------------------ nodes
    def _register(self, spec: NodeSpec) -> None:
        gpus = read_gpus(spec.fixture)
        self.gpus[spec.name] = GpuAllocator(gpus)
        port = self.kubelet_api.port if self.kubelet_api else 0
        register_node(self.core, self.coordination, spec, gpus, self.host_ip, port)

    def _heartbeat_loop(self) -> None:
        heartbeat_until(
            self._stop, self.heartbeat_seconds, self.core, self.coordination, list(self.nodes)
        )

    # ------------------------------------------------------------ pods: watch
    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                rv = self._resync()
                until = time.monotonic() + self.resync_seconds
                while not self._stop.is_set() and time.monotonic() < until:
                    w = watch.Watch()
                    for ev in w.stream(
                        self.core.list_pod_for_all_namespaces,
                        resource_version=rv,
                        timeout_seconds=2,
                    ):
                        obj = ev["object"]
                        rv = obj.metadata.resource_version
                        pod = self.api.sanitize_for_serialization(obj)
                        self._handle(
                            self._on_deleted if ev["type"] == "DELETED" else self._sync, pod
                        )
                        if self._stop.is_set():
                            w.stop()
                            break
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("pod watch: %s %s", exc.status, exc.reason)
                    self._stop.wait(1.0)
            except Exception as exc:  # noqa: BLE001 - the loop must survive
                if self._stop.is_set():
                    return
                log.warning("pod watch: %r", exc)
                self._stop.wait(1.0)

    def _resync(self) -> str:
        listed = self.core.list_pod_for_all_namespaces()
        seen = set()
        for obj in listed.items:
            pod = self.api.sanitize_for_serialization(obj)
            seen.add(pod["metadata"]["uid"])
            self._handle(self._sync, pod)
            self._handle(self._maybe_bind, pod)
        with self._lock:
            gone = [w.pod for uid, w in self._workers.items() if uid not in seen]
        for pod in gone:
            self._handle(self._on_deleted, pod)
        return listed.metadata.resource_version

    @staticmethod
    def _handle(fn, pod: dict) -> None:
        """One pod's trouble must not stall the others: log it and go on."""
        try:
            fn(pod)
        except Exception:
            meta = pod.get("metadata", {})
            log.exception(
                "pod %s/%s: %s failed", meta.get("namespace"), meta.get("name"), fn.__name__
            )

    def _sync(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        if spec.get("nodeName") not in self.nodes or self._stop.is_set():
            return
        uid = meta["uid"]
        with self._lock:
            w = self._workers.get(uid)
            if meta.get("deletionTimestamp"):
                if w is not None and w.is_alive():
                    w.request_delete(meta.get("deletionGracePeriodSeconds"))
                    return
            elif w is None:
                phase = (pod.get("status") or {}).get("phase", "Pending")
                if phase in ("Succeeded", "Failed"):
                    return
                w = PodWorker(self, pod)
                self._workers[uid] = w
                w.start()
                return
            elif w.is_alive():
                return
            else:
                finished = w
        if not meta.get("deletionTimestamp"):
            # finished here: its final status again if the last send failed (an API outage as
            # the pod ended), as the kubelet re-reports after it reconnects; a no-op when the
            # API already has it
            finished.report()
            return
        self.force_delete(meta["namespace"], meta["name"], uid)  # finished or never started here

    def _on_deleted(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            w = self._workers.pop(uid, None)
        if w is not None and w.is_alive():
            w.request_delete(0)
        self.release_ip(uid)

    def _maybe_bind(self, pod: dict) -> None:
        """Bind a pod the scheduler has not looked at for a while, if it names one of our nodes."""
        spec, status = pod["spec"], pod.get("status") or {}
        node = (spec.get("nodeSelector") or {}).get("kubernetes.io/hostname")
        if (
            spec.get("nodeName")
            or node not in self.nodes
            or status.get("phase", "Pending") != "Pending"
        ):
            return
        if any(c.get("type") == "PodScheduled" for c in status.get("conditions") or []):
            return  # the scheduler has looked at it (e.g. Unschedulable: it does not fit): its call
        created = datetime.fromisoformat(pod["metadata"]["creationTimestamp"])
        if (datetime.now(UTC) - created).total_seconds() < self.bind_fallback_seconds:
            return
        meta = pod["metadata"]
        log.warning(
            "pod %s/%s: unscheduled after %.0fs, binding it to %s",
            meta["namespace"],
            meta["name"],
            self.bind_fallback_seconds,
            node,
        )
        try:
            self.core.create_namespaced_pod_binding(
                meta["name"],
                meta["namespace"],
                {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": meta["name"]},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                },
                _preload_content=False,
            )
        except ApiException as exc:
            log.warning("binding %s/%s failed: %s", meta["namespace"], meta["name"], exc.reason)

    # ------------------------------------------------------------ services for PodWorker
    def pod_dir(self, namespace: str, name: str, uid: str) -> Path:
        return self.run_dir / "pods" / namespace / name / uid

    def alloc_ip(self, uid: str, pod: dict) -> str:
        assert self.addresses is not None
        return self.addresses.alloc(uid, pod)

    def release_ip(self, uid: str) -> None:
        if self.addresses:
            self.addresses.release(uid)

    def force_delete(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.core.delete_namespaced_pod(
                name,
                namespace,
                grace_period_seconds=0,
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("deleting pod %s/%s failed: %s", namespace, name, exc.reason)
        self.release_ip(uid)

    def base_env(self, pod: dict) -> dict[str, str]:
        """What every container starts with, before the pod's own ``env``."""
        node = self.nodes[pod["spec"]["nodeName"]]
        venv_bin = Path(sys.prefix) / "bin"
        env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        env.update(
            {
                "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": os.environ.get("HOME", "/root"),
                "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"],
                "PYTHONUNBUFFERED": "1",
                "KUBERNETES_SERVICE_HOST": self.api_host,
                "KUBERNETES_SERVICE_PORT": self.api_port,
                "KUBERNETES_SERVICE_PORT_HTTPS": self.api_port,
                "KUBERNETES_PORT": f"tcp://{self.api_host}:{self.api_port}",
            }
        )
        if node.fixture != REAL_NVML:
            env[FAKE_NVML_ENV] = node.fixture
        env.update(self.extra_env)
        return env

    def allocate_gpus(self, pod: dict) -> dict[str, list[Gpu]]:
        """Each container's granted GPUs (raises GpuAdmissionError when too few are free)."""
        alloc = self.gpus[pod["spec"]["nodeName"]]
        containers = [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]
        return alloc.allocate(pod["metadata"]["uid"], containers)

    def gpu_env(self, pod: dict, granted: list[Gpu], env: dict[str, str]) -> dict[str, str]:
        return visible_env(granted, env, self.gpus[pod["spec"]["nodeName"]].gpus)

    def release_gpus(self, uid: str) -> None:
        for alloc in self.gpus.values():
            alloc.release(uid)

    def fixed_mounts(self) -> list[Mount]:
        assert self.hosts is not None
        return [Mount(source=self.hosts.path, target="/etc/hosts", read_only=True)]

    # ------------------------------------------------------------ logs
    def read_log(
        self, namespace: str, pod: str, container: str | None = None, previous: bool = False
    ) -> str:
        return read_log(self.run_dir, namespace, pod, container, previous)

    def _log_lookup(self, namespace: str, pod: str, container: str, previous: bool):
        try:
            path, uid = log_file(self.run_dir, namespace, pod, container, previous)
        except (FileNotFoundError, ValueError):
            return None, lambda: False
        with self._lock:
            worker = self._workers.get(uid)

        def running() -> bool:
            if previous or worker is None or not worker.is_alive():
                return False
            return any(
                c.name == container and c.proc is not None for c in [*worker.inits, *worker.mains]
            )

        return path, running

    def kill_container(
        self, namespace: str, pod: str, container: str | None = None, sig: int = signal.SIGKILL
    ) -> int:
        """Send ``sig`` to a running container's process group, as a crash or OOM kill would
        (for failure-handling tests); returns the pid. The pod then reports exit code 128+sig."""
        with self._lock:
            workers = [
                w
                for w in self._workers.values()
                if (w.ns, w.pod_name) == (namespace, pod) and w.is_alive()
            ]
        for w in workers:
            for c in [*w.inits, *w.mains]:
                proc = c.proc
                if proc is not None and container in (None, c.name):
                    os.killpg(proc.pid, sig)
                    return proc.pid
        raise LookupError(
            f"no running container {container or '*'} in pod {namespace}/{pod} on this agent"
        )

    def workers(self) -> dict[str, PodWorker]:
        with self._lock:
            return dict(self._workers)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from kubernetes import config

    ap = argparse.ArgumentParser(
        description="moe_localkube node agent: plays the kubelet for fake GPU nodes"
    )
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument(
        "--nodes",
        default="node-a:nvswitch-h100-8,node-b:nvswitch-h100-8",
        help="comma-separated NAME[:FIXTURE]",
    )
    ap.add_argument("--run-dir", default=None, help="pod logs and files (default: a new temp dir)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api = config.new_client_from_config(config_file=args.kubeconfig)
    agent = NodeAgent(
        api, [NodeSpec.parse(s) for s in args.nodes.split(",") if s], run_dir=args.run_dir
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with agent:
        print(
            f"node agent running nodes {sorted(agent.nodes)}; pod logs under {agent.run_dir}",
            flush=True,
        )
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
