"""The upgrade gate with the real operator, API server, job controller and node agent.

What runs in the smoke pods (honestly): the operator is started with MOE_GATE_SMOKE_COMMAND set
to a stand-in script (written below). For an image whose name contains `broken-ds` it runs the
**real** `moe-smoke --cpu` on the plans the operator mounted, in a DeepSpeed broken the way a bad
release would be (tests/smoke_faults: its ZeRO config no longer accepts `stage3_max_reuse_distance`,
a key the planner emits); for `real-smoke` the real passing `moe-smoke --cpu`; for an image
reference pinning a digest the test listed in its "broken digests" file a failing SmokeVerdict;
otherwise it waits until the test creates a release file, then prints a passing SmokeVerdict we
control for the mounted plans' cases (the concurrency, caching and digest tests are about the
gate, not about DeepSpeed, and hold the smoke test open for as long as they need, however slow the
machine). The jobs are created with `runPolicy.suspend: true`, so passing the gate launches no
trainer processes, except in the test of a tag pushed again during a run.

Digests: the node agent reports for each container the digest its node maps the image to
(`moe_localkube.imageids`; a digest reference reports itself); the tests change the map to push a
tag again, to put two builds of one tag on two nodes, and to fail a build.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from moe_contracts import gate as contract_gate
from moe_contracts.gate import parse_gate_verdict, parse_smoke_golden
from moe_localkube.testing import unique_name
from moe_trainer.gate import main as smoke
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
broken = open(BROKEN).read().split() if os.path.exists(BROKEN) else []
deadline = time.monotonic() + 600    # passes once the test says so (the release file exists)
while not os.path.exists(RELEASE) and time.monotonic() < deadline:
    time.sleep(0.2)
cases = [c["name"] for c in json.load(open(plans))["cases"]]
from moe_contracts.gate import SMOKE_VERSION, expected_checks
pairs = expected_checks(cases)
checks = [{"name": n, "case": c, "passed": True, "seconds": 0.1, "message": "stand-in"}
          for n, c in pairs]
failed = [d for d in broken if d in image]
if failed:  # this build is broken: its numerics fail
    checks = checks[:6]
    checks[-1].update(passed=False, message="rank 0: CheckFailed: experts: gradient is zero")
v = {"kind": "SmokeVerdict", "version": SMOKE_VERSION, "passed": not failed,
     "failedCheck": "numerics" if failed else None, "failedCase": cases[0] if failed else None,
     "cases": cases, "checks": checks, "exception": None,
     "versions": {"deepspeed": "0.19.8", "torch": "2.13.0", "transformers": "5.17.0", "cuda": None},
     "durationSeconds": 4.0, "standIn": True,
     "golden": {c: {"loss": [5.0, 4.9], "gradNorm": [2.0, 1.9], "update": {"experts": [0.5, 0.4]}}
                for c in cases}}
if failed:
    v["exception"] = "CheckFailed: experts: gradient is zero"
open("/dev/termination-log", "w").write(json.dumps(v))
print(json.dumps(v))
sys.exit(1 if failed else 0)
""".replace("FAULTS", repr(str(FAULTS))).replace(
    "TRAINER", repr(str(Path(smoke.__file__).parents[1]))
)


gate_ns = module_namespace("moe-gate-system")


@pytest.fixture(scope="module")
def operator_proc(control_plane, kube, node_agent, gate_ns, tmp_path_factory):
    d = tmp_path_factory.mktemp("gate-operator")
    script = STAND_IN.replace("RELEASE", repr(str(d / "release")))
    op = gate_operator(
        control_plane, kube, gate_ns, d, script.replace("BROKEN", repr(str(d / "broken")))
    )
    op.release_file, op.broken_file = d / "release", d / "broken"
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
    assert "check 'capabilities' of case 'mixtral' failed" in cond["message"]
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
    assert "check 'capabilities' of case 'mixtral' failed" in warnings[0].message
    out = kubectl.run("describe", "moejob", "gate-fail", "-n", namespace)
    assert "SmokeTestFailed" in out.stdout and "capabilities" in out.stdout, out.stdout
    # the real moe-smoke ran in the pod and its verdict is stored
    key = G.identity_for(image, None, "CPU").key
    stored = parse_gate_verdict(
        kube.core.read_namespaced_config_map(f"moe-gate-{key}", gate_ns).data[G.VERDICT_KEY]
    )
    assert stored["failedCheck"] == "capabilities" and stored["versions"]["deepspeed"] == "0.19.8"


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


def test_a_job_squatting_the_smoke_tests_name_is_reported_not_used_or_deleted(
    kube, namespace, operator_proc, gate_ns, wait_for, tmp_path
):
    """A Job a neighbour of the gate's namespace made with the smoke Job's name (another image,
    a command that prints a pass) is a SmokeJobConflict: the job waits, naming it; the squatter
    is neither read as a verdict nor deleted; once it is gone the gate runs its own."""
    image = f"registry.local/moe-trainer:{unique_name('squat')}"
    ident = G.identity_for(image, None, "CPU")
    name = G.smoke_job_name(ident, 1)
    squat = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {C.LABEL_COMPONENT: "smoke"}},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "schedulerName": "no-such-scheduler",  # created, never run
                    "containers": [
                        {"name": "smoke", "image": "busybox", "command": ["echo", "passed"]}
                    ],
                }
            },
        },
    }
    uid = kube.batch.create_namespaced_job(gate_ns, squat).metadata.uid
    apply_job(kube, namespace, gate_job("gate-squat", image, tmp_path))
    cond = wait_for(
        lambda: (
            (c := verified(kube, namespace, "gate-squat")).get("reason") == "SmokeJobConflict" and c
        ),
        timeout=60,
        message=operator_proc.logs(),
    )
    assert cond["status"] == "Unknown" and f"Job {gate_ns}/{name}" in cond["message"]
    assert kube.batch.read_namespaced_job(name, gate_ns).metadata.uid == uid  # not deleted
    kube.batch.delete_namespaced_job(name, gate_ns, propagation_policy="Foreground")

    def own_job():
        jobs = [j for j in smoke_jobs(kube, gate_ns, ident.key) if j.metadata.uid != uid]
        return jobs and verified(kube, namespace, "gate-squat").get("reason") == (
            G.R_SMOKE_TEST_RUNNING
        )

    wait_for(own_job, timeout=120, message=operator_proc.logs())


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


# ---- digests: the build a tag means, node by node ---------------------------------------------
def new_tag(prefix: str) -> tuple[str, str, str]:
    """A tag of a repository of its own (digest verdicts are per repository and digest), and two
    digests of it."""
    repo = f"registry.local/{unique_name(prefix)}/trainer"
    return (
        f"{repo}:v1",
        "sha256:" + hashlib.sha256(f"{repo} build 1".encode()).hexdigest(),
        "sha256:" + hashlib.sha256(f"{repo} build 2".encode()).hexdigest(),
    )


def hold(node_agent, image: str, digest: str, nodes=None) -> None:
    """The nodes (all by default) now hold ``digest`` under tag ``image`` (a push, a pull)."""
    for node in nodes or sorted(node_agent.nodes):
        node_agent.image_ids.set(node, image, digest)


def key_of(image: str, digest: str | None = None) -> str:
    ident = G.identity_for(image, None, "CPU")
    return (G.pinned(ident, digest) if digest else ident).key


def stored(kube, gate_ns: str, key: str) -> dict | None:
    try:
        cm = kube.core.read_namespaced_config_map(f"moe-gate-{key}", gate_ns)
    except Exception:  # noqa: BLE001 - not there (yet)
        return None
    return parse_gate_verdict(cm.data[G.VERDICT_KEY])


def verified_digest(kube, namespace: str, name: str) -> str | None:
    job = get_job(kube, namespace, name)
    cond = condition(job, C.COND_UPGRADE_VERIFIED)
    return (job.get("status") or {}).get("verifiedDigest") if cond.get("status") == "True" else None


def test_a_tag_pushed_again_before_a_run_is_tested_as_the_new_build_first(
    kube, namespace, operator_proc, gate_ns, node_agent, wait_for, tmp_path
):
    operator_proc.release_file.touch()
    image, d1, d2 = new_tag("repush-before")
    hold(node_agent, image, d1)
    apply_job(kube, namespace, gate_job("before-a", image, tmp_path))
    wait_for(
        lambda: verified_digest(kube, namespace, "before-a") == d1,
        timeout=120,
        message=f"before-a verified as {d1}\n{operator_proc.logs()}",
    )
    # the tag's verdict, and the same verdict under its digest (each digest is tested once)
    assert stored(kube, gate_ns, key_of(image))["observedDigest"] == d1
    assert stored(kube, gate_ns, key_of(image, d1))["passed"]
    assert not smoke_jobs(kube, gate_ns, key_of(image, d1))

    hold(node_agent, image, d2)  # the tag is pushed again: every node now pulls build 2
    apply_job(kube, namespace, gate_job("before-b", image, tmp_path))
    wait_for(
        lambda: verified_digest(kube, namespace, "before-b") == d2,
        timeout=120,
        message=f"before-b verified as {d2}\n{operator_proc.logs()}",
    )
    # said when the new build's smoke test started (the Event): the condition itself may already
    # be a later pass's, since a suspended job re-resolves its tag on every pass
    wait_for(
        lambda: [
            e.message
            for e in kube.core.list_namespaced_event(namespace).items
            if e.involved_object.name == "before-b"
            and f"now resolves to {d2}" in (e.message or "")
            and d1 in e.message
        ],
        timeout=30,
        message=f"an Event saying the tag now resolves to {d2}, verified {d1}",
    )
    # build 2 was tested (once, as repo@digest) before anything ran it; the tag follows it
    jobs = smoke_jobs(kube, gate_ns, key_of(image, d2))
    assert len(jobs) == 1 and jobs[0].spec.template.spec.containers[0].image.endswith(f"@{d2}")
    assert len(smoke_jobs(kube, gate_ns, key_of(image))) == 1
    tag = stored(kube, gate_ns, key_of(image))
    assert tag["passed"] and tag["observedDigest"] == d2
    # build 2's smoke run got build 1's golden values (same plans, same hardware) to drift from
    golden = parse_smoke_golden(
        kube.core.read_namespaced_config_map(f"moe-smoke-{key_of(image, d2)}-1", gate_ns).data[
            "golden.json"
        ]
    )
    assert golden["against"]["digest"] == d1 and set(golden["cases"]) == {c.name for c in CPU_CASES}
    # the probes go once the build is known
    wait_for(
        lambda: (
            not kube.core.list_namespaced_pod(
                namespace, label_selector=f"{C.LABEL_COMPONENT}=digest-probe"
            ).items
        ),
        timeout=60,
        message="digest probe pods deleted",
    )


def test_a_tag_pushed_again_during_a_run_does_not_reach_the_gang(
    kube, namespace, operator_proc, gate_ns, node_agent, wait_for, tmp_path
):
    operator_proc.release_file.touch()
    image, d1, d2 = new_tag("repush-during")
    hold(node_agent, image, d1)
    job = gate_job("during", image, tmp_path)
    job["spec"]["runPolicy"].update(suspend=False, backoffLimit=2)
    # every rank exits once after step 6: the gang restarts (new pods) after the re-push
    job["metadata"]["annotations"] = {f"{C.GROUP}/fault-exit-at-step": "6"}
    apply_job(kube, namespace, job)

    def workers(attempt):
        pods = kube.core.list_namespaced_pod(
            namespace, label_selector=f"{C.LABEL_COMPONENT}=worker,{C.LABEL_ATTEMPT}={attempt}"
        ).items
        return [
            p
            for p in pods
            if p.status.container_statuses and p.status.container_statuses[0].image_id
        ]

    first = wait_for(
        lambda: (lambda ps: ps if len(ps) == 2 else None)(workers(0)),
        timeout=180,
        message=f"attempt 0 running\n{operator_proc.logs()}",
    )
    assert {p.spec.containers[0].image for p in first} == {f"{image.rsplit(':', 1)[0]}@{d1}"}
    hold(node_agent, image, d2)  # pushed again while the gang runs
    assert all(p.status.phase == "Running" for p in workers(0)), "the re-push came too late"
    again = wait_for(
        lambda: (lambda ps: ps if len(ps) == 2 else None)(workers(1)),
        timeout=300,
        message=f"attempt 1 running: {get_job(kube, namespace, 'during').get('status')}",
    )
    # the restarted gang runs the verified build, not what the tag means now
    assert {p.status.container_statuses[0].image_id.rsplit("@", 1)[1] for p in again} == {d1}
    wait_for(
        lambda: get_job(kube, namespace, "during").get("status", {}).get("phase") == "Succeeded",
        timeout=400,
        message=operator_proc.logs(),
    )
    assert not smoke_jobs(
        kube, gate_ns, key_of(image, d2)
    )  # nothing ran build 2, nothing tested it
    assert get_job(kube, namespace, "during")["status"]["verifiedDigest"] == d1


def test_two_builds_of_a_tag_on_two_nodes_stop_the_launch_with_a_clear_condition(
    kube, namespace, operator_proc, gate_ns, node_agent, wait_for, tmp_path
):
    operator_proc.release_file.touch()
    image, d1, d2 = new_tag("two-builds")
    hold(node_agent, image, d1, ["node-a"])
    hold(node_agent, image, d2, ["node-b"])
    apply_job(kube, namespace, gate_job("mixed", image, tmp_path))
    cond = wait_for(
        lambda: (lambda c: c if c.get("reason") == G.R_IMAGE_DIGESTS_DIFFER else None)(
            verified(kube, namespace, "mixed")
        ),
        timeout=120,
        message=f"ImageDigestsDiffer\n{operator_proc.logs()}",
    )
    assert cond["status"] == "False" and "node-a" in cond["message"] and "node-b" in cond["message"]
    assert d1[:19] in cond["message"] and d2[:19] in cond["message"]
    # no loop: one smoke test (of the tag), none of the builds, no workers
    assert len(smoke_jobs(kube, gate_ns, key_of(image))) == 1
    assert not smoke_jobs(kube, gate_ns, key_of(image, d1)) + smoke_jobs(
        kube, gate_ns, key_of(image, d2)
    )
    assert get_job(kube, namespace, "mixed")["status"]["phase"] == "Gating"
    # the nodes agree again (node-b pulls the verified build): the job goes on, on that build
    verdict = stored(kube, gate_ns, key_of(image))
    hold(node_agent, image, verdict["observedDigest"])
    wait_for(
        lambda: verified_digest(kube, namespace, "mixed") == verdict["observedDigest"],
        timeout=120,
        message=f"mixed verified once the nodes agree\n{operator_proc.logs()}",
    )
    assert len(smoke_jobs(kube, gate_ns, key_of(image))) == 1


def test_a_failed_build_revokes_the_tags_cached_pass(
    kube, namespace, operator_proc, gate_ns, node_agent, wait_for, tmp_path
):
    operator_proc.release_file.touch()
    image, d1, d2 = new_tag("revoke")
    hold(node_agent, image, d1)
    apply_job(kube, namespace, gate_job("revoke-a", image, tmp_path))
    wait_for(
        lambda: verified_digest(kube, namespace, "revoke-a") == d1,
        timeout=120,
        message=operator_proc.logs(),
    )
    with open(operator_proc.broken_file, "a") as f:
        f.write(d2 + "\n")  # build 2 fails its smoke test
    hold(node_agent, image, d2)
    apply_job(kube, namespace, gate_job("revoke-b", image, tmp_path))
    wait_for(
        lambda: get_job(kube, namespace, "revoke-b").get("status", {}).get("phase") == "Failed",
        timeout=120,
        message=operator_proc.logs(),
    )
    cond = verified(kube, namespace, "revoke-b")
    assert cond["reason"] == G.R_SMOKE_TEST_FAILED and d2 in cond["message"]
    assert "check 'numerics'" in cond["message"] and "is revoked" in cond["message"]
    tag = stored(kube, gate_ns, key_of(image))
    assert not tag["passed"] and tag["message"].startswith("revoked:") and tag["revokedPass"] == d1
    # a later job on the tag is refused at once: no probe, no new smoke test of any build
    apply_job(kube, namespace, gate_job("revoke-c", image, tmp_path))
    wait_for(
        lambda: get_job(kube, namespace, "revoke-c").get("status", {}).get("phase") == "Failed",
        timeout=60,
        message=operator_proc.logs(),
    )
    late = verified(kube, namespace, "revoke-c")
    assert late["reason"] == G.R_SMOKE_TEST_FAILED and "revoked" in late["message"]
    assert [len(smoke_jobs(kube, gate_ns, k)) for k in (key_of(image), key_of(image, d2))] == [1, 1]
    # the good build, named by its digest, still passes from its stored verdict
    pinned = f"{image.rsplit(':', 1)[0]}@{d1}"
    apply_job(kube, namespace, gate_job("revoke-d", pinned, tmp_path))
    wait_for(
        lambda: verified(kube, namespace, "revoke-d").get("reason") == G.R_CACHED_VERDICT,
        timeout=60,
        message=operator_proc.logs(),
    )
    assert not smoke_jobs(kube, gate_ns, key_of(image, d1))
