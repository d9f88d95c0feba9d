"""Rank 0's RoutingStats -> ConfigMap encoding: JSON when small, gzip+base64 binaryData when large,
refused (and said so) when even that exceeds the ConfigMap limit; the operator's reader accepts
both."""

import json

import numpy as np
import pytest

from moe_contracts.env import ROUTING_STATS_GZ_KEY as GZ_KEY
from moe_contracts.env import ROUTING_STATS_KEY as KEY
from moe_contracts.routing import (
    configmap_text,
    decode_configmap,
    parse_routing_stats,
    routing_stats_doc,
)
from moe_contracts.routing import encode_configmap as encode
from moe_trainer.telemetry import progress, routing_publish
from moe_trainer.telemetry.routing_publish import RoutingStatsPublisher


def decode(cm):
    return json.loads(configmap_text(cm))


def stats_doc(layers=2, experts=8, top_k=2, tokens=512, seed=0):
    rng = np.random.default_rng(seed)
    load = np.zeros((layers, experts))
    coact = np.zeros((layers, experts, experts))
    for layer in range(layers):
        for _ in range(tokens):
            chosen = rng.choice(experts, top_k, replace=False)
            load[layer, chosen] += 1
            for i in chosen:
                for j in chosen:
                    if i != j:
                        coact[layer, i, j] += 1
    doc = routing_stats_doc(load, coact, tokens, 3, top_k, "test")
    parse_routing_stats(doc)
    return doc


def test_small_document_goes_to_data_and_clears_the_gzip_key():
    doc = stats_doc()
    enc = encode(doc)
    assert enc.key == KEY and enc.body["binaryData"] == {GZ_KEY: None}
    assert json.loads(enc.body["data"][KEY]) == doc
    assert enc.stored_bytes == enc.json_bytes == len(enc.body["data"][KEY])


def test_large_document_is_gzipped_under_binary_data_and_round_trips():
    doc = stats_doc(layers=2, experts=16)
    limit = encode(doc).json_bytes - 1  # one byte too big for plain JSON
    enc = encode(doc, limit)
    assert enc.key == GZ_KEY and enc.body["data"] == {KEY: None}
    assert enc.stored_bytes < enc.json_bytes and enc.stored_bytes <= limit
    assert decode({"binaryData": enc.body["binaryData"]}) == doc


def test_operator_reader_accepts_both_keys():
    doc = stats_doc(experts=16)
    for limit in (10**6, encode(doc).json_bytes - 1):
        enc = encode(doc, limit)
        cm = {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in enc.body.items()}
        stats = decode_configmap(cm)
        assert stats.load.tolist() == doc["load"] and stats.coact.tolist() == doc["coactivation"]


class FakeSend(progress.ConfigMapPublisher):
    def __init__(self, ok=True):
        super().__init__("a-routing-stats")
        self.ok, self.bodies = ok, []

    def send(self, body):
        self.bodies.append(body)
        if not self.ok:
            self.last_error = "HTTP Error 403: Forbidden"
        return self.ok


def test_too_large_is_not_sent_and_the_status_says_why(tmp_path, caplog):
    doc = stats_doc(experts=16)
    pub = RoutingStatsPublisher(FakeSend(), limit=100)
    status = pub.publish(doc, step=3, file_path=str(tmp_path / "routing_stats.json"))
    assert pub.publisher.bodies == [] and status["published"] is False and status["key"] is None
    assert "too large for ConfigMap a-routing-stats" in status["message"]
    assert "2 layers x 16^2" in status["message"] and "routing_stats.json" in status["message"]
    assert "too large" in caplog.text


def test_publish_reports_success_and_failure():
    doc = stats_doc()
    ok = RoutingStatsPublisher(FakeSend()).publish(doc, step=5, file_path=None)
    assert ok["published"] and ok["key"] == KEY and ok["step"] == 5
    bad = RoutingStatsPublisher(FakeSend(ok=False)).publish(doc, step=5, file_path=None)
    assert not bad["published"] and "403" in bad["message"]


def test_a_cut_of_the_windows_sample_is_reported():
    """The status message says how far each sample (whole run, window) was cut to fit."""
    doc = stats_doc(tokens=512)
    rng = np.random.default_rng(1)
    ex = [[sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(512)] for _ in range(2)]
    doc["tokenSamples"] = {"experts": ex, "steps": [3] * 512}
    doc["window"] = {
        **{k: doc[k] for k in ("tokens", "load", "coactivation")},
        "fromStep": 0,
        "toStep": 3,
        "steps": 3,
        "tokenSamples": doc["tokenSamples"],
    }
    bare = dict(doc, tokenSamples=None, window=dict(doc["window"], tokenSamples=None))
    gz = [encode(d, encode(d).json_bytes - 1).stored_bytes for d in (bare, doc)]  # gzip+base64
    limit = (gz[0] + gz[1]) // 2  # about half the samples' room
    status = RoutingStatsPublisher(FakeSend(), limit=limit).publish(doc, step=3, file_path=None)
    enc = encode(doc, limit)
    assert status["published"] and 0 < enc.window_samples < 512 and 0 < enc.samples < 512
    assert f"token samples cut from 512 to {enc.samples}" in status["message"]
    assert f"(the window's from 512 to {enc.window_samples})" in status["message"]


def test_publisher_needs_the_env_and_in_cluster_credentials(monkeypatch):
    monkeypatch.delenv(routing_publish.ENV, raising=False)
    assert RoutingStatsPublisher.from_env() is None
    monkeypatch.setenv(routing_publish.ENV, "a-routing-stats")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert RoutingStatsPublisher.from_env() is None


def test_patch_request_carries_nulls_for_the_other_key(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("t")
    (tmp_path / "namespace").write_text("team-a")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "1")
    pub = progress.ConfigMapPublisher("a-routing-stats", sa_dir=tmp_path)
    req = pub.patch_request(encode(stats_doc()).body)
    assert req.full_url.endswith("/namespaces/team-a/configmaps/a-routing-stats")
    assert json.loads(req.data)["binaryData"] == {GZ_KEY: None}
    assert (
        req.get_method() == "PATCH"
        and req.headers["Content-type"] == "application/merge-patch+json"
    )


@pytest.mark.parametrize(
    ("layers", "experts", "top_k", "fits"),
    [
        (32, 8, 2, KEY),  # Mixtral-8x7B shape
        (32, 64, 8, KEY),
        (24, 128, 8, GZ_KEY),
        (48, 128, 8, None),  # Qwen3-30B-A3B shape: too large even gzipped
    ],
)
def test_which_model_sizes_fit(layers, experts, top_k, fits):
    """Realistic counts over 4M tokens (the sizes docs/trainer.md quotes)."""
    rng = np.random.default_rng(1)
    tokens = 1 << 22
    load = rng.multinomial(tokens * top_k, np.ones(experts) / experts, size=layers)
    coact = rng.poisson(
        tokens * top_k * (top_k - 1) / experts / (experts - 1), size=(layers, experts, experts)
    )
    coact = (coact + coact.transpose(0, 2, 1)) // 2
    for layer in range(layers):
        np.fill_diagonal(coact[layer], 0)
    doc = {
        "kind": "RoutingStats",
        "version": 1,
        "numLayers": layers,
        "numExperts": experts,
        "topK": top_k,
        "tokens": tokens,
        "steps": 1,
        "load": load.tolist(),
        "coactivation": coact.tolist(),
    }
    assert encode(doc).key == fits
