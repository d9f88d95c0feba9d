"""Pure tests of the upgrade gate: identity, verdict documents, expiry, decisions, Job builder."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from moe_contracts import gate as contract_gate
from moe_contracts.errors import DocumentError
from moe_contracts.gate import parse_gate_verdict, parse_smoke_verdict
from moejob_operator import constants as C
from moejob_operator.builders import smoke as B
from moejob_operator.core import gate as G

NOW = dt.datetime(2026, 11, 29, 14, 0, tzinfo=dt.UTC)
DIGEST = "sha256:" + "ab" * 32
CFG = G.GateConfig(namespace="moe-system")


CASES = ["mixtral", "qwen3-moe", "deepseek-v3"]
HW = {
    "gpu": "NVIDIA H200",
    "computeCapability": "9.0",
    "driverVersion": "580.95.05",
    "cudaDriverVersion": "13.0",
}


def smoke_doc(passed=True, failed=None, ds="0.19.8", message="boom", case=None) -> dict:
    checks = []
    for name, c in contract_gate.expected_checks(CASES):
        if failed == name and case in (None, c):
            checks.append(
                {"name": name, "case": c, "passed": False, "seconds": 1.0, "message": message}
            )
            case = c
            break
        checks.append({"name": name, "case": c, "passed": True, "seconds": 1.0, "message": "ok"})
    return {
        "kind": "SmokeVerdict",
        "version": contract_gate.SMOKE_VERSION,
        "passed": passed,
        "failedCheck": failed,
        "failedCase": case if failed else None,
        "cases": CASES,
        "checks": checks,
        "exception": None if passed else "Traceback...\n" + message.removeprefix("rank 0: "),
        "versions": {
            "deepspeed": ds,
            "torch": "2.13.0",
            "transformers": "5.17.0",
            "cuda": "12.8",
            "device": "cuda",
            "gpu": "NVIDIA H200",
            "computeCapability": "9.0",
            "cudaDriver": "13.0",
        },
        "durationSeconds": 12.5,
    }


def finished(
    doc: dict | None, code=0, image_id=None, name="moe-smoke-x-1", reason=None
) -> G.SmokeObservation:
    return G.SmokeObservation(
        name=name,
        finished=True,
        exit_code=code,
        message=json.dumps(doc) if doc is not None else None,
        reason=reason,
        image_id=image_id,
    )


# ---- identity ---------------------------------------------------------------------------------
def test_digest_from_references_and_image_ids():
    assert G.digest_of(f"reg.io/t/trainer:1.0@{DIGEST}") == DIGEST
    assert G.digest_of(f"docker-pullable://reg.io/t/trainer@{DIGEST}") == DIGEST
    # a bare imageID is the config ID of an image without a repository digest (containerd after
    # `ctr images import`): `repo@<it>` resolves to nothing, so it is no digest to pin workers to
    assert G.digest_of(DIGEST) is None
    assert G.digest_of(f"docker://{DIGEST}") is None
    assert G.digest_of("reg.io/t/trainer:1.0") is None
    assert G.digest_of(None) is None
    assert G.repository_of(f"reg.io:5000/t/trainer:1.0@{DIGEST}") == "reg.io:5000/t/trainer"
    assert G.repository_of("reg.io:5000/t/trainer") == "reg.io:5000/t/trainer"


def test_identity_key_separates_what_must_be_verified_apart():
    base = G.identity_for("reg.io/trainer:1.0", "0.19.8", "GPU")
    assert base.key == G.identity_for("reg.io/trainer:1.0", "0.19.8", "GPU").key  # stable
    others = [
        G.identity_for("reg.io/trainer:1.1", "0.19.8", "GPU"),
        G.identity_for("reg.io/trainer:1.0", "0.20.0", "GPU"),
        G.identity_for("reg.io/trainer:1.0", None, "GPU"),
        G.identity_for("reg.io/trainer:1.0", "0.19.8", "CPU"),
    ]
    assert len({base.key} | {o.key for o in others}) == 5
    # a pinned digest is the image, whatever tag is written next to it
    a = G.identity_for(f"reg.io/trainer:1.0@{DIGEST}", "0.19.8", "GPU")
    b = G.identity_for(f"reg.io/trainer:latest@{DIGEST}", "0.19.8", "GPU")
    assert a.digest == DIGEST and a.key == b.key != base.key
    assert len(a.key) == 16 and G.smoke_job_name(a, 3) == f"moe-smoke-{a.key}-3"
    assert len(G.smoke_job_name(a, 999)) <= 63


def test_identity_refuses_bad_input():
    with pytest.raises(G.GateError, match="device: 'TPU' is not GPU or CPU"):
        G.identity_for("img", None, "TPU")
    with pytest.raises(G.GateError, match="image: empty"):
        G.identity_for("", None, "GPU")


# ---- documents --------------------------------------------------------------------------------
def test_smoke_verdict_reader():
    assert parse_smoke_verdict(json.dumps(smoke_doc()))["passed"] is True
    with pytest.raises(DocumentError, match="SmokeVerdict kind: 'Nope'"):
        parse_smoke_verdict(dict(smoke_doc(), kind="Nope"))
    # v2 (before capabilities/dispatch and multi-step numerics): an image older than the operator
    with pytest.raises(DocumentError, match=r"version: 2 is not a known version \[3\]"):
        parse_smoke_verdict(dict(smoke_doc(), version=2))
    with pytest.raises(DocumentError, match="failedCheck: required when passed is false"):
        parse_smoke_verdict(dict(smoke_doc(), passed=False))
    doc = smoke_doc()
    doc["checks"][0]["passed"] = "yes"
    with pytest.raises(DocumentError, match=r"checks\[0\].passed: 'yes' is invalid"):
        parse_smoke_verdict(doc)
    with pytest.raises(DocumentError, match="SmokeVerdict exception: required field is missing"):
        parse_smoke_verdict({k: v for k, v in smoke_doc().items() if k != "exception"})
    doc = smoke_doc()
    doc["checks"][2]["passed"] = False
    with pytest.raises(DocumentError, match="passed: true but a check failed"):
        parse_smoke_verdict(doc)
    with pytest.raises(DocumentError, match="not JSON"):
        parse_smoke_verdict("Traceback (most recent call last): ...")


def test_config_from_env():
    cfg = G.GateConfig.from_env(
        {
            "POD_NAMESPACE": "moe-system",
            "MOE_GATE_PASS_TTL_SECONDS": "60",
            "MOE_GATE_SMOKE_COMMAND": '["sh", "-c", "exit 0"]',
        }
    )
    assert (cfg.enabled, cfg.namespace, cfg.pass_ttl_seconds, cfg.fail_ttl_seconds) == (
        True,
        "moe-system",
        60,
        G.DEFAULT_FAIL_TTL_SECONDS,
    )
    assert cfg.command == ("sh", "-c", "exit 0")
    assert G.GateConfig.from_env({"MOE_GATE_ENABLED": "false"}).enabled is False
    assert G.GateConfig.from_env({}, default_namespace="ops").namespace == "ops"
    with pytest.raises(G.GateError, match="MOE_GATE_FAIL_TTL_SECONDS: '-5' is not a positive"):
        G.GateConfig.from_env({"MOE_GATE_FAIL_TTL_SECONDS": "-5"})
    with pytest.raises(
        G.GateError, match=r"MOE_GATE_SMOKE_COMMAND: .* is not a JSON list of strings"
    ):
        G.GateConfig.from_env({"MOE_GATE_SMOKE_COMMAND": '"moe-smoke"'})


# ---- decisions ---------------------------------------------------------------------------------
IDENT = G.identity_for("reg.io/trainer:1.0", "0.19.8", "GPU", HW)


def decide(identity, stored, obs, now=NOW, config=CFG, **kw):
    return G.decide(identity, stored, obs, now, config, cases=CASES, **kw)


def test_no_verdict_no_job_starts_one_smoke_job():
    d = decide(IDENT, None, None, NOW, CFG)
    assert (d.action, d.status, d.reason) == ("create_job", "Unknown", G.R_SMOKE_TEST_RUNNING)
    assert d.job_name == f"moe-smoke-{IDENT.key}-1" and d.retry_seconds and d.stale_job is None
    running = G.SmokeObservation(name=d.job_name, finished=False, pod_phase="Running")
    w = decide(IDENT, None, running, NOW, CFG)
    assert (w.action, w.status, w.reason) == ("wait", "Unknown", G.R_SMOKE_TEST_RUNNING)
    assert "pod Running" in w.message


def test_pass_is_recorded_with_expiry_then_cached_until_it_expires():
    obs = finished(smoke_doc(), image_id=f"docker-pullable://reg.io/trainer@{DIGEST}")
    d = decide(IDENT, None, obs, NOW, CFG)
    assert (d.action, d.status, d.reason) == ("record", "True", G.R_SMOKE_TEST_PASSED)
    rec = d.record
    assert rec["passed"] and rec["attempt"] == 1 and rec["observedDigest"] == DIGEST
    assert rec["expiresAt"] == "2026-12-06T14:00:00Z" and rec["identity"]["key"] == IDENT.key
    assert "deepspeed 0.19.8" in d.message and DIGEST in d.message
    stored = parse_gate_verdict(json.dumps(rec))
    later = NOW + dt.timedelta(days=6, hours=23)
    c = decide(IDENT, stored, None, later, CFG)
    assert (c.action, c.status, c.reason) == ("none", "True", G.R_CACHED_VERDICT)
    # expired: a new attempt with its own Job name, the old Job is cleaned up
    e = decide(IDENT, stored, None, NOW + dt.timedelta(days=7, seconds=1), CFG)
    assert (e.action, e.job_name, e.stale_job) == (
        "create_job",
        f"moe-smoke-{IDENT.key}-2",
        f"moe-smoke-{IDENT.key}-1",
    )
    # a verdict about another identity never counts
    other = G.identity_for("reg.io/trainer:1.1", "0.19.8", "GPU")
    assert decide(other, stored, None, later, CFG).action == "create_job"


def test_fail_names_the_check_and_expires_sooner():
    doc = smoke_doc(
        passed=False,
        failed="initialize",
        message="rank 0: AssertionError: Native DeepSpeed MoE is not supported with ZeRO Stage 3.",
    )
    d = decide(IDENT, None, finished(doc, code=1), NOW, CFG)
    assert (d.action, d.status, d.reason) == ("record", "False", G.R_SMOKE_TEST_FAILED)
    assert (
        "check 'initialize' of case 'mixtral' failed: rank 0: AssertionError: Native DeepSpeed MoE"
        in d.message
    )
    assert (
        d.record["failedCheck"] == "initialize" and d.record["expiresAt"] == "2026-11-29T15:00:00Z"
    )
    assert "exception: " not in d.message  # the last exception line is already in it
    cached = decide(IDENT, d.record, None, NOW + dt.timedelta(minutes=59), CFG)
    assert (cached.status, cached.reason) == ("False", G.R_SMOKE_TEST_FAILED)
    assert "cached" in cached.message and G.store_name(IDENT) in cached.message
    assert decide(IDENT, d.record, None, NOW + dt.timedelta(minutes=61), CFG).action == "create_job"


def test_a_pod_that_died_without_a_verdict_fails_the_gate():
    d = decide(IDENT, None, finished(None, code=137, reason="OOMKilled"), NOW, CFG)
    assert (d.status, d.reason) == ("False", G.R_SMOKE_TEST_FAILED)
    assert "no verdict (exit code 137, reason OOMKilled)" in d.message
    garbage = G.SmokeObservation(name="j", finished=True, exit_code=1, message="Segmentation fault")
    g = decide(IDENT, None, garbage, NOW, CFG)
    assert g.status == "False" and "SmokeVerdict: not JSON" in g.message
    deadline = G.SmokeObservation(
        name="j",
        finished=True,
        reason="DeadlineExceeded",
        message="Job was active longer than specified deadline",
    )
    assert "reason DeadlineExceeded" in decide(IDENT, None, deadline, NOW, CFG).message


def test_declared_deepspeed_must_match_what_the_image_reports():
    d = decide(IDENT, None, finished(smoke_doc(ds="0.20.1")), NOW, CFG)
    assert d.status == "False" and d.record["failedCheck"] == "imports"
    assert "reports deepspeed 0.20.1, the spec declares 0.19.8" in d.message
    undeclared = G.identity_for("reg.io/trainer:1.0", None, "GPU")
    assert decide(undeclared, None, finished(smoke_doc(ds="0.20.1")), NOW, CFG).status == "True"


def test_pass_with_nonzero_exit_or_missing_checks_is_not_a_pass():
    assert decide(IDENT, None, finished(smoke_doc(), code=1), NOW, CFG).status == "False"
    short = smoke_doc()
    short["checks"] = short["checks"][:2]
    assert decide(IDENT, None, finished(short), NOW, CFG).status == "False"


def test_a_job_that_waited_reads_smoke_test_passed_others_cached_verdict():
    rec = decide(IDENT, None, finished(smoke_doc()), NOW, CFG).record
    waited = decide(IDENT, rec, None, NOW, CFG, waited=True)
    assert (waited.action, waited.status, waited.reason) == ("none", "True", G.R_SMOKE_TEST_PASSED)
    assert decide(IDENT, rec, None, NOW, CFG).reason == G.R_CACHED_VERDICT
    bad = decide(IDENT, None, finished(smoke_doc(False, "numerics"), code=1), NOW, CFG).record
    assert "cached" not in decide(IDENT, bad, None, NOW, CFG, waited=True).message


def test_observe_reads_job_and_pod_status():
    job = {
        "metadata": {"name": "moe-smoke-k-1"},
        "status": {
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "has reached the limit",
                }
            ]
        },
    }
    pod = {
        "metadata": {"creationTimestamp": "2026-11-29T14:00:00Z"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "imageID": f"docker-pullable://reg.io/trainer@{DIGEST}",
                    "state": {
                        "terminated": {"exitCode": 1, "reason": "Error", "message": '{"kind": 1}'}
                    },
                }
            ],
        },
    }
    obs = G.observe(job, [pod])
    assert (
        obs.finished
        and obs.exit_code == 1
        and obs.message == '{"kind": 1}'
        and obs.reason == "Error"
    )
    assert G.digest_of(obs.image_id) == DIGEST
    assert G.observe(None, []) is None
    assert not G.observe({"metadata": {"name": "j"}, "status": {"active": 1}}, []).finished


def test_skip_audit_names_the_field_manager():
    body = {
        "metadata": {
            "managedFields": [
                {
                    "manager": "kubectl-create",
                    "operation": "Update",
                    "time": "2026-11-29T13:00:00Z",
                    "fieldsV1": {"f:spec": {"f:image": {}}},
                },
                {
                    "manager": "kubectl-edit",
                    "operation": "Update",
                    "time": "2026-11-29T13:30:00Z",
                    "fieldsV1": {"f:spec": {"f:gate": {"f:skip": {}, "f:skipReason": {}}}},
                },
            ]
        }
    }
    assert G.skip_audit(body) == "set by kubectl-edit (Update) at 2026-11-29T13:30:00Z"
    assert G.skip_audit({"metadata": {}}) == ""
    assert "skipped for image reg.io/trainer:1.0" in G.skip_message(IDENT, "hotfix", "set by x")


# ---- builders -----------------------------------------------------------------------------------
def test_smoke_job_manifest():
    job = B.smoke_job(IDENT, 1, CFG)
    assert (
        job["metadata"]["name"] == f"moe-smoke-{IDENT.key}-1"
        and job["metadata"]["namespace"] == "moe-system"
    )
    spec = job["spec"]
    assert (
        spec["backoffLimit"] == 0
        and spec["activeDeadlineSeconds"] == G.DEFAULT_SMOKE_DEADLINE_SECONDS
    )
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "reg.io/trainer:1.0" and c["command"] == ["moe-smoke"]
    assert c["args"] == [
        "--workdir",
        "/var/tmp/moe-smoke/work",
        "--plans",
        "/etc/moe-smoke/plans.json",
        "--gpu",
        "--expect-deepspeed",
        "0.19.8",
    ]
    assert {"name": "plans", "configMap": {"name": job["metadata"]["name"]}} in pod["volumes"]
    assert "nodeSelector" not in pod
    pinned = B.smoke_job(IDENT, 1, CFG, node="gpu-node-3")["spec"]["template"]["spec"]
    assert pinned["nodeSelector"] == {"kubernetes.io/hostname": "gpu-node-3"}
    assert c["resources"]["limits"] == {C.GPU_RESOURCE: "1"}
    assert (
        c["terminationMessagePolicy"] == "FallbackToLogsOnError" and pod["restartPolicy"] == "Never"
    )
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert spec["template"]["metadata"]["labels"][G.LABEL_GATE_KEY] == IDENT.key
    cpu = B.smoke_job(G.identity_for("moe-trainer:local", None, "CPU"), 2, CFG)
    cc = cpu["spec"]["template"]["spec"]["containers"][0]
    assert "--cpu" in cc["args"] and "resources" not in cc
    custom = B.smoke_job(IDENT, 1, G.GateConfig(command=("sh", "-c", "echo hi"), extra_args=("x",)))
    assert custom["spec"]["template"]["spec"]["containers"][0]["command"] == ["sh", "-c", "echo hi"]
    assert custom["spec"]["template"]["spec"]["containers"][0]["args"] == ["x"]


def test_verdict_configmap_round_trips():
    rec = decide(IDENT, None, finished(smoke_doc()), NOW, CFG).record
    cm = B.verdict_configmap(rec, "moe-system")
    assert cm["metadata"]["name"] == G.store_name(IDENT)
    assert cm["metadata"]["labels"][f"{C.GROUP}/gate-passed"] == "true"
    assert parse_gate_verdict(cm["data"][G.VERDICT_KEY]) == rec
    with pytest.raises(
        DocumentError, match="GateVerdict expiresAt: 'soon' is not an RFC 3339 time"
    ):
        parse_gate_verdict(json.dumps(dict(rec, expiresAt="soon")))


def test_a_leftover_job_counts_from_when_it_ran_and_an_expired_one_is_replaced():
    ran = "2026-11-29T13:30:00Z"
    obs = G.SmokeObservation(
        name=f"moe-smoke-{IDENT.key}-1",
        finished=True,
        exit_code=0,
        message=json.dumps(smoke_doc()),
        finished_at=ran,
    )
    d = decide(IDENT, None, obs, NOW, CFG)
    assert (
        d.action == "record"
        and d.record["verifiedAt"] == ran
        and d.record["expiresAt"] == "2026-12-06T13:30:00Z"
    )
    # the store was deleted 8 days later: the Job's verdict has expired, so test again as attempt 2
    old = dt.timedelta(days=8)
    e = decide(IDENT, None, obs, NOW + old, CFG)
    assert (e.action, e.status, e.job_name, e.stale_job) == (
        "create_job",
        "Unknown",
        f"moe-smoke-{IDENT.key}-2",
        f"moe-smoke-{IDENT.key}-1",
    )
    assert e.record["attempt"] == 1 and e.record["passed"]  # remembered, already expired
    assert decide(IDENT, e.record, None, NOW + old, CFG).job_name == f"moe-smoke-{IDENT.key}-2"


def test_failure_message_says_how_to_test_again_now():
    d = decide(
        IDENT, None, finished(smoke_doc(False, "numerics", message="loss is nan"), code=1), NOW, CFG
    )
    assert (
        f"kubectl -n moe-system delete job moe-smoke-x-1 configmap moe-gate-{IDENT.key}"
        in d.message
    )


def test_a_gpu_identity_needs_a_run_on_a_gpu():
    cpu_run = smoke_doc()
    cpu_run["versions"]["device"] = "cpu"
    d = decide(IDENT, None, finished(cpu_run), NOW, CFG)
    assert d.status == "False" and "a GPU identity was tested on cpu, not on a GPU" in d.message
    cpu_ident = G.identity_for("reg.io/trainer:1.0", "0.19.8", "CPU")
    assert decide(cpu_ident, None, finished(cpu_run), NOW, CFG).status == "True"


# ---- what a verdict vouches for: GPU hardware, the cases, the digest ----------------------------
def test_gpu_verdicts_are_keyed_by_gpu_model_compute_capability_and_cuda_major():
    assert (
        IDENT.gpu_model == "NVIDIA H200"
        and IDENT.compute_capability == "9.0"
        and IDENT.cuda_major == "13"
    )
    others = [
        dict(HW, gpu="NVIDIA H100 80GB HBM3"),
        dict(HW, computeCapability="8.0"),
        dict(HW, cudaDriverVersion="12.8"),
    ]
    keys = {IDENT.key} | {
        G.identity_for("reg.io/trainer:1.0", "0.19.8", "GPU", hw).key for hw in others
    }
    assert len(keys) == 4
    assert (
        G.identity_for("reg.io/trainer:1.0", "0.19.8", "GPU", dict(HW, driverVersion="590.1")).key
        == IDENT.key
    )
    # CPU verdicts ignore GPU hardware
    assert G.identity_for("i", None, "CPU", HW).key == G.identity_for("i", None, "CPU").key
    assert "NVIDIA H200 (compute capability 9.0, CUDA 13)" in IDENT.describe()


def test_a_pass_on_other_gpu_hardware_does_not_vouch():
    run = smoke_doc()
    run["versions"].update(gpu="NVIDIA A100-SXM4-80GB", computeCapability="8.0")
    d = decide(IDENT, None, finished(run))
    assert d.status == "False" and d.record["failedCheck"] == "imports"
    assert "GPU model NVIDIA A100-SXM4-80GB (identity: NVIDIA H200)" in d.message
    assert "compute capability 8.0 (identity: 9.0)" in d.message
    run = smoke_doc()
    run["versions"]["cudaDriver"] = "12.8"
    assert "CUDA major 12 (identity: 13)" in decide(IDENT, None, finished(run)).message
    run["versions"]["cudaDriver"] = None  # no NVML in the image: model + capability decide
    assert decide(IDENT, None, finished(run)).status == "True"


def test_a_pass_must_cover_every_case_it_was_given():
    short = smoke_doc()
    short["checks"] = [c for c in short["checks"] if c["case"] != "deepseek-v3"]
    d = decide(IDENT, None, finished(short))
    assert d.status == "False" and "missing ['capabilities[deepseek-v3]'" in d.message


def test_a_failure_names_the_check_and_the_case():
    doc = smoke_doc(
        False, "numerics", message="rank 0: CheckFailed: experts: grad is zero", case="qwen3-moe"
    )
    d = decide(IDENT, None, finished(doc, code=1))
    assert d.status == "False" and d.record["failedCase"] == "qwen3-moe"
    assert (
        "check 'numerics' of case 'qwen3-moe' failed: rank 0: CheckFailed: experts: grad is zero"
        in d.message
    )


def test_digest_change_pins_the_identity_and_regates():
    from moejob_operator.reconcile import gate as RG
    from moejob_operator.spec import parse_spec

    other = "sha256:" + "cd" * 32
    spec = parse_spec({"image": "reg.io/trainer:1.0", "model": {"preset": "tiny-mixtral"}})
    pod = {
        "status": {
            "containerStatuses": [
                {
                    "image": "reg.io/trainer:1.0",
                    "imageID": f"docker-pullable://reg.io/trainer@{other}",
                }
            ]
        }
    }
    same = {"status": {"containerStatuses": [{"imageID": f"reg.io/trainer@{DIGEST}"}]}}
    job = {"status": {"verifiedDigest": DIGEST}}
    assert RG.digest_changed(job, spec, [same]) is None
    assert RG.digest_changed(job, spec, [same, pod]) == other
    assert (
        RG.digest_changed({"status": {}}, spec, [pod]) is None
    )  # no digest verified: nothing to compare
    pinned_spec = parse_spec(
        {"image": f"reg.io/trainer:1.0@{DIGEST}", "model": {"preset": "tiny-mixtral"}}
    )
    assert RG.digest_changed(job, pinned_spec, [pod]) is None  # a pinned reference cannot move
    # the re-gate tests exactly the bits the pods ran: a new identity, image pinned to that digest
    ident = RG.identity_of({"status": {"gateDigest": other}}, spec, None)
    assert ident.image == f"reg.io/trainer@{other}" and ident.digest == other
    assert ident.key != RG.identity_of({"status": {}}, spec, None).key
    job_ = B.smoke_job(ident, 1, CFG)
    assert job_["spec"]["template"]["spec"]["containers"][0]["image"] == f"reg.io/trainer@{other}"


def test_gpu_smoke_plans_cover_the_fast_path_and_partitioned_zero3():
    """On one GPU the planner's fast settings keep every parameter whole; the gate must still
    run ZeRO-3's partitioning (stock AutoEP cases) besides the fast path a 1-GPU job takes."""
    from moejob_operator.core import smoke_plans as SP
    from moejob_operator.core.dsconfig import GpuCaps

    doc = SP.smoke_plans("cuda", GpuCaps("NVIDIA H200", 140 * 2**30, "9.0"))
    by_case = {c["name"]: c["plan"] for c in doc["cases"]}
    fast = [n for n, p in by_case.items() if p["training"].get("performance")]
    hidden = SP.SMOKE_HF_CONFIGS["mixtral"]["hidden_size"]
    partitioned = [
        n
        for n, p in by_case.items()
        if p["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] <= 10 * hidden
    ]
    assert fast == ["mixtral"]
    assert sorted(partitioned) == ["deepseek-v3", "qwen3-moe"]
    assert all(
        p["deepspeed"].get("expert_parallel", {}).get("enabled")
        for n, p in by_case.items()
        if n in partitioned
    )
