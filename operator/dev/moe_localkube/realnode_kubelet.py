"""A real node's kubelet (v1.20.2): its cgroup root (one per kubelet, cgroupfs driver), its
configuration (listening on the bridge gateway, which is the node's InternalIP; cluster DNS on
the gateway; no image GC), its labels (the GPU Feature Discovery ones for a GPU-like node), the
wait until the Node is Ready (patching a GPU-like node's ``nvidia.com/gpu`` capacity and fake
topology annotation on the way), and on stop the processes left in its cgroups and the pods'
``/var/log/pods`` entries.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import yaml

from . import procs
from .nodes import FAKE_TOPOLOGY_ANNOTATION, GPU_RESOURCE, fixture_gpus
from .realnode import RealNode, RealNodesError, tail


def make_cgroup_root(node: RealNode, cgroups: list[Path]) -> None:
    """Create the node's ``cgroupRoot`` in every hierarchy; each dir is appended to ``cgroups``
    (removed on stop) as soon as it exists."""
    for hier in sorted(Path("/sys/fs/cgroup").iterdir()):
        if hier.name == "unified":  # hybrid v1: the runtime may add one here
            cgroups.append(hier / node.cgroup_root.lstrip("/"))
            continue
        if not hier.is_dir():
            continue
        d = hier / node.cgroup_root.lstrip("/")
        d.mkdir(exist_ok=True)
        cgroups.append(d)
        if hier.name == "cpuset":
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((hier / f).read_text())


def start_kubelet(
    node: RealNode,
    kubelet: Path,
    *,
    kubeconfig: Path,
    host_dir: Path,
    gateway: str,
    resolv_conf: Path,
) -> None:
    """Write the node's kubelet config and start the kubelet in the node's mount namespace
    (``node.kubelet``), talking to its containerd; volumes and pod dirs under ``host_dir``."""
    s = node.spec
    labels = {"moe-operator.io/real-node": "true", **s.extra_labels}
    if s.fixture:
        gpus = fixture_gpus(s.fixture)
        labels.update(
            {
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": gpus.product,
                "nvidia.com/gpu.count": str(gpus.count),
                "nvidia.com/gpu.memory": str(gpus.memory_mib),
            }
        )
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup_root,
        "cgroupsPerQOS": True,
        "failSwapOn": False,
        "address": gateway,
        "port": node.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": node.healthz_port,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [gateway],
        "clusterDomain": "cluster.local",
        "resolvConf": str(resolv_conf),
        "makeIPTablesUtilChains": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "serializeImagePulls": False,
    }
    (node.dir / "kubelet.yaml").write_text(yaml.safe_dump(cfg))
    sock = f"unix://{node.socket}"
    node.kubelet = procs.spawn(
        node.in_namespace(
            [
                str(kubelet),
                "--config",
                str(node.dir / "kubelet.yaml"),
                "--kubeconfig",
                str(kubeconfig),
                "--root-dir",
                str(host_dir / s.name / "kubelet"),
                "--cert-dir",
                str(node.dir / "pki"),
                "--hostname-override",
                s.name,
                "--node-ip",
                gateway,
                "--container-runtime=remote",
                "--container-runtime-endpoint",
                sock,
                "--image-service-endpoint",
                sock,
                "--runtime-request-timeout",
                "5m",
                "--volume-plugin-dir",
                str(node.dir / "volume-plugins"),
                "--node-labels",
                ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
                "--v",
                "1",
            ],
        ),
        node.dir / "kubelet.log",
        die_with_parent=threading.current_thread() is threading.main_thread(),
    )


def wait_ready(api_client, nodes: list[RealNode], timeout: float) -> None:
    """Until every node is Ready (and a GPU-like one has its ``nvidia.com/gpu`` allocatable);
    a kubelet that exits or a node not Ready in ``timeout`` raises with its log's tail."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    pending = {n.spec.name: n for n in nodes}
    patched: set[str] = set()
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for name, node in list(pending.items()):
            if node.kubelet.poll() is not None:
                raise RealNodesError(
                    f"kubelet {name} exited {node.kubelet.returncode}; log "
                    f"{node.dir / 'kubelet.log'}:\n{tail(node.dir / 'kubelet.log')}"
                )
            try:
                obj = core.read_node(name)
            except Exception:  # noqa: BLE001 - not registered yet
                continue
            if node.spec.fixture and name not in patched:
                _patch_gpu_node(core, name, node.spec.fixture)
                patched.add(name)
                continue
            ready = any(
                c.type == "Ready" and c.status == "True" for c in obj.status.conditions or ()
            )
            gpu_ok = not node.spec.fixture or (obj.status.allocatable or {}).get(GPU_RESOURCE)
            if ready and gpu_ok:
                del pending[name]
        time.sleep(0.5)
    if pending:
        name, node = next(iter(pending.items()))
        raise RealNodesError(
            f"node {name} not Ready after {timeout}s; log "
            f"{node.dir / 'kubelet.log'}:\n{tail(node.dir / 'kubelet.log')}"
        )


def _patch_gpu_node(core, name: str, fixture: str) -> None:
    """What the NVIDIA device plugin and the fake topology would give the node: the GPU count as
    an extended resource, the NVML recording as an annotation."""
    gpus = fixture_gpus(fixture)
    core.patch_node(
        name,
        {
            "metadata": {
                "annotations": {
                    FAKE_TOPOLOGY_ANNOTATION: fixture,
                    "moe-operator.io/fake-node": "moe_localkube.realnodes",
                }
            }
        },
        _content_type="application/merge-patch+json",
    )
    core.patch_node_status(
        name,
        {"status": {"capacity": {GPU_RESOURCE: str(gpus.count)}}},
        _content_type="application/merge-patch+json",
    )


def _cgroup_pids(cgroups: list[Path]) -> set[int]:
    pids: set[int] = set()
    for d in cgroups:
        for procs_file in d.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in procs_file.read_text().split())
    return pids


def kill_cgroup_processes(cgroups: list[Path], timeout: float = 10.0) -> None:
    """Whatever still runs in the nodes' cgroup roots is a container process of ours whose
    runtime is gone (a killed shim leaves its container running, reparented to init)."""
    deadline = time.monotonic() + timeout
    while (pids := _cgroup_pids(cgroups)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def remove_pod_logs(pod_uids: set[str]) -> None:
    """The ``/var/log/pods`` entries of the nodes' pods, and dangling ``/var/log/containers``
    links."""
    for uid in pod_uids:
        for d in Path("/var/log/pods").glob(f"*_{uid}"):
            shutil.rmtree(d, ignore_errors=True)
    for link in Path("/var/log/containers").glob("*.log"):
        if link.is_symlink() and not link.exists():
            link.unlink(missing_ok=True)
