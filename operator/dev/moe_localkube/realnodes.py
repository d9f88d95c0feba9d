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
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import moe_fake_nvml

from . import binaries, procs
from .controlplane import ControlPlane, free_ports
from .images import PAUSE_IMAGE, pause_image_tar, remove_cgroup_tree, unmount_under
from .nodes import FAKE_NVML_ENV, FAKE_TOPOLOGY_ANNOTATION, GPU_RESOURCE, fixture_gpus

STATE_DIR = Path("/run/moe-localkube")
HOST_DIR = Path("/var/lib/moe-localkube")
SERVICE_IP = "10.0.0.1"  # first address of controlplane.SERVICE_CIDR
KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
HOST_PATHS = (
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet",
    "/var/log/pods",
    "/var/log/containers",
)
CNI_BIN_DIR = "/usr/lib/cni"
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


class RealNodesError(RuntimeError):
    """A node did not come up (the message names the log to read)."""


@dataclass(frozen=True)
class RealNodeSpec:
    name: str
    fixture: str | None = "nvswitch-h100-8"  # None: a plain CPU node
    extra_labels: dict[str, str] = field(default_factory=dict)


def _run(
    *argv: str, check: bool = True, input: bytes | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, input=input, timeout=timeout)
    if check and res.returncode != 0:
        raise RealNodesError(
            f"{' '.join(argv)} exited {res.returncode}: "
            f"{res.stderr.decode(errors='replace').strip()[-2000:]}"
        )
    return res


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


# ---------------------------------------------------------------- host-wide shared state


class SharedHostState:
    """Sysctls the kubelet rewrites are global: the first cluster of the machine saves them, the
    last one to stop restores them (members are tracked by pid under ``/run/moe-localkube``)."""

    def __init__(self, member: str, run_dir: Path | None = None):
        self.member = member
        self.run_dir = run_dir
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.lock_path = STATE_DIR / "host.lock"
        self.members_dir = STATE_DIR / "members"
        self.saved = STATE_DIR / "sysctl.saved.json"

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _live_members(self) -> list[Path]:
        out = []
        for p in self.members_dir.glob("*"):
            try:
                words = p.read_text().split()
                os.kill(int(words[0]), 0)
                out.append(p)
            except (OSError, ValueError, IndexError):
                # a member that died without stopping (SIGKILL): undo what it left
                with contextlib.suppress(Exception):
                    reap_dead_cluster(p.name, Path(words[1]) if len(words) > 1 else None)
                p.unlink(missing_ok=True)
        return out

    def enter(self) -> None:
        with self._locked():
            self.members_dir.mkdir(exist_ok=True)
            if not self._live_members() and self.saved.exists():
                self._restore()  # saved by clusters that all died without stopping
            if not self.saved.exists():
                values = {}
                for key in KUBELET_SYSCTLS:
                    with contextlib.suppress(OSError):
                        values[key] = _sysctl_path(key).read_text().strip()
                paths = {p: os.path.exists(p) for p in HOST_PATHS}
                self.saved.write_text(json.dumps({"sysctls": values, "paths": paths}))
            (self.members_dir / self.member).write_text(f"{os.getpid()}\n{self.run_dir or ''}\n")

    def leave(self) -> dict[str, str]:
        """Restore when this was the last member; return what was restored."""
        restored: dict[str, str] = {}
        with self._locked():
            (self.members_dir / self.member).unlink(missing_ok=True)
            if self._live_members() or not self.saved.exists():
                return restored
            return self._restore()

    def _restore(self) -> dict[str, str]:
        """Write the saved sysctls back and remove the host dirs the kubelets created (lock
        held)."""
        restored: dict[str, str] = {}
        saved = json.loads(self.saved.read_text())
        for key, value in saved.get("sysctls", {}).items():
            path = _sysctl_path(key)
            with contextlib.suppress(OSError):
                if path.read_text().strip() != value:
                    path.write_text(value)
                    restored[key] = value
        for p, existed in sorted(saved.get("paths", {}).items(), key=lambda kv: -len(kv[0])):
            if not existed and os.path.isdir(p):
                _remove_if_only_sockets(Path(p))
        self.saved.unlink(missing_ok=True)
        return restored


def _remove_if_only_sockets(path: Path) -> None:
    """Remove a host directory the kubelet created, if all it holds is sockets/empty dirs."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for f in files:
            fp = Path(root) / f
            if fp.is_socket():
                fp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.rmdir(root)


# ---------------------------------------------------------------- the nodes


@dataclass
class _Node:
    spec: RealNodeSpec
    dir: Path
    socket: Path
    cgroup_root: str
    kubelet_port: int
    healthz_port: int
    containerd: subprocess.Popen | None = None
    kubelet: subprocess.Popen | None = None
    load_error: BaseException | None = None
    holder: subprocess.Popen | None = None  # keeps the node's private mount namespace
    root: Path | None = None  # containerd root (content store, snapshots)
    root_lock: int | None = None


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
        self._nodes: list[_Node] = []
        self._slot_fd: int | None = None
        self.slot = -1
        self.bridge = self.gateway = self.subnet = ""
        self._rules: list[tuple[str, list[str]]] = []  # (table, rule spec) added with -I
        self._cgroups: list[Path] = []
        self._netns: set[str] = set()
        self._pod_uids: set[str] = set()
        self._host: SharedHostState | None = None
        self._dns = None
        self._stopped = False
        self._started = False
        self._lock = threading.Lock()

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
        self._network()
        from .clusterdns import ClusterDNS

        self._dns = ClusterDNS(self.cp.api_client(), self.gateway).start()

        pause_tar = pause_image_tar(self.run_dir / "pause.tar", bins["pause"])
        ports = free_ports(2 * len(self.specs))
        for i, spec in enumerate(self.specs):
            d = self.run_dir / f"node-{spec.name}"
            d.mkdir(parents=True, exist_ok=True)
            self._nodes.append(
                _Node(
                    spec,
                    d,
                    d / "containerd.sock",
                    f"/moe-{self.id}-{i}",
                    ports[2 * i],
                    ports[2 * i + 1],
                )
            )
        t0 = time.monotonic()
        for node in self._nodes:
            self._start_containerd(node)
        self.timings["containerd up"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        loaders = [
            threading.Thread(
                target=self._load_images, args=(n, [(pause_tar, (PAUSE_IMAGE,)), *self.images])
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
            self._start_kubelet(node, bins["kubelet"])
        self._wait_nodes()
        self.timings["kubelets ready"] = round(time.monotonic() - t0, 2)

    # ------------------------------------------------------------ network
    @staticmethod
    def _reap_stale_rules() -> None:
        """Delete iptables rules of clusters whose process died without stopping (SIGKILL): each
        rule names its cluster as ``moe-localkube <pid>-<random>``."""
        import shlex

        for table in ("nat", "filter"):
            rules = (
                _run("iptables", "-w", "-t", table, "-S", check=False).stdout.decode().splitlines()
            )
            for rule in rules:
                words = shlex.split(rule)
                if len(words) < 2 or words[0] != "-A" or "--comment" not in words:
                    continue
                comment = words[words.index("--comment") + 1]
                if not comment.startswith("moe-localkube "):
                    continue
                try:
                    os.kill(int(comment.split()[1].split("-")[0]), 0)
                    continue  # its cluster is alive
                except ProcessLookupError:
                    pass
                except (ValueError, PermissionError):
                    continue
                _run("iptables", "-w", "-t", table, "-D", *words[1:], check=False)

    def _network(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._reap_stale_rules()
        existing = _run("ip", "-o", "link", "show").stdout.decode()
        for slot in range(200):
            fd = os.open(STATE_DIR / f"slot-{slot}.lock", os.O_CREAT | os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            if f" moekb{slot}:" in existing or f" moekb{slot}@" in existing:
                # a bridge left by a cluster that died without stopping: take it over
                _run("ip", "link", "del", f"moekb{slot}", check=False)
            self._slot_fd, self.slot = fd, slot
            break
        else:
            raise RealNodesError("no free network slot (200 clusters running?)")
        self.bridge = f"moekb{self.slot}"
        self.subnet = f"10.217.{self.slot}.0/24"
        self.gateway = f"10.217.{self.slot}.1"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/route_localnet").write_text("1")
        tag = ["-m", "comment", "--comment", f"moe-localkube {self.id}"]
        self._iptables(
            "nat",
            [
                "PREROUTING",
                "-i",
                self.bridge,
                "-d",
                f"{SERVICE_IP}/32",
                "-p",
                "tcp",
                "--dport",
                "443",
                *tag,
                "-j",
                "DNAT",
                "--to-destination",
                f"127.0.0.1:{self.cp.port}",
            ],
        )
        net_d = self.run_dir / "cni" / "net.d"
        net_d.mkdir(parents=True, exist_ok=True)
        (net_d / "10-moe.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": f"moe-{self.slot}",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": self.bridge,
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": self.subnet, "gateway": self.gateway}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(self.run_dir / "cni" / "ipam"),
                            },
                        }
                    ],
                },
                indent=1,
            )
        )
        (self.run_dir / "resolv.conf").write_text("")  # no host search domains in pods

    def _iptables(self, table: str, rule: list[str]) -> None:
        _run("iptables", "-w", "-t", table, "-I", *rule)
        self._rules.append((table, rule))

    # ------------------------------------------------------------ containerd
    def _base_spec(self, node: _Node) -> Path | None:
        if not node.spec.fixture:
            return None
        fixture_gpus(node.spec.fixture)  # unknown fixture: fail here, not in a pod
        spec = json.loads(_run("ctr", "oci", "spec").stdout)
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

    def _containerd_root(self, node: _Node) -> Path:
        """The image store survives between runs (importing a 2 GB image into two containerds
        costs minutes): ``<cache>/containerd/<node>``, locked while in use; a second concurrent
        cluster with the same node name gets a fresh one in its run dir."""
        if self.persistent_images:
            base = binaries.cache_root() / "containerd"
            base.mkdir(parents=True, exist_ok=True)
            fd = os.open(base / f".{node.spec.name}.lock", os.O_CREAT | os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                node.root_lock = fd
                return base / node.spec.name
            except OSError:
                os.close(fd)
        return self.host_dir / node.spec.name / "root"

    def _start_holder(self, node: _Node) -> None:
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
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "bash",
                "-c",
                "\n".join(lines),
            ],
            node.dir / "namespace.log",
            die_with_parent=threading.current_thread() is threading.main_thread(),
        )
        deadline = time.monotonic() + 30
        while not ready.exists():
            if node.holder.poll() is not None or time.monotonic() > deadline:
                raise RealNodesError(
                    f"the mount namespace of {node.spec.name} did not come up; "
                    f"log {node.dir / 'namespace.log'}:\n{_tail(node.dir / 'namespace.log')}"
                )
            time.sleep(0.05)

    def _in_node(self, node: _Node, argv: list[str]) -> list[str]:
        return ["nsenter", f"--mount=/proc/{node.holder.pid}/ns/mnt", "--", *argv]

    def _start_containerd(self, node: _Node) -> None:
        self._start_holder(node)
        node.root = self._containerd_root(node)
        base = self._base_spec(node)
        runc = 'runtime_type = "io.containerd.runc.v2"\n'
        if base:
            runc += f'      base_runtime_spec = "{base}"\n'
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (node.dir / "config.toml").write_text(f"""version = 2
root = "{node.root}"
state = "{self.host_dir / node.spec.name / "state"}"
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
    conf_dir = "{self.run_dir / "cni" / "net.d"}"
""")
        node.containerd = procs.spawn(
            self._in_node(node, ["containerd", "--config", str(node.dir / "config.toml")]),
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
            if node.socket.exists() and self._ctr(node, "version", check=False).returncode == 0:
                self._force_remove_containers(node)  # left in a kept root by a killed run
                return
            time.sleep(0.2)
        raise RealNodesError(
            f"containerd for {node.spec.name} not answering; log {node.dir / 'containerd.log'}"
        )

    def _ctr(
        self, node: _Node, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess:
        return _run(
            "ctr", "-a", str(node.socket), "-n", "k8s.io", *args, check=check, timeout=timeout
        )

    def _load_images(self, node: _Node, images: list[tuple[Path, tuple[str, ...]]]) -> None:
        """Import what the node's image store lacks; drop images no longer wanted (a kept store
        would grow with every rebuild)."""
        try:
            have = set(self._ctr(node, "images", "ls", "-q").stdout.decode().split())
            wanted = set()
            for tar, tags in images:
                refs = [_normalize_ref(t) for t in tags]
                wanted.update(refs)
                # the first tag is the content tag: present means this exact image is there
                if refs and all(r in have for r in refs):
                    continue
                self._ctr(node, "images", "import", str(tar))
            if wanted and all(tags for _, tags in images):
                # drop older builds of the images we manage, and the runtime's sha256:<id>
                # references to images no wanted tag points at (they would keep the content)
                digests: dict[str, str] = {}
                for line in self._ctr(node, "images", "ls").stdout.decode().splitlines()[1:]:
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
                        self._ctr(node, "images", "rm", ref, check=False)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            node.load_error = exc

    # ------------------------------------------------------------ kubelet
    def _cgroup_root(self, node: _Node) -> None:
        for hier in sorted(Path("/sys/fs/cgroup").iterdir()):
            if hier.name == "unified":  # hybrid v1: the runtime may add one here
                self._cgroups.append(hier / node.cgroup_root.lstrip("/"))
                continue
            if not hier.is_dir():
                continue
            d = hier / node.cgroup_root.lstrip("/")
            d.mkdir(exist_ok=True)
            self._cgroups.append(d)
            if hier.name == "cpuset":
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((hier / f).read_text())

    def _start_kubelet(self, node: _Node, kubelet: Path) -> None:
        self._cgroup_root(node)
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
            "address": self.gateway,
            "port": node.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": node.healthz_port,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDNS": [self.gateway],
            "clusterDomain": "cluster.local",
            "resolvConf": str(self.run_dir / "resolv.conf"),
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
        # only the API server (from the host) may talk to the kubelet; pods on the bridge may not
        self._iptables(
            "filter",
            [
                "INPUT",
                "-i",
                self.bridge,
                "-p",
                "tcp",
                "--dport",
                str(node.kubelet_port),
                "-m",
                "comment",
                "--comment",
                f"moe-localkube {self.id}",
                "-j",
                "DROP",
            ],
        )
        sock = f"unix://{node.socket}"
        node.kubelet = procs.spawn(
            self._in_node(
                node,
                [
                    str(kubelet),
                    "--config",
                    str(node.dir / "kubelet.yaml"),
                    "--kubeconfig",
                    str(self.cp.kubeconfig),
                    "--root-dir",
                    str(self.host_dir / s.name / "kubelet"),
                    "--cert-dir",
                    str(node.dir / "pki"),
                    "--hostname-override",
                    s.name,
                    "--node-ip",
                    self.gateway,
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

    def _wait_nodes(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.cp.api_client())
        pending = {n.spec.name: n for n in self._nodes}
        patched: set[str] = set()
        deadline = time.monotonic() + self.ready_timeout
        while pending and time.monotonic() < deadline:
            for name, node in list(pending.items()):
                if node.kubelet.poll() is not None:
                    raise RealNodesError(
                        f"kubelet {name} exited {node.kubelet.returncode}; log "
                        f"{node.dir / 'kubelet.log'}:\n{_tail(node.dir / 'kubelet.log')}"
                    )
                try:
                    obj = core.read_node(name)
                except Exception:  # noqa: BLE001 - not registered yet
                    continue
                if node.spec.fixture and name not in patched:
                    gpus = fixture_gpus(node.spec.fixture)
                    core.patch_node(
                        name,
                        {
                            "metadata": {
                                "annotations": {
                                    FAKE_TOPOLOGY_ANNOTATION: node.spec.fixture,
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
                f"node {name} not Ready after {self.ready_timeout}s; log "
                f"{node.dir / 'kubelet.log'}:\n{_tail(node.dir / 'kubelet.log')}"
            )

    # ------------------------------------------------------------ inspection
    def ctr(self, node_name: str, *args: str) -> str:
        """``ctr -n k8s.io ARGS`` against ``node_name``'s containerd; returns stdout."""
        node = next(n for n in self._nodes if n.spec.name == node_name)
        return self._ctr(node, *args).stdout.decode()

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
                    out = self._ctr(node, "tasks", "ls", check=False, timeout=30).stdout.decode()
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
                step(self._force_remove_containers, node)
                step(procs.stop, node.containerd, 10)
        step(self._kill_shims)
        for node in self._nodes:
            if node.holder is not None:
                step(procs.stop, node.holder, 5)
        for node in self._nodes:
            if node.root is not None and not str(node.root).startswith(str(self.host_dir)):
                step(unmount_under, node.root)
            if node.root_lock is not None:
                os.close(node.root_lock)
                node.root_lock = None
        if self.bridge:
            self._netns.update(f"/run/netns/{n}" for n in _netns_on_bridge(self.bridge))
        for ns in sorted(self._netns):
            step(_remove_netns, ns)
        step(unmount_under, self.run_dir)
        step(unmount_under, self.host_dir)
        if not any(True for _ in _mounts_under(self.host_dir)):
            shutil.rmtree(self.host_dir, ignore_errors=True)
        step(self._kill_cgroup_processes)
        for d in self._cgroups:
            step(remove_cgroup_tree, d)
        step(self._remove_pod_logs)
        for table, rule in reversed(self._rules):
            _run("iptables", "-w", "-t", table, "-D", *rule, check=False)
        self._rules.clear()
        if self._dns is not None:
            step(self._dns.stop)
        if self.bridge:
            _run("ip", "link", "del", self.bridge, check=False)
        step(self._delete_node_objects)
        if self._host is not None:
            step(self._host.leave)
        if self._slot_fd is not None:
            os.close(self._slot_fd)
            self._slot_fd = None
        if errors:
            raise errors[0]

    def _force_remove_containers(self, node: _Node) -> None:
        ids = (
            self._ctr(node, "containers", "ls", "-q", check=False, timeout=30)
            .stdout.decode()
            .split()
        )
        for cid in ids:
            info = self._ctr(node, "containers", "info", cid, check=False, timeout=30).stdout
            with contextlib.suppress(ValueError, KeyError, TypeError):
                for ns in json.loads(info)["Spec"]["linux"]["namespaces"]:
                    if ns.get("type") == "network" and ns.get("path", "").startswith(
                        "/var/run/netns/"
                    ):
                        self._netns.add(ns["path"])
            self._ctr(node, "tasks", "kill", "-s", "SIGKILL", cid, check=False, timeout=30)
        for cid in ids:
            for _ in range(20):
                if (
                    self._ctr(
                        node, "tasks", "delete", "-f", cid, check=False, timeout=30
                    ).returncode
                    != 0
                ):
                    break
                time.sleep(0.1)
            self._ctr(node, "containers", "delete", cid, check=False, timeout=30)

    def _cgroup_pids(self) -> set[int]:
        pids: set[int] = set()
        for d in self._cgroups:
            for procs_file in d.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(x) for x in procs_file.read_text().split())
        return pids

    def _kill_cgroup_processes(self, timeout: float = 10.0) -> None:
        """Whatever still runs in the nodes' cgroup roots is a container process of ours whose
        runtime is gone (a killed shim leaves its container running, reparented to init)."""
        deadline = time.monotonic() + timeout
        while (pids := self._cgroup_pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def _kill_shims(self) -> None:
        """containerd-shim processes leave containerd's process group (setsid): find ours by the
        containerd socket in their command line."""
        socks = {str(n.socket) for n in self._nodes}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                argv
                and b"containerd-shim" in argv[0]
                and any(a.decode(errors="replace") in socks for a in argv)
            ):
                with contextlib.suppress(OSError):
                    os.kill(int(entry.name), signal.SIGKILL)

    def _remove_pod_logs(self) -> None:
        for uid in self._pod_uids:
            for d in Path("/var/log/pods").glob(f"*_{uid}"):
                shutil.rmtree(d, ignore_errors=True)
        for link in Path("/var/log/containers").glob("*.log"):
            if link.is_symlink() and not link.exists():
                link.unlink(missing_ok=True)

    def _delete_node_objects(self) -> None:
        from kubernetes import client

        with contextlib.suppress(Exception):
            core = client.CoreV1Api(self.cp.api_client())
            for name in self.names:
                with contextlib.suppress(Exception):
                    core.delete_node(name, _request_timeout=5)


def _netns_on_bridge(bridge: str) -> list[str]:
    """Names of the network namespaces whose veth peers hang on ``bridge`` (the pods')."""
    out = _run("ip", "-o", "link", "show", "master", bridge, check=False).stdout.decode()
    return sorted({m.split()[1] for m in re.findall(r"link-netns \S+", out)})


def _mounts_under(prefix: Path):
    pre = os.path.realpath(str(prefix)).rstrip("/")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if mp == pre or mp.startswith(pre + "/"):
                yield mp


def _remove_netns(path: str) -> None:
    unmount_under(Path(path))
    Path(path).unlink(missing_ok=True)


def reap_dead_cluster(cluster_id: str, run_dir: Path | None) -> None:
    """Undo what a cluster whose process died without ``stop()`` left on the host (the next
    cluster of the machine calls this): its iptables rules, pod network namespaces and bridge
    (when its slot lock is free), mounts under its run dir, cgroup roots."""
    RealNodes._reap_stale_rules()
    for link in (
        _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.decode().splitlines()
    ):
        name = link.split(":")[1].strip().split("@")[0] if ":" in link else ""
        if not name.startswith("moekb") or not name[5:].isdigit():
            continue
        fd = os.open(STATE_DIR / f"slot-{name[5:]}.lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # in use by a live cluster
        finally:
            os.close(fd)
        for ns in _netns_on_bridge(name):
            _remove_netns(f"/run/netns/{ns}")
        _run("ip", "link", "del", name, check=False)
    if run_dir is not None and str(run_dir).startswith(str(HOST_DIR) + "/"):
        unmount_under(run_dir)
        if not any(True for _ in _mounts_under(run_dir)):
            shutil.rmtree(run_dir, ignore_errors=True)
    for d in Path("/sys/fs/cgroup").glob(f"*/moe-{cluster_id}-*"):
        remove_cgroup_tree(d)


def _normalize_ref(ref: str) -> str:
    """Docker-style short reference -> containerd's full name (``moe-x:1`` ->
    ``docker.io/library/moe-x:1``; ``localhost/x:1`` stays)."""
    name = ref
    first = name.split("/", 1)[0]
    if "/" not in name:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    return name


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "<no log>"


def host_leftovers(nodes: RealNodes) -> list[str]:
    """What ``nodes`` left on the host after ``stop()`` (empty when it cleaned up)."""
    out = []
    if nodes.bridge and _run("ip", "link", "show", nodes.bridge, check=False).returncode == 0:
        out.append(f"bridge {nodes.bridge}")
    for table in ("nat", "filter"):
        rules = _run("iptables", "-w", "-t", table, "-S", check=False).stdout.decode()
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
                os.path.realpath(n) for n in nodes._netns
            }:
                out.append(f"mount {mp}")
    if nodes.host_dir.exists():
        out.append(f"directory {nodes.host_dir}")
    for pid in procs.survivors(nodes.pids):
        out.append(f"process group {pid}")
    socks = {str(n.socket) for n in nodes._nodes}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.decode(errors="replace") in socks for a in argv):
                out.append(f"process {entry.name}: {b' '.join(argv)[:120]!r}")
    return out
