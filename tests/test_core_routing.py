"""RoutingStats v1/v2: reading/writing with invariants, counting, and the synthetic trace."""

import copy
import dataclasses
import json

import numpy as np
import pytest

from moe_contracts.routing import read_routing_stats, write_routing_stats
from moejob_operator.core.errors import DocumentError
from moejob_operator.core.routing import count_routing, synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(3, 16, 2, 4000, num_clusters=4, cluster_affinity=0.5, seed=7)


def test_count_routing_by_hand():
    te = np.array([[[0, 1], [1, 2], [0, 1]]])  # [L=1, T=3, k=2]
    load, coact = count_routing(te, 4)
    assert load.tolist() == [[2, 3, 1, 0]]
    assert coact[0].tolist() == [[0, 2, 0, 0], [2, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]


def test_synthetic_trace_invariants(trace):
    L, T, k = trace.token_experts.shape
    assert (L, T, k) == (3, 4000, 2)
    assert (np.diff(trace.token_experts, axis=2) > 0).all()  # k distinct experts per token
    assert (trace.load.sum(axis=1) == T * k).all()
    assert (trace.coact == trace.coact.transpose(0, 2, 1)).all()
    assert (trace.coact.sum(axis=2) == (k - 1) * trace.load).all()
    # parse accepts its own output (all contract invariants)
    assert read_routing_stats(trace.to_json()).load.tolist() == trace.load.tolist()


def test_synthetic_trace_is_skewed_and_clustered(trace):
    ratio = trace.load.max(axis=1) / trace.load.mean(axis=1)
    assert (ratio > 1.3).all()
    for layer in range(trace.num_layers):
        c = trace.planted_clusters[layer]
        same = c[:, None] == c[None, :]
        np.fill_diagonal(same, False)
        expected = (
            np.outer(trace.load[layer], trace.load[layer]) / trace.tokens * (1 / 2)
        )  # indep. top-2
        observed = trace.coact[layer] / np.maximum(expected, 1e-9)
        assert observed[same].mean() > 2 * observed[~same & ~np.eye(16, dtype=bool)].mean()


def test_synthetic_trace_deterministic_and_validated():
    a = synthetic_trace(1, 8, 3, 100, seed=1)
    b = synthetic_trace(1, 8, 3, 100, seed=1)
    assert np.array_equal(a.token_experts, b.token_experts)
    assert not np.array_equal(a.token_experts, synthetic_trace(1, 8, 3, 100, seed=2).token_experts)
    with pytest.raises(ValueError, match=r"top_k=9 must be in \[1, num_experts=8\]"):
        synthetic_trace(1, 8, 9, 10)
    with pytest.raises(ValueError, match="cluster_affinity"):
        synthetic_trace(1, 8, 2, 10, cluster_affinity=1.5)


def test_write_read_round_trip(tmp_path, trace):
    path = tmp_path / "routing_stats.json"
    write_routing_stats(trace, path)
    back = read_routing_stats(path)
    assert np.array_equal(back.load, trace.load) and np.array_equal(back.coact, trace.coact)
    assert (back.num_layers, back.num_experts, back.top_k, back.tokens) == (3, 16, 2, 4000)
    assert np.array_equal(back.token_experts, trace.token_experts) and back.source == "synthetic"
    assert back.exact
    write_routing_stats(trace.without_tokens(), path)
    v1 = dict(json.loads(path.read_text()), version=1)  # v1 readers' documents still read
    assert read_routing_stats(v1).token_experts is None


def test_sample_steps_round_trip_and_old_documents_still_read(tmp_path, trace):
    """``tokenSamples.steps`` (the step of each sampled token) survives write/read; a document
    without it reads with ``token_steps`` None."""
    steps = np.arange(trace.token_experts.shape[1]) % 100 + 201
    stamped = dataclasses.replace(trace, token_steps=steps)
    path = tmp_path / "routing_stats.json"
    write_routing_stats(stamped, path)
    back = read_routing_stats(path)
    assert np.array_equal(back.token_steps, steps)
    assert np.array_equal(back.token_experts, trace.token_experts)
    assert read_routing_stats(trace.to_json()).token_steps is None
    assert stamped.without_tokens().token_steps is None


def test_top_k_above_two_without_samples_is_not_exact(trace):
    four = synthetic_trace(1, 8, 4, 200, seed=0)
    assert four.exact and not four.without_tokens().exact and trace.without_tokens().exact


def _bad(mutate, match, trace):
    doc = copy.deepcopy(trace.to_json())
    mutate(doc)
    with pytest.raises(DocumentError, match=match):
        read_routing_stats(doc)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(kind="Routing"), r"RoutingStats kind: 'Routing' is not 'RoutingStats'"),
        (lambda d: d.update(version=3), r"RoutingStats version: 3 is not a known version"),
        (lambda d: d.pop("topK"), r"RoutingStats topK: required field is missing"),
        (
            lambda d: d.update(numExperts="16"),
            r"RoutingStats numExperts: '16' is invalid \(Input should be a valid integer\)",
        ),
        (
            lambda d: d.update(numLayers=4),
            r"RoutingStats load: shape \[3, 16\] does not match numLayers/numExperts \[4, 16\]",
        ),
        (lambda d: d["load"][1].__setitem__(2, -1), r"RoutingStats load\[1\]\[2\]: -1 is negative"),
        (
            lambda d: d["load"][0].__setitem__(0, d["load"][0][0] + 1),
            r"RoutingStats load\[0\]: sums to 8001, expected tokens\*topK = 8000",
        ),
        (
            lambda d: d["coactivation"][2][0].__setitem__(1, d["coactivation"][2][0][1] + 1),
            r"coactivation\[2\]\[0\]\[1\]: .* \(not symmetric\)",
        ),
        (
            lambda d: d["coactivation"][0][3].__setitem__(3, 5),
            r"coactivation\[0\]\[3\]\[3\]: 5 is not 0",
        ),
        (lambda d: d["load"][0].__setitem__(0, 0.5), r"load: counts must be integers"),
        (
            lambda d: d["tokenSamples"]["experts"][1][5].__setitem__(0, 16),
            r"tokenSamples.experts\[1\]\[5\]\[0\]: 16 is not an expert id in \[0, 16\)",
        ),
        (
            lambda d: d["tokenSamples"]["experts"][2].__setitem__(7, [3, 3]),
            r"tokenSamples.experts\[2\]\[7\]: \[3, 3\] repeats an expert",
        ),
        (
            lambda d: d["tokenSamples"].update(experts=[[[1, 2]]]),
            r"tokenSamples.experts: shape \[1, 1, 2\] .* is not \[numLayers=3\]",
        ),
        (
            lambda d: d["tokenSamples"].update(steps=[1] * 3999),
            r"tokenSamples.steps: shape \[3999\] .* is not \[samples=4000\] of integers",
        ),
        (
            lambda d: d["tokenSamples"].update(steps=[1.5] * 4000),
            r"tokenSamples.steps: shape \[4000\] \(float64\) is not \[samples=4000\]",
        ),
        (
            lambda d: d["tokenSamples"].update(steps=[1] * 3 + [0] + [1] * 3996),
            r"tokenSamples.steps\[3\]: 0 is not a 1-based step",
        ),
        (
            lambda d: d.update(tokens=10, load=[[0] * 16] * 3, coactivation=[[[0] * 16] * 16] * 3),
            r"RoutingStats load\[0\]: sums to 0",
        ),
    ],
)
def test_bad_documents_name_the_field(mutate, match, trace):
    _bad(mutate, match, trace)


def test_row_sum_invariant(trace):
    def move(d):  # keeps symmetry and zero diagonal, breaks sum_j coact == (k-1) * load
        c = d["coactivation"][0]
        for i, j in ((0, 1), (1, 0), (2, 3), (3, 2)):
            c[i][j] += 1

    _bad(
        move, r"coactivation\[0\]\[0\]: row sums to \d+, expected \(topK-1\)\*load\[0\]\[0\]", trace
    )


def test_missing_file(tmp_path):
    with pytest.raises(DocumentError, match="RoutingStats: no such file"):
        read_routing_stats(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("[")
    with pytest.raises(DocumentError, match="not JSON"):
        read_routing_stats(tmp_path / "x.json")
