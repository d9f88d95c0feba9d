"""A real node's container runtime: its private mount namespace (the ``holder`` process), its own
containerd (own root, state and socket: two kubelets on one containerd kill each other's pods as
orphans; ``restrict_oom_score_adj`` since this kind of VM lacks CAP_SYS_RESOURCE; cgroupfs), the
base runtime spec that gives a GPU-like node's containers the fake driver, the image store (kept
between runs under the cache, imports only what it lacks), and removing containers and runtime
shims on stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import moe_fake_nvml

from . import binaries, procs
from .image_tars import PAUSE_IMAGE
from .nodes import FAKE_NVML_ENV, fixture_gpus
from .realnode import RealNode, RealNodesError, run, tail
from .realnode_net import CNI_BIN_DIR


def ctr(
    node: RealNode, *args: str, check: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``ctr -n k8s.io ARGS`` against ``node``'s containerd."""
    return run("ctr", "-a", str(node.socket), "-n", "k8s.io", *args, check=check, timeout=timeout)


def start_containerd(
    node: RealNode,
    *,
    host_dir: Path,
    cni_conf_dir: Path,
    persistent_images: bool,
    netns: set[str],
) -> None:
    """The node's mount namespace, then its containerd (state under ``host_dir``); waits until it
    answers. Containers a killed run left in a kept root are removed (their network namespaces
    added to ``netns``)."""
    start_holder(node)
    node.root = containerd_root(node, host_dir, persistent_images)
    base = base_spec(node)
    runc = 'runtime_type = "io.containerd.runc.v2"\n'
    if base:
        runc += f'      base_runtime_spec = "{base}"\n'
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    (node.dir / "config.toml").write_text(f"""version = 2
root = "{node.root}"
state = "{host_dir / node.spec.name / "state"}"
oom_score = 0
[grpc]
  address = "{node.socket}"
[ttrpc]
  address = ""
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{node.dir / "opt"}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_tls_streaming = false
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      {runc}
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf_dir}"
""")
    node.containerd = procs.spawn(
        node.in_namespace(["containerd", "--config", str(node.dir / "config.toml")]),
        node.dir / "containerd.log",
        die_with_parent=threading.current_thread() is threading.main_thread(),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if node.containerd.poll() is not None:
            raise RealNodesError(
                f"containerd for {node.spec.name} exited {node.containerd.returncode}; "
                f"log {node.dir / 'containerd.log'}"
            )
        if node.socket.exists() and ctr(node, "version", check=False).returncode == 0:
            force_remove_containers(node, netns)  # left in a kept root by a killed run
            return
        time.sleep(0.2)
    raise RealNodesError(
        f"containerd for {node.spec.name} not answering; log {node.dir / 'containerd.log'}"
    )


def base_spec(node: RealNode) -> Path | None:
    if not node.spec.fixture:
        return None
    fixture_gpus(node.spec.fixture)  # unknown fixture: fail here, not in a pod
    spec = json.loads(run("ctr", "oci", "spec").stdout)
    # The fake driver, as the NVIDIA container runtime injects the real one: the dev package's
    # moe_fake_nvml (the images do not have it), read-only, on PYTHONPATH, and the fixture.
    driver = moe_fake_nvml.runtime_mount(node.dir / "fake-nvml")
    spec.setdefault("mounts", []).append(
        {
            "destination": moe_fake_nvml.CONTAINER_DIR,
            "type": "bind",
            "source": str(driver),
            "options": ["rbind", "ro", "nosuid", "nodev"],
        }
    )
    ours = (FAKE_NVML_ENV + "=", "PYTHONPATH=")
    env = [e for e in spec["process"].get("env", []) if not e.startswith(ours)]
    spec["process"]["env"] = [
        *env,
        f"{FAKE_NVML_ENV}={node.spec.fixture}",
        f"PYTHONPATH={moe_fake_nvml.CONTAINER_DIR}",
    ]
    path = node.dir / "base-spec.json"
    path.write_text(json.dumps(spec))
    return path


def containerd_root(node: RealNode, host_dir: Path, persistent_images: bool) -> Path:
    """The image store survives between runs (importing a 2 GB image into two containerds
    costs minutes): ``<cache>/containerd/<node>``, locked while in use; a second concurrent
    cluster with the same node name gets a fresh one in its run dir."""
    if persistent_images:
        base = binaries.cache_root() / "containerd"
        base.mkdir(parents=True, exist_ok=True)
        fd = os.open(base / f".{node.spec.name}.lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            node.root_lock = fd
            return base / node.spec.name
        except OSError:
            os.close(fd)
    return host_dir / node.spec.name / "root"


def start_holder(node: RealNode) -> None:
    """A private mount namespace for the node's containerd and kubelet (and so its pods).
    The 1.20 kubelet hard-codes ``/var/log/pods`` (and deletes the log dirs of pods it does
    not know: the other node's) and ``/var/lib/kubelet/device-plugins``; each node gets its own
    bound there. Every mount the node makes (volumes, container root filesystems, network
    namespace files) stays in that namespace and goes with its last process."""
    binds = {
        node.dir / "var-log-pods": "/var/log/pods",
        node.dir / "var-log-containers": "/var/log/containers",
        node.dir / "device-plugins": "/var/lib/kubelet/device-plugins",
    }
    ready = node.dir / "namespace.ready"
    lines = ["set -e"]
    for src, dst in binds.items():
        src.mkdir(parents=True, exist_ok=True)
        lines += [f"mkdir -p {dst}", f"mount --bind {src} {dst}"]
    lines += [f": > {ready}", "exec sleep infinity"]
    node.holder = procs.spawn(
        ["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", "\n".join(lines)],
        node.dir / "namespace.log",
        die_with_parent=threading.current_thread() is threading.main_thread(),
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if node.holder.poll() is not None or time.monotonic() > deadline:
            raise RealNodesError(
                f"the mount namespace of {node.spec.name} did not come up; "
                f"log {node.dir / 'namespace.log'}:\n{tail(node.dir / 'namespace.log')}"
            )
        time.sleep(0.05)


def load_images(node: RealNode, images: list[tuple[Path, tuple[str, ...]]]) -> None:
    """Import what the node's image store lacks; drop images no longer wanted (a kept store
    would grow with every rebuild). Runs in a thread per node: an error lands in
    ``node.load_error``."""
    try:
        have = set(ctr(node, "images", "ls", "-q").stdout.decode().split())
        wanted = set()
        for tar, tags in images:
            refs = [normalize_ref(t) for t in tags]
            wanted.update(refs)
            # the first tag is the content tag: present means this exact image is there
            if refs and all(r in have for r in refs):
                continue
            ctr(node, "images", "import", str(tar))
        if wanted and all(tags for _, tags in images):
            # drop older builds of the images we manage, and the runtime's sha256:<id>
            # references to images no wanted tag points at (they would keep the content)
            digests: dict[str, str] = {}
            for line in ctr(node, "images", "ls").stdout.decode().splitlines()[1:]:
                cols = line.split()
                if len(cols) >= 3:
                    digests[cols[0]] = cols[2]
            keep = {digests.get(r) for r in wanted}
            managed = {r.rsplit(":", 1)[0] for r in wanted}
            for ref, digest in sorted(digests.items()):
                if ref in wanted:
                    continue
                if ref.rsplit(":", 1)[0] in managed or (
                    ref.startswith("sha256:") and digest not in keep
                ):
                    ctr(node, "images", "rm", ref, check=False)
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
        node.load_error = exc


def normalize_ref(ref: str) -> str:
    """Docker-style short reference -> containerd's full name (``moe-x:1`` ->
    ``docker.io/library/moe-x:1``; ``localhost/x:1`` stays)."""
    name = ref
    first = name.split("/", 1)[0]
    if "/" not in name:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    return name


def force_remove_containers(node: RealNode, netns: set[str]) -> None:
    """Kill and delete every container of the node's containerd; their network namespace files
    are added to ``netns`` (removed later, with the bridge's)."""
    ids = ctr(node, "containers", "ls", "-q", check=False, timeout=30).stdout.decode().split()
    for cid in ids:
        info = ctr(node, "containers", "info", cid, check=False, timeout=30).stdout
        with contextlib.suppress(ValueError, KeyError, TypeError):
            for ns in json.loads(info)["Spec"]["linux"]["namespaces"]:
                if ns.get("type") == "network" and ns.get("path", "").startswith("/var/run/netns/"):
                    netns.add(ns["path"])
        ctr(node, "tasks", "kill", "-s", "SIGKILL", cid, check=False, timeout=30)
    for cid in ids:
        for _ in range(20):
            if ctr(node, "tasks", "delete", "-f", cid, check=False, timeout=30).returncode != 0:
                break
            time.sleep(0.1)
        ctr(node, "containers", "delete", cid, check=False, timeout=30)


def processes_naming(sockets: set[str]) -> list[tuple[int, list[bytes]]]:
    """(pid, argv) of the processes whose command line names one of ``sockets`` (containerd
    sockets: the containerds and their runtime shims)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.decode(errors="replace") in sockets for a in argv):
            out.append((int(entry.name), argv))
    return out


def kill_shims(sockets: set[str]) -> None:
    """containerd-shim processes leave containerd's process group (setsid): find ours by the
    containerd socket in their command line."""
    for pid, argv in processes_naming(sockets):
        if argv and b"containerd-shim" in argv[0]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
