"""Shared test fixtures: a real local Kubernetes v1.20.2 control plane and a node agent.

Stable fixture API (other test files build on these; keep names and meanings):

- ``control_plane`` (session): a started ``moe_localkube.controlplane.ControlPlane``. Useful
  attributes: ``server``, ``kubeconfig`` (admin, ``system:masters``), ``ca_path``, ``run_dir``,
  ``token_kubeconfig(token)``, ``api_client(token=None)``, ``startup_seconds``.
- ``kube`` (session): ``moe_localkube.testing.Kube`` with admin clients ``core`` (CoreV1Api),
  ``batch`` (BatchV1Api), ``custom`` (CustomObjectsApi), ``apiext`` (ApiextensionsV1Api),
  ``rbac`` (RbacAuthorizationV1Api), ``coordination`` and the raw ``api_client``.
- ``namespace`` (function): name of a fresh namespace whose ``default`` ServiceAccount has its
  token (pods can be created at once); deleted after the test.
- ``node_agent`` (session): a running ``moe_localkube.nodeagent.NodeAgent`` playing the kubelet
  for two fake GPU nodes ``node-a`` and ``node-b`` (fixture ``nvswitch-h100-8``, 8 GPUs each).
  ``node_agent.read_log(namespace, pod, container=None, previous=False)`` returns a container's
  output; ``node_agent.kill_container(namespace, pod, container=None, sig=SIGKILL)`` simulates a
  crash (exit code 128+sig). ``kubectl logs`` works too.
- ``kubectl`` (session): ``moe_localkube.testing.Kubectl`` (``path``, ``env`` with KUBECONFIG and
  kubectl/helm on PATH, ``helm``, ``run(*args)``).
- ``wait_for`` (session): ``moe_localkube.testing.wait_for(predicate, timeout=30, interval=0.2,
  message="")``, also importable directly.

Every process the control plane and the node agent start is checked at session end: if any of
them (or anything in their process groups) is still alive, the session fails.

Cluster tests are marked ``pytest.mark.cluster``; deselect them with ``-m "not cluster"``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from moe_localkube import procs
from moe_localkube.testing import Kube, Kubectl, create_namespace, delete_namespace, unique_name
from moe_localkube.testing import wait_for as _wait_for

GPU_NODES = {"node-a": "nvswitch-h100-8", "node-b": "nvswitch-h100-8"}

# The operators the tests start (and in-process passes) allow hostPath volumes under the temp
# directory (tmp_path checkpoints: the local node agent runs pods on this host) and honour the
# test-only hooks; a test of the production defaults starts its operator with both set to "".
os.environ.setdefault(
    "MOE_ALLOWED_HOST_PATH_PREFIXES", ",".join(sorted({tempfile.gettempdir(), "/tmp"}))
)
os.environ.setdefault("MOE_OPERATOR_TEST_MODE", "1")


@pytest.fixture(scope="session", autouse=True)
def _no_survivors():
    """Fail the session if anything spawned by the fixtures outlives them."""
    yield
    alive = procs.survivors()
    if alive:
        details = []
        for pgid in alive:
            try:
                cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().replace(b"\0", b" ")
                details.append(f"{pgid}: {cmdline[:200]!r}")
            except OSError:
                details.append(f"{pgid}: (group member alive)")
        pytest.fail("processes started by the tests survived the session:\n" + "\n".join(details))


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    from moe_localkube.controlplane import ControlPlane

    cp = ControlPlane(tmp_path_factory.mktemp("localkube"))
    cp.start()
    print(
        f"\n[localkube] control plane ready in {cp.startup_seconds:.2f}s at {cp.server} (logs "
        f"{cp.run_dir})"
    )
    try:
        yield cp
    finally:
        cp.stop()
        left = procs.survivors(cp.pids)
        assert not left, f"control plane processes survived stop(): {left}"


@pytest.fixture(scope="session")
def kube(control_plane) -> Kube:
    api = control_plane.api_client()
    yield Kube.from_api_client(api)
    api.close()


@pytest.fixture(scope="session")
def wait_for():
    return _wait_for


@pytest.fixture
def namespace(kube, request) -> str:
    name = create_namespace(kube, unique_name(f"t-{request.node.name}"))
    yield name
    delete_namespace(kube, name)


@pytest.fixture(scope="session")
def node_agent(control_plane, tmp_path_factory):
    from moe_localkube.nodeagent import NodeAgent, NodeSpec

    agent = NodeAgent(
        control_plane.api_client(),
        [NodeSpec(n, f) for n, f in GPU_NODES.items()],
        run_dir=tmp_path_factory.mktemp("nodeagent"),
        api_server=control_plane.server,
        bind_fallback_seconds=5,
        resync_seconds=5,
    )
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()
        left = procs.survivors(agent.pids)
        assert not left, f"pod processes survived NodeAgent.stop(): {left}"


@pytest.fixture(scope="session")
def kubectl(control_plane) -> Kubectl:
    from moe_localkube import binaries

    env = control_plane.kubectl_env()
    return Kubectl(path=binaries.kubectl_binary(), env=env, helm=binaries.helm_binary())
