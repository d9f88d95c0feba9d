"""The upgrade gate with the real operator, API server, job controller and node agent.

What runs in the smoke pods (honestly): the operator is started with MOE_GATE_SMOKE_COMMAND set
to a stand-in script (written below). For an image whose name contains `broken-ds` it runs the
**real** `moe-smoke --cpu` on the plans the operator mounted, in a DeepSpeed broken the way a bad
release would be (tests/smoke_faults: its ZeRO config no longer accepts `stage3_max_reuse_distance`,
a key the planner emits); for `real-smoke` the real passing `moe-smoke --cpu`; otherwise it waits
until the test creates a release file, then prints a passing SmokeVerdict we control for the
mounted plans' cases (the concurrency and caching tests are about the gate, not about DeepSpeed,
and hold the smoke test open for as long as they need, however slow the machine). The jobs are
created with
`runPolicy.suspend: true`, so passing the gate launches no trainer processes.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from moe_contracts import gate as contract_gate
from moe_contracts.gate import parse_gate_verdict
from moe_localkube.testing import unique_name
from moe_trainer import smoke
from moejob_operator import constants as C
from moejob_operator.core import gate as G
from moejob_operator.core.smoke_plans import CPU_CASES, smoke_plans
from operator_harness import (
    apply_job,
    condition,
    events_for,
    example,
    gate_operator,
    get_job,
    module_namespace,
)

pytestmark = pytest.mark.cluster

FAULTS = Path(__file__).resolve().parent / "smoke_faults"
STAND_IN = r"""
import json, os, subprocess, sys, time
image = os.environ.get("MOE_GATE_IMAGE", "")
plans = "/etc/moe-smoke/plans.json"
real = ["moe-smoke", "--cpu", "--plans", plans, "--workdir", "/var/tmp/moe-smoke/work"]
# the trainer code under test (pods get no PYTHONPATH)
env = dict(os.environ, PYTHONPATH=TRAINER)
if "broken-ds" in image:
    env.update(SMOKE_FAULT="drop-planner-key", PYTHONPATH=os.pathsep.join([FAULTS, TRAINER]))
    sys.exit(subprocess.call(real, env=env))
if "real-smoke" in image:
    sys.exit(subprocess.call(real, env=env))
deadline = time.monotonic() + 600    # passes once the test says so (the release file exists)
while not os.path.exists(RELEASE) and time.monotonic() < deadline:
    time.sleep(0.2)
cases = [c["name"] for c in json.load(open(plans))["cases"]]
from moe_contracts.gate import SMOKE_VERSION, expected_checks
pairs = expected_checks(cases)
checks = [{"name": n, "case": c, "passed": True, "seconds": 0.1, "message": "stand-in"}
          for n, c in pairs]
v = {"kind": "SmokeVerdict", "version": SMOKE_VERSION, "passed": True, "failedCheck": None,
     "failedCase": None,
     "cases": cases, "checks": checks, "exception": None,
     "versions": {"deepspeed": "0.19.8", "torch": "2.13.0", "transformers": "5.17.0", "cuda": None},
     "durationSeconds": 4.0, "standIn": True}
open("/dev/termination-log", "w").write(json.dumps(v))
print(json.dumps(v))
""".replace("FAULTS", repr(str(FAULTS))).replace(
    "TRAINER", repr(str(Path(smoke.__file__).parents[1]))
)


gate_ns = module_namespace("moe-gate-system")


@pytest.fixture(scope="module")
def operator_proc(control_plane, kube, node_agent, gate_ns, tmp_path_factory):
    d = tmp_path_factory.mktemp("gate-operator")
    op = gate_operator(
        control_plane, kube, gate_ns, d, STAND_IN.replace("RELEASE", repr(str(d / "release")))
    )
    op.release_file = d / "release"
    yield op
    op.stop()


def gate_job(name: str, image: str, tmp_path) -> dict:
    return example(
        "tiny-cpu.yaml",
        image=image,
        metadata={"name": name},
        checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(tmp_path)}}},
        runPolicy={"suspend": True, "backoffLimit": 0},
    )


def smoke_jobs(kube, ns: str, key: str | None = None) -> list:
    """Smoke Jobs in the gate namespace; with ``key`` only that identity's (this operator also
    reconciles jobs left in other tests' namespaces while those terminate, and gates their
    images)."""
    jobs = kube.batch.list_namespaced_job(ns, label_selector=f"{C.LABEL_COMPONENT}=smoke").items
    return [j for j in jobs if key is None or j.metadata.name.startswith(f"moe-smoke-{key}-")]


def verified(kube, ns, name) -> dict:
    return condition(get_job(kube, ns, name), C.COND_UPGRADE_VERIFIED)


def test_concurrent_jobs_share_one_smoke_job_then_a_cached_pass_is_reused(
    kube, namespace, operator_proc, gate_ns, wait_for, tmp_path
):
    image = f"registry.local/moe-trainer:{unique_name('pass')}"
    names = ["gate-a", "gate-b", "gate-c"]
    threads = [
        threading.Thread(target=apply_job, args=(kube, namespace, gate_job(n, image, tmp_path)))
        for n in names
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logs = operator_proc.logs
    for n in names:
        wait_for(
            lambda n=n: verified(kube, namespace, n).get("reason") == G.R_SMOKE_TEST_RUNNING,
            timeout=90,
            message=f"{n} waits for the smoke test\n{logs()}",
        )
    key = G.identity_for(image, None, "CPU").key
    jobs = smoke_jobs(kube, gate_ns, key)
    assert [j.metadata.name for j in jobs] == [f"moe-smoke-{key}-1"]
    assert get_job(kube, namespace, "gate-a")["status"]["phase"] == "Gating"
    operator_proc.release_file.touch()  # the stand-in smoke test may pass now

    for n in names:
        wait_for(
            lambda n=n: verified(kube, namespace, n).get("status") == "True",
            timeout=90,
            message=f"{n} verified\n{logs()}",
        )
        assert verified(kube, namespace, n)["reason"] == G.R_SMOKE_TEST_PASSED
    assert len(smoke_jobs(kube, gate_ns, key)) == 1  # still one Job for three jobs
    cm = kube.core.read_namespaced_config_map(f"moe-gate-{key}", gate_ns)
    stored = parse_gate_verdict(cm.data[G.VERDICT_KEY])
    assert (
        stored["passed"] and stored["attempt"] == 1 and stored["smokeJob"] == f"moe-smoke-{key}-1"
    )
    # the jobs went on past the gate (suspended: no workers)
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "gate-a"), C.COND_SUSPENDED).get("status") == "True"
        ),
        timeout=30,
        message=logs(),
    )

    # a later job with the same identity: cached verdict, no new Job
    apply_job(kube, namespace, gate_job("gate-late", image, tmp_path))
    wait_for(
        lambda: verified(kube, namespace, "gate-late").get("status") == "True",
        timeout=60,
        message=logs(),
    )
    late = verified(kube, namespace, "gate-late")
    assert late["reason"] == G.R_CACHED_VERDICT and "passed the smoke test" in late["message"]
    assert len(smoke_jobs(kube, gate_ns, key)) == 1
    reasons = wait_for(
        lambda: (lambda r: r if G.R_CACHED_VERDICT in r else None)(
            {e.reason for e in events_for(kube, namespace, "gate-late")}
        ),
        timeout=10,
        message="CachedVerdict event",
    )
    assert G.R_SMOKE_TEST_RUNNING not in reasons


def test_a_failed_smoke_test_blocks_launch_and_says_why(
    kube, kubectl, namespace, operator_proc, gate_ns, wait_for, tmp_path
):
    image = f"registry.local/moe-trainer:{unique_name('broken-ds')}"
    job = gate_job("gate-fail", image, tmp_path)
    job["spec"]["runPolicy"]["suspend"] = False
    apply_job(kube, namespace, job)
    wait_for(
        lambda: get_job(kube, namespace, "gate-fail").get("status", {}).get("phase") == "Failed",
        timeout=400,
        message=operator_proc.logs(),
    )
    cond = verified(kube, namespace, "gate-fail")
    assert (cond["status"], cond["reason"]) == ("False", G.R_SMOKE_TEST_FAILED)
    assert "check 'initialize' of case 'mixtral' failed" in cond["message"]
    assert (
        "stage3_max_reuse_distance" in cond["message"]
        and "Extra inputs are not permitted" in cond["message"]
    )
    failed = condition(get_job(kube, namespace, "gate-fail"), C.COND_FAILED)
    assert failed["reason"] == G.R_SMOKE_TEST_FAILED
    # never launched: no worker pods
    assert not kube.core.list_namespaced_pod(
        namespace, label_selector=f"{C.LABEL_COMPONENT}=worker"
    ).items
    warnings = wait_for(
        lambda: [
            e
            for e in events_for(kube, namespace, "gate-fail")
            if e.type == "Warning" and e.reason == G.R_SMOKE_TEST_FAILED
        ],
        timeout=10,
        message="Warning event SmokeTestFailed",
    )
    assert "check 'initialize' of case 'mixtral' failed" in warnings[0].message
    out = kubectl.run("describe", "moejob", "gate-fail", "-n", namespace)
    assert "SmokeTestFailed" in out.stdout and "initialize" in out.stdout, out.stdout
    # the real moe-smoke ran in the pod and its verdict is stored
    key = G.identity_for(image, None, "CPU").key
    stored = parse_gate_verdict(
        kube.core.read_namespaced_config_map(f"moe-gate-{key}", gate_ns).data[G.VERDICT_KEY]
    )
    assert stored["failedCheck"] == "initialize" and stored["versions"]["deepspeed"] == "0.19.8"


def test_skipping_the_gate_is_audited(kube, namespace, operator_proc, gate_ns, wait_for, tmp_path):
    job = gate_job("gate-skip", "registry.local/moe-trainer:never-tested", tmp_path)
    job["spec"]["gate"] = {"skip": True, "skipReason": "INC-123 hotfix, approved by on-call"}
    apply_job(kube, namespace, job)
    wait_for(
        lambda: verified(kube, namespace, "gate-skip").get("status") == "True",
        timeout=60,
        message=operator_proc.logs(),
    )
    cond = verified(kube, namespace, "gate-skip")
    assert cond["reason"] == C.R_GATE_SKIPPED and "INC-123 hotfix" in cond["message"]
    assert "set by " in cond["message"]  # who (field manager) and when
    ev = wait_for(
        lambda: [
            e for e in events_for(kube, namespace, "gate-skip") if e.reason == C.R_GATE_SKIPPED
        ],
        timeout=10,
        message="GateSkipped event",
    )
    assert ev[0].type == "Warning" and "INC-123 hotfix" in ev[0].message
    key = G.identity_for("registry.local/moe-trainer:never-tested", None, "CPU").key
    assert not [j for j in smoke_jobs(kube, gate_ns) if key in j.metadata.name]


def test_the_real_smoke_program_passes_through_the_job(
    kube, namespace, operator_proc, gate_ns, wait_for, tmp_path
):
    image = f"registry.local/moe-trainer:{unique_name('real-smoke')}"
    apply_job(kube, namespace, gate_job("gate-real", image, tmp_path))
    wait_for(
        lambda: verified(kube, namespace, "gate-real").get("status") == "True",
        timeout=400,
        message=operator_proc.logs(),
    )
    assert verified(kube, namespace, "gate-real")["reason"] == G.R_SMOKE_TEST_PASSED
    key = G.identity_for(image, None, "CPU").key
    stored = parse_gate_verdict(
        kube.core.read_namespaced_config_map(f"moe-gate-{key}", gate_ns).data[G.VERDICT_KEY]
    )
    assert stored["passed"] and stored["versions"]["deepspeed"] == "0.19.8"
    assert stored["versions"]["device"] == "cpu" and stored["durationSeconds"] > 0
    pod = kube.core.list_namespaced_pod(
        gate_ns, label_selector=f"job-name=moe-smoke-{key}-1"
    ).items[0]
    smoke = contract_gate.parse_smoke_verdict(
        pod.status.container_statuses[0].state.terminated.message
    )
    cases = [c.name for c in CPU_CASES]
    assert [(c["name"], c["case"]) for c in smoke["checks"]] == contract_gate.expected_checks(
        cases
    ) and "standIn" not in smoke
    # it ran the planner's plans, mounted from the ConfigMap beside the Job
    plans = json.loads(
        kube.core.read_namespaced_config_map(f"moe-smoke-{key}-1", gate_ns).data["plans.json"]
    )
    assert plans == smoke_plans("cpu") and [c["name"] for c in plans["cases"]] == cases
