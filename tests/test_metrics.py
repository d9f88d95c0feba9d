"""The operator's Prometheus metrics, read back through the text exposition a scrape returns."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import plan_fixtures
from moejob_operator import metrics


@pytest.fixture(autouse=True)
def _clean():
    metrics.JOBS.clear()
    yield
    metrics.JOBS.clear()


def samples(text: bytes | None = None) -> dict[tuple[str, tuple], float]:
    text = text if text is not None else metrics.render()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }


def value(name: str, **labels) -> float | None:
    return samples().get((name, tuple(sorted(labels.items()))))


def status(phase: str, **conds: str) -> dict:
    return {
        "phase": phase,
        "conditions": [{"type": t, "status": s} for t, s in conds.items()],
        "plan": {
            "worldSize": 2,
            "epSize": 2,
            "crossGroupVsContiguous": "0.250",
            "maxMeanLoad": "1.040",
            "estimatedPeakBytesPerGpu": 123,
            "fits": True,
            "strategy": "topology_aware",
            "nodes": ["a", "b"],
        },
    }


def test_jobs_by_condition_count_each_job_once_and_follow_transitions():
    metrics.observe_job("ns", "a", status("Running", Planned="True", Running="True"))
    metrics.observe_job("ns", "b", status("Pending", Planned="False"))
    assert value("moe_operator_jobs", condition="Planned", status="True") == 1
    assert value("moe_operator_jobs", condition="Planned", status="False") == 1
    assert value("moe_operator_jobs", condition="Succeeded", status="True") == 0  # stable zeros
    # a later pass replaces, never adds
    metrics.observe_job(
        "ns", "a", status("Succeeded", Planned="True", Running="False", Succeeded="True")
    )
    assert value("moe_operator_jobs", condition="Running", status="True") == 0
    assert value("moe_operator_jobs", condition="Succeeded", status="True") == 1
    assert value("moe_operator_jobs_by_phase", phase="Succeeded") == 1
    assert value("moe_operator_job_phase", namespace="ns", job="a", phase="Succeeded") == 1
    assert value("moe_operator_job_phase", namespace="ns", job="a", phase="Running") is None
    metrics.forget_job("ns", "a")
    assert value("moe_operator_jobs", condition="Succeeded", status="True") == 0
    assert value("moe_operator_job_phase", namespace="ns", job="a", phase="Succeeded") is None


def test_plan_quality_from_status_and_from_the_full_plan():
    metrics.observe_job("ns", "a", status("Pending", Planned="True"))
    assert value("moe_operator_plan_cross_group_vs_contiguous", namespace="ns", job="a") == 0.25
    assert value("moe_operator_plan_max_mean_load", namespace="ns", job="a") == 1.04
    assert value("moe_operator_plan_fits", namespace="ns", job="a") == 1
    assert value("moe_operator_plan_cross_node_bytes_per_step", namespace="ns", job="a") is None
    metrics.observe_plan(
        "ns",
        "a",
        plan_fixtures.plan(
            nodes=("n0", "n1"),
            gpus_per_node=2,
            quality={
                "crossGroupBytesPerStep": 1000,
                "crossNodeBytesPerStep": 10,
                "maxMeanLoad": 1.5,
                "crossGroupVsContiguous": 0.5,
            },
            memory={"estimatedPeakBytes": 7, "fits": False},
        ),
    )
    assert value("moe_operator_plan_cross_node_bytes_per_step", namespace="ns", job="a") == 10
    assert value("moe_operator_plan_world_size", namespace="ns", job="a") == 4
    assert value("moe_operator_plan_fits", namespace="ns", job="a") == 0


def test_sizing_prediction_and_measured_ratio_from_status():
    st = status("Running", Planned="True")
    st["sizing"] = {"predictedTokensPerSecond": 90000, "measuredVsPredicted": "0.930"}
    metrics.observe_job("ns", "sized", st)
    assert value(
        "moe_operator_sizing_predicted_tokens_per_second", namespace="ns", job="sized"
    ) == (90000)
    assert value("moe_operator_sizing_measured_vs_predicted", namespace="ns", job="sized") == 0.93
    metrics.forget_job("ns", "sized")
    assert value("moe_operator_sizing_measured_vs_predicted", namespace="ns", job="sized") is None


def test_reconcile_timer_observes_duration_and_counts_errors_by_type():
    before_count = value("moe_operator_reconcile_duration_seconds_count") or 0
    before_err = value("moe_operator_reconcile_errors_total", error="KeyError") or 0
    with metrics.reconcile_timer():
        pass
    with pytest.raises(KeyError, match="boom"), metrics.reconcile_timer():
        raise KeyError("boom")
    assert value("moe_operator_reconcile_duration_seconds_count") == before_count + 2
    assert value("moe_operator_reconcile_errors_total", error="KeyError") == before_err + 1


def test_smoke_verdicts_count_and_keep_one_current_verdict_per_image():
    before = value("moe_operator_smoke_verdicts_total", verdict="Failed", cached="false") or 0
    metrics.record_smoke_verdict("img:1", "Passed")
    metrics.record_smoke_verdict("img:1", "Failed")
    metrics.record_smoke_verdict("img:1", "Failed", cached=True)
    assert (
        value("moe_operator_smoke_verdicts_total", verdict="Failed", cached="false") == before + 1
    )
    assert value("moe_operator_smoke_verdict", image="img:1", verdict="Failed") == 1
    assert value("moe_operator_smoke_verdict", image="img:1", verdict="Passed") == 0
    with pytest.raises(ValueError, match="'Maybe' is not one of Passed, Failed"):
        metrics.record_smoke_verdict("img:1", "Maybe")


def test_http_server_serves_the_registry():
    metrics.set_leader(True)
    server, _thread = metrics.start_server(0, "127.0.0.1")
    try:
        port = server.server_address[1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert samples(body)[("moe_operator_leader", ())] == 1
        assert b"process_cpu_seconds_total" in body
    finally:
        server.shutdown()
        server.server_close()
