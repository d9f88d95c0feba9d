"""``moectl operator``: Lease leader election against the real API server, and two operator
processes handing over (the rolling-upgrade case: two replicas briefly, never both active)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import urllib.request

import pytest

from moe_localkube import procs
from moejob_operator.run import LeaseElector
from operator_harness import install_crd

pytestmark = pytest.mark.cluster


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_lease_acquire_block_takeover_release(kube, control_plane, namespace):
    api = control_plane.api_client()
    ca, cb = Clock(), Clock()
    a = LeaseElector(api, namespace, "leader", "a", lease_seconds=10, clock=ca)
    b = LeaseElector(api, namespace, "leader", "b", lease_seconds=10, clock=cb)
    assert a.try_acquire_or_renew() is True
    assert b.try_acquire_or_renew() is False  # held and fresh
    assert a.try_acquire_or_renew() is True  # renew moves renewTime
    cb.t += 9
    assert b.try_acquire_or_renew() is False  # b saw a new record 9 s ago: not expired
    cb.t += 10  # a stopped renewing for a lease duration
    assert b.try_acquire_or_renew() is True
    lease = kube.coordination.read_namespaced_lease("leader", namespace)
    assert lease.spec.holder_identity == "b" and lease.spec.lease_transitions == 1
    assert a.try_acquire_or_renew() is False and a.leading is False  # a notices it lost
    b.release()
    assert kube.coordination.read_namespaced_lease("leader", namespace).spec.holder_identity == ""
    assert a.try_acquire_or_renew() is True  # released: no need to wait it out
    assert kube.coordination.read_namespaced_lease("leader", namespace).spec.lease_transitions == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def _leader_metric(port: int) -> float | None:
    _code, text = _get(f"http://127.0.0.1:{port}/metrics")
    for line in text.splitlines():
        if line.startswith("moe_operator_leader "):
            return float(line.split()[1])
    return None


def test_two_replicas_hand_over_on_sigterm(kube, control_plane, namespace, wait_for, tmp_path):
    """Old and new replica run together; only the Lease holder runs kopf; SIGTERM on the old one
    releases the Lease and the new one takes over within a retry period."""
    install_crd(kube)
    env = dict(os.environ, KUBECONFIG=str(control_plane.kubeconfig))
    ports, ps = [], []
    for ident in ("old", "new"):
        hp, mp = _free_port(), _free_port()
        ports.append((hp, mp))
        ps.append(
            procs.spawn(
                [
                    sys.executable,
                    "-m",
                    "moejob_operator.cli",
                    "operator",
                    "-n",
                    namespace,
                    "--lease-namespace",
                    namespace,
                    "--identity",
                    ident,
                    "--health-port",
                    str(hp),
                    "--metrics-port",
                    str(mp),
                    "--bind-address",
                    "127.0.0.1",
                    "--retry-period",
                    "0.5",
                ],
                tmp_path / f"{ident}.log",
                env=env,
            )
        )
        if ident == "old":
            wait_for(
                lambda: _leader_metric(mp) == 1,
                timeout=60,
                message=(tmp_path / "old.log").read_text(errors="replace"),
            )
    logs = lambda: "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log"))  # noqa: E731 - a one-line reader
    try:
        (hp_old, _mp_old), (hp_new, mp_new) = ports
        wait_for(
            lambda: _get(f"http://127.0.0.1:{hp_new}/healthz")[0] == 200, timeout=60, message=logs()
        )
        time.sleep(2)  # several election rounds of the standby
        assert _leader_metric(mp_new) == 0
        assert _get(f"http://127.0.0.1:{hp_new}/readyz")[0] == 200  # a standby is ready
        assert "starting kopf" not in (tmp_path / "new.log").read_text()
        assert _get(f"http://127.0.0.1:{hp_old}/healthz")[0] == 200

        t0 = time.monotonic()
        os.killpg(ps[0].pid, signal.SIGTERM)
        assert ps[0].wait(timeout=30) == 0, logs()
        wait_for(lambda: _leader_metric(mp_new) == 1, timeout=120, message=logs())
        handover = time.monotonic() - t0
        wait_for(lambda: "starting kopf" in (tmp_path / "new.log").read_text(), timeout=60)
        lease = kube.coordination.read_namespaced_lease("moe-operator-leader", namespace)
        assert lease.spec.holder_identity == "new"
        print(f"\nhand-over after SIGTERM: {handover:.2f}s")
    finally:
        for p in ps:
            procs.stop(p, grace_seconds=10)


def test_without_leader_election_the_process_says_it_leads(
    kube, control_plane, namespace, wait_for, tmp_path
):
    """``--no-leader-election``: the one process reconciles, so ``moe_operator_leader`` is 1."""
    install_crd(kube)
    env = dict(os.environ, KUBECONFIG=str(control_plane.kubeconfig))
    hp, mp = _free_port(), _free_port()
    p = procs.spawn(
        [
            sys.executable,
            "-m",
            "moejob_operator.cli",
            "operator",
            "-n",
            namespace,
            "--no-leader-election",
            "--health-port",
            str(hp),
            "--metrics-port",
            str(mp),
            "--bind-address",
            "127.0.0.1",
        ],
        tmp_path / "op.log",
        env=env,
    )
    try:
        wait_for(
            lambda: "starting kopf" in (tmp_path / "op.log").read_text(),
            timeout=60,
            message=(tmp_path / "op.log").read_text(errors="replace"),
        )
        wait_for(lambda: _leader_metric(mp) == 1, timeout=60, message="moe_operator_leader 1")
    finally:
        procs.stop(p, grace_seconds=10)


def test_the_passes_settings_are_read_once_from_the_operators_environment():
    """``moectl operator`` reads the admission policy and the gate settings from its environment
    when it starts (the chart sets them) and hands them to every pass through the controller;
    invalid gate settings do not stop it (jobs that need the gate wait, naming the setting)."""
    from moejob_operator.cli import build_parser
    from moejob_operator.core.gate import GateError
    from moejob_operator.run import controller_config

    args = build_parser().parse_args(["operator", "-n", "team-a", "--workers", "3"])
    env = {
        "MOE_ALLOWED_HOST_PATH_PREFIXES": "/mnt/ckpt/",
        "MOE_OPERATOR_TEST_MODE": "",
        "MOE_GATE_ENABLED": "false",
        "POD_NAMESPACE": "moe-system",
    }
    cfg = controller_config(args, env)
    assert (cfg.namespaces, cfg.workers) == (("team-a",), 3)
    assert cfg.settings.policy.host_path_prefixes == ("/mnt/ckpt",)
    assert not cfg.settings.policy.test_mode
    assert not cfg.settings.gate.enabled and cfg.settings.gate.namespace == "moe-system"
    bad = controller_config(args, {"MOE_GATE_DEADLINE_SECONDS": "soon"})
    assert isinstance(bad.settings.gate, GateError)
    assert "MOE_GATE_DEADLINE_SECONDS" in str(bad.settings.gate)
    assert bad.settings.policy.host_path_prefixes == ()
