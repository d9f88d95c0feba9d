"""Real Kubernetes nodes on this machine: kubelet v1.20.2 on containerd + runc, pods in real
containers from real images. Test and dev infrastructure, not product; needs root.

    with ControlPlane() as cp, RealNodes(cp, [RealNodeSpec("gpu-a"), RealNodeSpec("gpu-b")],
                                         images=[tar1, tar2]) as nodes:
        ...   # pods scheduled to gpu-a / gpu-b run as containers

Layout (docs/localkube.md, "Real nodes"):

- **One containerd per kubelet** (own root, state, socket): two kubelets on one containerd kill
  each other's pods as orphans. ``restrict_oom_score_adj`` (this kind of VM lacks
  CAP_SYS_RESOURCE), cgroupfs driver, one ``cgroupRoot`` per kubelet.
- **Network**: one Linux bridge per cluster (``moekb<slot>``, ``10.217.<slot>.0/24``, the CNI
  ``bridge`` + ``host-local`` plugins, no masquerading) shared by both nodes, so pods of both
  nodes reach each other directly. The gateway address is also each node's InternalIP: the
  kubelets listen there (``kubectl logs`` works, the API server dials InternalIP) and pods cannot
  reach those ports (an INPUT DROP rule). Pods reach the loopback-only API server through the
  ``kubernetes`` Service address: a DNAT rule (``10.0.0.1:443`` -> ``127.0.0.1:<port>``) on the
  bridge and ``route_localnet=1`` on it. ``moe_localkube.clusterdns`` answers ``cluster.local``
  names on the gateway.
- **GPU-like nodes**: ``RealNodeSpec.fixture`` (an NVML recording, as for the node agent) gives
  the node the GPU Feature Discovery labels, an ``nvidia.com/gpu`` capacity (extended resource,
  patched into the node status) and a containerd base runtime spec that gives every container
  the fake driver, as the NVIDIA container runtime injects the real one: the dev package's
  ``moe_fake_nvml`` (not in the images) mounted read-only and on ``PYTHONPATH``, and
  ``MOE_FAKE_NVML_FIXTURE``, so ``moe-discover`` reports the recorded topology.
  ``fixture=None`` gives a plain CPU node.
- **Host state** changed on start and restored on stop: the bridge, the iptables rules (each
  tagged with a comment naming this cluster), the cgroup roots, the sysctls the kubelet sets at
  start (``vm.overcommit_memory``, ``kernel.panic``, ...: saved by the first cluster of this
  machine, restored by the last), mounts below the run dir and the network namespaces of the
  pods, ``/var/log/pods`` entries of the pods. ``stop()`` deletes the nodes' pods, waits for the
  kubelets to tear them down, then stops every process it started (kubelets, containerds, and the
  runtime shims found by their containerd socket).

This module is the cluster: ``RealNodes`` starts and stops the parts in order, and
``host_leftovers`` checks the host afterwards. The parts live in their own rooms:
``realnode`` (the node spec and record, running host tools), ``realnode_net`` (bridge, CNI,
iptables, pod network namespaces), ``realnode_host`` (sysctls and host dirs shared by the
clusters of the machine, reaping dead clusters), ``realnode_containerd`` (mount namespace,
containerd, images) and ``realnode_kubelet`` (cgroup root, kubelet, readiness).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from . import binaries, procs
from .controlplane import ControlPlane, free_ports
from .dockerd import remove_cgroup_tree, unmount_under
from .image_tars import PAUSE_IMAGE, pause_image_tar
from .realnode import HOST_DIR, RealNode, RealNodesError, RealNodeSpec, run
from .realnode_containerd import (
    ctr,
    force_remove_containers,
    kill_shims,
    load_images,
    processes_naming,
    start_containerd,
)
from .realnode_host import SharedHostState, mounts_under
from .realnode_kubelet import (
    kill_cgroup_processes,
    make_cgroup_root,
    remove_pod_logs,
    start_kubelet,
    wait_ready,
)
from .realnode_net import CNI_BIN_DIR, BridgeNetwork, remove_netns

NEED_TOOLS = (
    "containerd",
    "ctr",
    "runc",
    "iptables",
    "ip",
    "mount",
    "umount",
    "unshare",
    "nsenter",
)


class RealNodes:
    """Kubelets + containerds for ``control_plane``; see the module doc. Attributes after
    ``start()``: ``names``, ``bridge``, ``gateway``, ``subnet``, ``timings`` (stage -> s)."""

    def __init__(
        self,
        control_plane: ControlPlane,
        specs: list[RealNodeSpec],
        *,
        images=(),
        run_dir: Path | str | None = None,
        ready_timeout: float = 180.0,
        persistent_images: bool = True,
    ):
        if os.geteuid() != 0:
            raise RealNodesError("real nodes need root (kubelet, containerd, iptables, mounts)")
        if len({s.name for s in specs}) != len(specs) or not specs:
            raise ValueError("RealNodes needs at least one node and distinct node names")
        self.cp = control_plane
        self.specs = list(specs)
        # (archive, tags): tags known up front let a node whose image store already holds them skip
        # the import (``moe_localkube.images.BuiltImage`` has both; a bare path is always imported)
        self.images = [
            (Path(i.tar), tuple(i.tags)) if hasattr(i, "tar") else (Path(i), ()) for i in images
        ]
        self.persistent_images = persistent_images
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="moe-realnodes-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ready_timeout = ready_timeout
        self.id = f"{os.getpid()}-{os.urandom(3).hex()}"
        # what holds mounts (kubelet volumes, container rootfs, sandbox shm) lives outside the run
        # dir, at a path a later cluster can find again if this process dies (reap_dead_cluster)
        self.host_dir = HOST_DIR / self.id
        self.names = [s.name for s in specs]
        self.timings: dict[str, float] = {}
        self.net = BridgeNetwork(self.id)
        self._nodes: list[RealNode] = []
        self._cgroups: list[Path] = []
        self._pod_uids: set[str] = set()
        self._host: SharedHostState | None = None
        self._dns = None
        self._stopped = False
        self._started = False
        self._lock = threading.Lock()

    @property
    def bridge(self) -> str:
        return self.net.bridge

    @property
    def gateway(self) -> str:
        return self.net.gateway

    @property
    def subnet(self) -> str:
        return self.net.subnet

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> RealNodes:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> RealNodes:
        t0 = time.monotonic()
        self._started = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.timings["nodes ready"] = round(time.monotonic() - t0, 2)
        return self

    def _check_tools(self) -> None:
        missing = [t for t in NEED_TOOLS if not shutil.which(t)]
        if not Path(CNI_BIN_DIR, "bridge").exists():
            missing.append(f"{CNI_BIN_DIR}/bridge (containernetworking-plugins)")
        if missing:
            raise RealNodesError(
                f"missing {missing}: install Debian's containerd runc iptables "
                "containernetworking-plugins (scripts/dev.sh setup does it)"
            )

    def _start(self) -> None:
        self._check_tools()
        bins = binaries.resolve_kube_binaries(binaries.NODE_BINARIES)
        self._host = SharedHostState(self.id, self.host_dir)
        self._host.enter()
        self.net.up(self.cp.port, self.run_dir)
        from .clusterdns import ClusterDNS

        self._dns = ClusterDNS(self.cp.api_client(), self.gateway).start()

        pause_tar = pause_image_tar(self.run_dir / "pause.tar", bins["pause"])
        ports = free_ports(2 * len(self.specs))
        for i, spec in enumerate(self.specs):
            d = self.run_dir / f"node-{spec.name}"
            d.mkdir(parents=True, exist_ok=True)
            self._nodes.append(
                RealNode(
                    spec,
                    d,
                    d / "containerd.sock",
                    f"/moe-{self.id}-{i}",
                    ports[2 * i],
                    ports[2 * i + 1],
                )
            )
        t0 = time.monotonic()
        assert self.net.cni_conf_dir is not None and self.net.resolv_conf is not None
        for node in self._nodes:
            start_containerd(
                node,
                host_dir=self.host_dir,
                cni_conf_dir=self.net.cni_conf_dir,
                persistent_images=self.persistent_images,
                netns=self.net.netns,
            )
        self.timings["containerd up"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        loaders = [
            threading.Thread(
                target=load_images, args=(n, [(pause_tar, (PAUSE_IMAGE,)), *self.images])
            )
            for n in self._nodes
        ]
        errors: list[BaseException] = []
        for th in loaders:
            th.start()
        for th in loaders:
            th.join()
        errors += [n.load_error for n in self._nodes if n.load_error is not None]
        if errors:
            raise errors[0]
        self.timings["images loaded"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        for node in self._nodes:
            make_cgroup_root(node, self._cgroups)
            self.net.block_from_pods(node.kubelet_port)
            start_kubelet(
                node,
                bins["kubelet"],
                kubeconfig=self.cp.kubeconfig,
                host_dir=self.host_dir,
                gateway=self.gateway,
                resolv_conf=self.net.resolv_conf,
            )
        wait_ready(self.cp.api_client(), self._nodes, self.ready_timeout)
        self.timings["kubelets ready"] = round(time.monotonic() - t0, 2)

    # ------------------------------------------------------------ inspection
    def ctr(self, node_name: str, *args: str) -> str:
        """``ctr -n k8s.io ARGS`` against ``node_name``'s containerd; returns stdout."""
        node = next(n for n in self._nodes if n.spec.name == node_name)
        return ctr(node, *args).stdout.decode()

    def kubelet_log(self, node_name: str) -> str:
        node = next(n for n in self._nodes if n.spec.name == node_name)
        return (node.dir / "kubelet.log").read_text(errors="replace")

    @property
    def pids(self) -> set[int]:
        return {
            p.pid for n in self._nodes for p in (n.containerd, n.kubelet, n.holder) if p is not None
        }

    # ------------------------------------------------------------ stop
    def stop(self, pod_timeout: float = 60.0) -> None:
        with self._lock:
            if self._stopped or not self._started:
                return
            self._stopped = True
        t0 = time.monotonic()
        try:
            self._drain(pod_timeout)
        finally:
            self._teardown()
        self.timings["teardown"] = round(time.monotonic() - t0, 2)

    def _drain(self, timeout: float) -> None:
        """Delete the nodes' pods and let the kubelets tear them down (CNI DEL, netns, volumes)."""
        if not any(n.kubelet and n.kubelet.poll() is None for n in self._nodes):
            return
        from kubernetes import client

        try:
            core = client.CoreV1Api(self.cp.api_client())
            for name in self.names:
                pods = core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={name}", _request_timeout=10
                ).items
                for p in pods:
                    self._pod_uids.add(p.metadata.uid)
                    with contextlib.suppress(Exception):
                        core.delete_namespaced_pod(
                            p.metadata.name,
                            p.metadata.namespace,
                            grace_period_seconds=0,
                            _request_timeout=10,
                        )
        except Exception:  # noqa: BLE001 - control plane already gone: tear down by force below
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = False
            for node in self._nodes:
                if node.containerd and node.containerd.poll() is None:
                    # stopped sandboxes have had their CNI DEL and netns removal: enough; the
                    # exited containers the kubelet keeps for a while are removed below
                    out = ctr(node, "tasks", "ls", check=False, timeout=30).stdout.decode()
                    busy = busy or "RUNNING" in out
            if not busy:
                return
            time.sleep(0.5)

    def _teardown(self) -> None:
        """Every step runs even when one before it failed; the first error is raised at the end."""
        errors: list[BaseException] = []

        def step(fn, *args):
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - collected, raised below
                errors.append(exc)

        for node in self._nodes:
            if node.kubelet is not None:
                step(procs.stop, node.kubelet, 10)
        for node in self._nodes:
            if node.containerd is not None and node.containerd.poll() is None:
                step(force_remove_containers, node, self.net.netns)
                step(procs.stop, node.containerd, 10)
        step(kill_shims, {str(n.socket) for n in self._nodes})
        for node in self._nodes:
            if node.holder is not None:
                step(procs.stop, node.holder, 5)
        for node in self._nodes:
            if node.root is not None and not str(node.root).startswith(str(self.host_dir)):
                step(unmount_under, node.root)
            if node.root_lock is not None:
                os.close(node.root_lock)
                node.root_lock = None
        for ns in self.net.pod_namespaces():
            step(remove_netns, ns)
        step(unmount_under, self.run_dir)
        step(unmount_under, self.host_dir)
        if not any(True for _ in mounts_under(self.host_dir)):
            shutil.rmtree(self.host_dir, ignore_errors=True)
        step(kill_cgroup_processes, self._cgroups)
        for d in self._cgroups:
            step(remove_cgroup_tree, d)
        step(remove_pod_logs, self._pod_uids)
        self.net.remove_rules()
        if self._dns is not None:
            step(self._dns.stop)
        self.net.delete_bridge()
        step(self._delete_node_objects)
        if self._host is not None:
            step(self._host.leave)
        self.net.release_slot()
        if errors:
            raise errors[0]

    def _delete_node_objects(self) -> None:
        from kubernetes import client

        with contextlib.suppress(Exception):
            core = client.CoreV1Api(self.cp.api_client())
            for name in self.names:
                with contextlib.suppress(Exception):
                    core.delete_node(name, _request_timeout=5)


def host_leftovers(nodes: RealNodes) -> list[str]:
    """What ``nodes`` left on the host after ``stop()`` (empty when it cleaned up)."""
    out = []
    if nodes.bridge and run("ip", "link", "show", nodes.bridge, check=False).returncode == 0:
        out.append(f"bridge {nodes.bridge}")
    for table in ("nat", "filter"):
        rules = run("iptables", "-w", "-t", table, "-S", check=False).stdout.decode()
        out += [
            f"iptables -t {table}: {r}"
            for r in rules.splitlines()
            if f"moe-localkube {nodes.id}" in r
        ]
    for d in nodes._cgroups:
        if d.exists():
            out.append(f"cgroup {d}")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if mp.startswith((str(nodes.run_dir), str(nodes.host_dir))) or mp in {
                os.path.realpath(n) for n in nodes.net.netns
            }:
                out.append(f"mount {mp}")
    if nodes.host_dir.exists():
        out.append(f"directory {nodes.host_dir}")
    for pid in procs.survivors(nodes.pids):
        out.append(f"process group {pid}")
    for pid, argv in processes_naming({str(n.socket) for n in nodes._nodes}):
        out.append(f"process {pid}: {b' '.join(argv)[:120]!r}")
    return out
