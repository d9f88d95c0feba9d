"""Progress document, ConfigMap publisher (request shape, rate limit, failures never fatal),
LR schedule, and the comm timer."""

import json

import pytest

from moe_contracts.progress import parse_progress, progress_doc
from moe_trainer.telemetry import progress
from moe_trainer.trainer import lr_lambda


def doc(**kw):
    args = dict(
        phase="Training",
        step=3,
        total_steps=10,
        loss=float("nan"),
        tokens_per_second=10.0,
        eta_seconds=1.0,
        checkpoint=None,
        moe={},
        health=[],
    )
    args.update(kw)
    return progress_doc(**args)


def test_progress_doc_is_json_and_nulls_non_finite():
    d = doc()
    assert d["kind"] == "TrainerProgress" and d["version"] == 1 and d["loss"] is None
    json.dumps(d, allow_nan=False)
    back = parse_progress(json.dumps(d))  # what the operator reads
    assert (back.phase, back.step, back.total_steps, back.loss) == ("Training", 3, 10, None)
    with pytest.raises(ValueError, match=r"phase: 'Running' is not one of"):
        doc(phase="Running")


def test_configmap_request_and_failure_is_not_fatal(tmp_path, monkeypatch):
    (tmp_path / "namespace").write_text("team-a\n")
    (tmp_path / "token").write_text("tok123\n")
    (tmp_path / "ca.crt").write_text("not a cert")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "1")  # nothing listens there
    pub = progress.ConfigMapPublisher("job-progress", sa_dir=tmp_path, interval_s=60, timeout_s=1)
    req = pub.request(doc(loss=1.5))
    assert req.full_url == "https://127.0.0.1:1/api/v1/namespaces/team-a/configmaps/job-progress"
    assert req.get_method() == "PATCH"
    assert req.headers["Authorization"] == "Bearer tok123"
    assert req.headers["Content-type"] == "application/merge-patch+json"
    body = json.loads(req.data)
    assert json.loads(body["data"]["progress.json"])["loss"] == 1.5
    slept = []
    retries = len(pub.FINAL_RETRY_SECONDS)
    assert (
        pub.publish(doc(), force=True, sleep=slept.append) is False and pub.failures == 1 + retries
    )
    assert slept == list(pub.FINAL_RETRY_SECONDS)
    assert (
        pub.publish(doc()) is False and pub.failures == 1 + retries
    )  # rate-limited: not even tried


def test_the_final_document_survives_a_short_api_outage(tmp_path):
    """The last word (Finished / Failed) is retried through an outage, not dropped; routine
    updates are not (the next one follows within the interval)."""
    pub = progress.ConfigMapPublisher("job-progress", sa_dir=tmp_path, interval_s=0)
    answers = iter([False, False, True])
    sent = []
    pub.send = lambda body: sent.append(body) or next(answers)
    assert pub.publish(doc(), force=True, sleep=lambda s: None) is True and len(sent) == 3
    answers = iter([False, True])
    assert pub.publish(doc()) is False and len(sent) == 4


def test_a_prompt_document_skips_the_interval_without_retries(tmp_path):
    """A checkpoint's fresh routing statistics reach the operator with the document that names
    them, not an interval later; a failed prompt document is not retried (the next follows)."""
    pub = progress.ConfigMapPublisher("job-progress", sa_dir=tmp_path, interval_s=3600)
    answers = iter([True, False, True])
    sent = []
    pub.send = lambda body: sent.append(body) or next(answers)
    assert pub.publish(doc()) is True and len(sent) == 1
    assert pub.publish(doc()) is False and len(sent) == 1  # within the interval: not sent
    assert pub.publish(doc(), prompt=True, sleep=lambda s: 1 / 0) is False and len(sent) == 2
    assert pub.publish(doc(), prompt=True) is True and len(sent) == 3

    # the document of a checkpoint that published routing statistics is prompt by itself
    def with_stats(step, published):
        return {**doc(), "routingStats": {"step": step, "published": published}}

    answers = iter([True, True])
    assert pub.publish(with_stats(3, True)) is True and len(sent) == 4  # doc() is at step 3
    assert pub.publish(with_stats(2, True)) is False  # older statistics: no news
    assert pub.publish(with_stats(3, False)) is False  # not published
    assert len(sent) == 4


def test_from_env_without_credentials(monkeypatch):
    monkeypatch.setenv("MOE_PROGRESS_CONFIGMAP", "x")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert progress.ConfigMapPublisher.from_env() is None


def test_lr_warmup_then_cosine():
    f = lr_lambda(warmup=2, total=10, min_ratio=0.1)
    assert [round(f(s), 3) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert f(10) == pytest.approx(0.1) and f(6) == pytest.approx(0.55)
    assert all(f(s) >= f(s + 1) for s in range(2, 10))


def test_comm_timer_counts_sync_and_async(monkeypatch):
    import deepspeed.comm as dscomm

    from moe_trainer.telemetry import commtime
    from moe_trainer.telemetry.commtime import CommTimer

    clock = [100.0]  # the calls "take" fixed times: what is counted does not depend on the load
    monkeypatch.setattr(
        commtime, "time", type("T", (), {"perf_counter": staticmethod(lambda: clock[0])})
    )

    class Handle:
        def wait(self):
            clock[0] += 0.05

    def fake_a2a(*a, **kw):
        clock[0] += 0.02

    def fake_ag(*a, async_op=False, **kw):
        clock[0] += 0.001
        return Handle()

    monkeypatch.setattr(dscomm, "all_to_all_single", fake_a2a)
    monkeypatch.setattr(dscomm, "allgather_fn", fake_ag)
    timer = CommTimer().install()
    try:
        dscomm.all_to_all_single(None, None)
        h = dscomm.allgather_fn(None, None, async_op=True)
        clock[0] += 1.0  # compute overlapping the async gather is not counted
        h.wait()
        took = timer.take()
    finally:
        timer.uninstall()
    assert took["allToAll"] == pytest.approx(0.02)
    assert took["allGather"] == pytest.approx(0.051)
    assert dscomm.all_to_all_single is fake_a2a
    assert timer.take() == {
        "allToAll": 0.0,
        "allGather": 0.0,
        "allToAllBytes": 0,
        "allToAllTierBytes": {"intraGroup": 0, "crossGroup": 0, "crossNode": 0},
    }


def test_comm_timer_counts_bytes_sent_to_other_ranks(monkeypatch):
    """AutoEP's call shape: rows per destination rank in input_split_sizes; the caller's own rows
    stay local. Without splits (the count exchange) (P-1)/P of the input leaves."""
    import deepspeed.comm as dscomm
    import torch

    from moe_trainer.telemetry.commtime import CommTimer

    monkeypatch.setattr(dscomm, "all_to_all_single", lambda *a, **kw: None)
    monkeypatch.setattr(dscomm, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dscomm, "get_world_size", lambda group=None: 4)
    timer = CommTimer().install()
    try:
        x = torch.zeros(10, 8, dtype=torch.bfloat16)  # 16-byte rows
        dscomm.all_to_all_single(
            torch.empty(0),
            x,
            output_split_sizes=[1, 2, 3, 4],
            input_split_sizes=[2, 5, 1, 2],
            group=None,
        )
        first = timer.take()["allToAllBytes"]
        dscomm.all_to_all_single(
            torch.empty(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
        )
        second = timer.take()["allToAllBytes"]
    finally:
        timer.uninstall()
    assert first == (2 + 1 + 2) * 16  # rank 1's own 5 rows are not sent
    assert second == 8 * 4 * 3 // 4


def test_comm_timer_splits_bytes_by_the_receivers_tier(monkeypatch):
    """Ranks 0,1 | 2 | 3 are NVLink groups, 0-2 one node: rank 1 sends 2 rows to its group
    peer, 1 row to another group on its node, 2 rows to another node."""
    import deepspeed.comm as dscomm
    import torch
    import torch.distributed as dist

    from moe_trainer.telemetry.commtime import CommTimer

    monkeypatch.setattr(dscomm, "all_to_all_single", lambda *a, **kw: None)
    monkeypatch.setattr(dscomm, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    timer = CommTimer().set_tiers(group_of=[0, 0, 1, 2], node_of=[0, 0, 0, 1]).install()
    try:
        x = torch.zeros(10, 8, dtype=torch.bfloat16)
        dscomm.all_to_all_single(
            torch.empty(0),
            x,
            output_split_sizes=[1, 2, 3, 4],
            input_split_sizes=[2, 5, 1, 2],
            group=None,
        )
        took = timer.take()
    finally:
        timer.uninstall()
    assert took["allToAllTierBytes"] == {
        "intraGroup": 2 * 16,
        "crossGroup": 3 * 16,
        "crossNode": 2 * 16,
    }
    assert took["allToAllBytes"] == 5 * 16


def test_prometheus_metrics_are_served():
    import urllib.request

    from moe_trainer.launch import free_port

    port = free_port()
    m = progress.Metrics(port, "tiny")
    try:
        m.update(
            doc(
                loss=2.5,
                moe={
                    "maxMeanLoadPerLayer": [1.5, 1.2],
                    "deadExperts": [[0, 1]],
                    "allToAllSecondsPerStep": 0.01,
                    "allGatherSecondsPerStep": 0.02,
                    "fragmentation": None,
                    "allToAllBytesPerStepByTier": {
                        "intraGroup": 10,
                        "crossGroup": 7,
                        "crossNode": 3,
                    },
                },
            ),
            tokens=256,
        )
        second = doc(
            loss=2.4,
            moe={
                "allGatherSecondsPerStep": 0.02,
                "maxMeanLoadPerLayer": [1.5],
                "deadExperts": [[0, 1]],
                "allToAllBytesPerStepByTier": {"crossGroup": 5},
            },
        )
        second["placement"] = {"generation": 2, "appliedAtStep": 40}  # after a re-placement
        # a second step: the per-step gauge is this step's, the counter the sum
        m.update(second, tokens=256)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    assert 'moe_trainer_loss{job="tiny"} 2.4' in text
    assert 'moe_trainer_expert_load_max_mean{job="tiny",layer="0"} 1.5' in text
    assert 'moe_trainer_comm_seconds_per_step{job="tiny",op="all_gather"} 0.02' in text
    assert 'moe_trainer_tokens_total{job="tiny"} 512.0' in text
    assert 'moe_trainer_dead_experts{job="tiny"} 1.0' in text
    assert 'moe_trainer_placement_generation{job="tiny"} 2.0' in text
    assert 'moe_trainer_all_to_all_bytes_per_step{job="tiny",tier="crossGroup"} 5.0' in text
    assert 'moe_trainer_all_to_all_bytes_total{job="tiny",tier="crossGroup"} 12.0' in text
    assert 'moe_trainer_all_to_all_bytes_total{job="tiny",tier="intraGroup"} 10.0' in text
