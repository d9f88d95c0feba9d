"""The real nodes' network: one Linux bridge per cluster (``moekb<slot>``,
``10.217.<slot>.0/24``) with the CNI ``bridge`` + ``host-local`` config both nodes' containerds
read, the iptables rules (the ``kubernetes`` Service DNAT to the loopback API server, the INPUT
rules that keep pods off the kubelet ports), and the pods' network namespaces; their removal on
stop, and the reaping of what a cluster that died without stopping left (rules, bridges, netns).

Every rule carries the comment ``moe-localkube <cluster id>`` (the id starts with the pid), so
rules of dead clusters can be found and removed one by one: nothing is flushed. A slot is held by
a lock file under ``STATE_DIR`` while its cluster lives.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
from pathlib import Path

from .dockerd import unmount_under
from .realnode import STATE_DIR, RealNodesError, run

SERVICE_IP = "10.0.0.1"  # first address of controlplane.SERVICE_CIDR
CNI_BIN_DIR = "/usr/lib/cni"


class BridgeNetwork:
    """The network of one cluster ``cluster_id``. Attributes after ``up()``: ``slot``,
    ``bridge``, ``gateway`` (also each node's InternalIP and the cluster DNS address),
    ``subnet``, ``cni_conf_dir`` (containerd's CNI ``conf_dir``), ``resolv_conf`` (the
    kubelet's); ``netns``: pod network namespace files to remove on stop."""

    def __init__(self, cluster_id: str):
        self.cluster_id = cluster_id
        self.slot = -1
        self.bridge = self.gateway = self.subnet = ""
        self.cni_conf_dir: Path | None = None
        self.resolv_conf: Path | None = None
        self.netns: set[str] = set()
        self._rules: list[tuple[str, list[str]]] = []  # (table, rule spec) added with -I
        self._slot_fd: int | None = None

    @property
    def tag(self) -> list[str]:
        return ["-m", "comment", "--comment", f"moe-localkube {self.cluster_id}"]

    def up(self, api_port: int, run_dir: Path) -> None:
        """Take a free slot, create its bridge, route the ``kubernetes`` Service address to the
        API server on ``127.0.0.1:api_port`` and write the CNI config under ``run_dir``."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        reap_stale_rules()
        existing = run("ip", "-o", "link", "show").stdout.decode()
        for slot in range(200):
            fd = os.open(STATE_DIR / f"slot-{slot}.lock", os.O_CREAT | os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            if f" moekb{slot}:" in existing or f" moekb{slot}@" in existing:
                # a bridge left by a cluster that died without stopping: take it over
                run("ip", "link", "del", f"moekb{slot}", check=False)
            self._slot_fd, self.slot = fd, slot
            break
        else:
            raise RealNodesError("no free network slot (200 clusters running?)")
        self.bridge = f"moekb{self.slot}"
        self.subnet = f"10.217.{self.slot}.0/24"
        self.gateway = f"10.217.{self.slot}.1"
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/route_localnet").write_text("1")
        self.add_rule(
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
                *self.tag,
                "-j",
                "DNAT",
                "--to-destination",
                f"127.0.0.1:{api_port}",
            ],
        )
        self.cni_conf_dir = run_dir / "cni" / "net.d"
        self.cni_conf_dir.mkdir(parents=True, exist_ok=True)
        (self.cni_conf_dir / "10-moe.conflist").write_text(
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
                                "dataDir": str(run_dir / "cni" / "ipam"),
                            },
                        }
                    ],
                },
                indent=1,
            )
        )
        self.resolv_conf = run_dir / "resolv.conf"
        self.resolv_conf.write_text("")  # no host search domains in pods

    def add_rule(self, table: str, rule: list[str]) -> None:
        run("iptables", "-w", "-t", table, "-I", *rule)
        self._rules.append((table, rule))

    def block_from_pods(self, port: int) -> None:
        """Only the API server (from the host) may talk to ``port`` (a kubelet's); pods on the
        bridge may not."""
        self.add_rule(
            "filter",
            [
                "INPUT",
                "-i",
                self.bridge,
                "-p",
                "tcp",
                "--dport",
                str(port),
                *self.tag,
                "-j",
                "DROP",
            ],
        )

    # ------------------------------------------------------------ stop (in RealNodes' order)
    def pod_namespaces(self) -> list[str]:
        """The pods' network namespace files: those the runtime named, and those whose veth still
        hangs on the bridge."""
        if self.bridge:
            self.netns.update(f"/run/netns/{n}" for n in netns_on_bridge(self.bridge))
        return sorted(self.netns)

    def remove_rules(self) -> None:
        for table, rule in reversed(self._rules):
            run("iptables", "-w", "-t", table, "-D", *rule, check=False)
        self._rules.clear()

    def delete_bridge(self) -> None:
        if self.bridge:
            run("ip", "link", "del", self.bridge, check=False)

    def release_slot(self) -> None:
        if self._slot_fd is not None:
            os.close(self._slot_fd)
            self._slot_fd = None


def reap_stale_rules() -> None:
    """Delete iptables rules of clusters whose process died without stopping (SIGKILL): each
    rule names its cluster as ``moe-localkube <pid>-<random>``."""
    for table in ("nat", "filter"):
        rules = run("iptables", "-w", "-t", table, "-S", check=False).stdout.decode().splitlines()
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
            run("iptables", "-w", "-t", table, "-D", *words[1:], check=False)


def reap_free_bridges() -> None:
    """Delete the bridges (and the pod namespaces on them) whose slot lock no live cluster
    holds."""
    for link in (
        run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.decode().splitlines()
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
        for ns in netns_on_bridge(name):
            remove_netns(f"/run/netns/{ns}")
        run("ip", "link", "del", name, check=False)


def netns_on_bridge(bridge: str) -> list[str]:
    """Names of the network namespaces whose veth peers hang on ``bridge`` (the pods')."""
    out = run("ip", "-o", "link", "show", "master", bridge, check=False).stdout.decode()
    return sorted({m.split()[1] for m in re.findall(r"link-netns \S+", out)})


def remove_netns(path: str) -> None:
    unmount_under(Path(path))
    Path(path).unlink(missing_ok=True)
