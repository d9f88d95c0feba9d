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

In-process:   agent = NodeAgent(api_client, [NodeSpec("node-a", "nvswitch-h100-8")]); agent.start()
Stand-alone:  python -m moe_localkube.nodeagent --kubeconfig KC --nodes
node-a:nvswitch-h100-8,node-b
"""

from __future__ import annotations

import contextlib
import json
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
from .nodes import FAKE_NVML_ENV, GpuShape, NodeSpec, node_manifest, node_status
from .podfiles import Mount
from .podworker import PodWorker

log = logging.getLogger("moe_localkube.nodeagent")
LEASE_NS = "kube-node-lease"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
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


def _micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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
        self.kubelet_api: KubeletApi | None = None
        self._workers: dict[str, PodWorker] = {}
        self.gpus: dict[str, GpuAllocator] = {}
        self._ips: dict[str, str] = {}
        self._next_ip = 2
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
        shape = GpuShape(
            product=gpus[0].name.replace(" ", "-") if gpus else "NVIDIA-GPU",
            count=len(gpus),
            memory_mib=(gpus[0].memory_bytes >> 20) if gpus else 0,
        )
        body = node_manifest(spec, shape)
        try:
            self.core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_node(spec.name, {"metadata": body["metadata"]}, _content_type=MERGE)
        port = self.kubelet_api.port if self.kubelet_api else 0
        self.core.patch_node_status(
            spec.name,
            {"status": node_status(spec, self.host_ip, port, shape)},
            _content_type=MERGE,
        )
        # TaintNodesByCondition put node.kubernetes.io/not-ready on the new node; it is Ready now.
        self.core.patch_node(spec.name, {"spec": {"taints": None}}, _content_type=MERGE)
        self._renew_lease(spec.name)

    def _renew_lease(self, node: str) -> None:
        spec = {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": _micro_now()}
        try:
            self.coordination.patch_namespaced_lease(
                node, LEASE_NS, {"spec": spec}, _content_type=MERGE
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease(
                LEASE_NS, {"metadata": {"name": node, "namespace": LEASE_NS}, "spec": spec}
            )

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            for name in self.nodes:
                try:
                    self._renew_lease(name)
                    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                    self.core.patch_node_status(
                        name,
                        {
                            "status": {
                                "conditions": [
                                    {
                                        "type": "Ready",
                                        "status": "True",
                                        "reason": "KubeletReady",
                                        "lastHeartbeatTime": now,
                                    }
                                ]
                            }
                        },
                        _content_type=STRATEGIC,
                    )
                except Exception as exc:  # noqa: BLE001 - keep beating
                    log.warning("node %s: heartbeat failed: %s", name, exc)

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
        assert self.hosts is not None
        self.hosts.set(uid, ip, pod_hostnames(pod))
        return ip

    def release_ip(self, uid: str) -> None:
        with self._lock:
            self._ips.pop(uid, None)
        if self.hosts:
            self.hosts.remove(uid)

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


def log_file(
    run_dir: Path | str,
    namespace: str,
    pod: str,
    container: str | None = None,
    previous: bool = False,
) -> tuple[Path | None, str]:
    """(log file, pod uid) of a container of the newest pod ``namespace/pod`` under ``run_dir``;
    the file is None when that attempt has no log (``previous`` before any restart)."""
    base = Path(run_dir) / "pods" / namespace / pod
    metas = sorted(base.glob("*/pod.json"), key=lambda p: p.stat().st_mtime)
    if not metas:
        raise FileNotFoundError(f"no pod {namespace}/{pod} ran under {run_dir}")
    meta = json.loads(metas[-1].read_text())
    names = meta["initContainers"] + meta["containers"]
    if container is None:
        if len(meta["containers"]) != 1:
            raise ValueError(f"pod {namespace}/{pod} has containers {meta['containers']}: name one")
        container = meta["containers"][0]
    if container not in names:
        raise ValueError(f"pod {namespace}/{pod} has no container {container!r} (has {names})")
    logs = sorted(
        metas[-1].parent.glob(f"logs/{container}.*.log"), key=lambda p: int(p.name.split(".")[-2])
    )
    want = -2 if previous else -1
    return (logs[want] if len(logs) >= abs(want) else None), meta["uid"]


def read_log(
    run_dir: Path | str,
    namespace: str,
    pod: str,
    container: str | None = None,
    previous: bool = False,
) -> str:
    """Output of a container of the newest pod ``namespace/pod`` run under ``run_dir``
    (``previous``: the attempt before the last restart; "" when there is none)."""
    path, _ = log_file(run_dir, namespace, pod, container, previous)
    return path.read_text(errors="replace") if path else ""


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
