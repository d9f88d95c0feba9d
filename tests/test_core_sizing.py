"""The sizing core: Auto fields choose the shape among the discovered GPUs, the plan records it,
a user-given value is never changed, and a job that fits nowhere is told the smallest shape that
would fit (checked against a brute-force search over node counts)."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest

from moejob_operator.core import models, sizing, throughput
from moejob_operator.core.errors import FieldError
from moejob_operator.core.memory import GiB
from moejob_operator.core.perf import largest_tensor
from moejob_operator.core.plan import PlanRequest, TrainingOptions, check_plan
from moejob_operator.core.sizing_refusal import LEAN
from moejob_operator.core.topology import ClusterTopology, load_topology

ALL = sizing.AutoFields(True, True, True, True, True, True)


def reports(fixture: str, *nodes: str):
    return [load_topology(fixture).model_copy(update={"node": n}) for n in nodes]


def request(model: str, topo, **kw) -> PlanRequest:
    kw.setdefault("global_batch", 64)
    kw.setdefault("seq_len", 1024)
    return PlanRequest("j", "ns", models.resolve_model(model), topo, **kw)


@pytest.fixture(scope="module")
def two_h200_nodes():
    return reports("nvswitch-h200-8", "gpu-a", "gpu-b")


@pytest.fixture(scope="module")
def sized_3b(two_h200_nodes):
    return sizing.plan_sized(
        request("bench-mixtral-3b", two_h200_nodes, global_batch=64, seq_len=2048), ALL
    )


def test_auto_picks_the_best_fitting_shape_and_the_plan_records_it(sized_3b):
    doc = sized_3b.document
    rec = doc["sizing"]
    chosen = rec["chosen"]
    # the plan is the chosen shape's
    assert doc["worldSize"] == chosen["nodeCount"] * chosen["gpusPerNode"]
    assert doc["epSize"] == chosen["expertParallelSize"]
    assert doc["training"]["microBatch"] == chosen["microBatch"]
    assert doc["training"]["activationCheckpointing"] == chosen["activationCheckpointing"]
    assert sorted({r["node"] for r in doc["ranks"]}) == sorted(chosen["nodes"])
    assert rec["predictedPeakBytes"] == doc["memory"]["estimatedPeakBytes"]
    assert doc["memory"]["fits"]
    check_plan(doc)
    # ranked by predicted tokens/s, the chosen one first; every listed candidate fits
    tps = [c["tokensPerSecond"] for c in rec["candidates"]]
    assert tps == sorted(tps, reverse=True)
    assert rec["candidates"][0] == {**rec["candidates"][0], **chosen}
    usable = 0.9 * doc["memory"]["gpuMemoryBytes"]
    assert all(c["peakBytes"] <= usable for c in rec["candidates"])
    assert rec["predictedTokensPerSecond"] == pytest.approx(tps[0])
    assert set(rec["auto"]) == set(sizing.SIZING_FIELDS.values())


def test_rejected_shapes_say_why(sized_3b):
    rejected = sized_3b.document["sizing"]["rejected"]
    assert rejected, "a 3.4 B model at micro-batch 64, seq 2048 does not fit one H200"
    for c in rejected:
        assert c["rejected"]
        if c["peakBytes"]:
            assert "GiB per GPU" in c["rejected"]
            assert c["peakBytes"] > 0.9 * 150754820096


def test_the_search_is_exhaustive_over_the_allowed_values(two_h200_nodes):
    """Every (nodes, GPUs, EP, checkpointing, persistence) group the Auto fields allow either
    has a fitting candidate or a rejection; each fitting candidate's micro-batch is the largest
    that fits (the next larger divisor of the per-rank batch is rejected)."""
    req = request("bench-mixtral", two_h200_nodes, global_batch=32, seq_len=512)
    fits, rejected, _ = sizing.search(req, ALL)
    for c in fits:
        per_rank = 32 // c.shape.world_size
        bigger = [d for d in range(c.shape.micro_batch + 1, per_rank + 1) if per_rank % d == 0]
        if bigger:
            assert any(
                r.shape.micro_batch == bigger[0]
                and (r.shape.nodes, r.shape.gpus_per_node, r.shape.ep_size)
                == (c.shape.nodes, c.shape.gpus_per_node, c.shape.ep_size)
                for r in rejected
            )
    worlds = {c.shape.world_size for c in fits}
    assert worlds <= {1, 2, 4, 8, 16, 32}
    assert {16, 32}.isdisjoint({c.shape.world_size for c in fits if c.shape.micro_batch > 2})


@pytest.mark.parametrize(
    "fixed",
    [
        {"micro_batch": 2},
        {"gpus_per_node": 4},
        {"ep_size": 2},
        {"activation_checkpointing": True},
        {"nodes": ["gpu-b"]},
        {"micro_batch": 1, "gpus_per_node": 2, "activation_checkpointing": False},
    ],
    ids=lambda d: ",".join(d),
)
def test_a_user_given_value_is_never_changed(two_h200_nodes, fixed):
    auto = sizing.AutoFields(
        nodes="nodes" not in fixed,
        gpus_per_node="gpus_per_node" not in fixed,
        ep_size="ep_size" not in fixed,
        micro_batch="micro_batch" not in fixed,
        activation_checkpointing="activation_checkpointing" not in fixed,
        persistence=True,
    )
    kw = {k: v for k, v in fixed.items() if k != "activation_checkpointing"}
    training = TrainingOptions(
        activation_checkpointing=fixed.get("activation_checkpointing", False)
    )
    req = request("bench-mixtral", two_h200_nodes, global_batch=32, training=training, **kw)
    plan = sizing.plan_sized(req, auto)
    rec = plan.document["sizing"]
    for c in [rec["chosen"], *rec["candidates"]]:
        if "micro_batch" in fixed:
            assert c["microBatch"] == fixed["micro_batch"]
        if "gpus_per_node" in fixed:
            assert c["gpusPerNode"] == fixed["gpus_per_node"]
        if "ep_size" in fixed:
            assert c["expertParallelSize"] == fixed["ep_size"]
        if "activation_checkpointing" in fixed:
            assert c["activationCheckpointing"] == fixed["activation_checkpointing"]
        if "nodes" in fixed:
            assert c["nodes"] == fixed["nodes"]
    assert (
        plan.document["training"]["activationCheckpointing"]
        == rec["chosen"]["activationCheckpointing"]
    )


def test_a_user_persistence_threshold_is_kept(two_h200_nodes):
    user = {"zero_optimization": {"stage3_param_persistence_threshold": 12345}}
    auto = sizing.AutoFields(True, True, True, True, True, persistence=False)
    req = request("bench-mixtral", two_h200_nodes, global_batch=32, ds_overrides=user)
    plan = sizing.plan_sized(req, auto)
    zero = plan.document["deepspeed"]["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 12345
    assert {c["persistence"] for c in plan.document["sizing"]["candidates"]} == {"planner"}


def test_every_parameter_persistent_is_a_candidate_on_several_ranks(two_h200_nodes):
    req = request("tiny-mixtral", two_h200_nodes, global_batch=64, seq_len=256)
    fits, _, _ = sizing.search(req, ALL)
    multi = [c for c in fits if c.shape.world_size > 1]
    assert {c.shape.persistent for c in multi} == {False, True}
    assert not any(c.shape.persistent for c in fits if c.shape.world_size == 1)
    # its plan keeps every tensor whole
    c = next(c for c in multi if c.shape.persistent)
    plan = sizing.build_plan(sizing.shape_request(req, c.shape))
    threshold = plan.document["deepspeed"]["zero_optimization"][
        "stage3_param_persistence_threshold"
    ]
    assert threshold > largest_tensor(req.model.spec)


def test_ties_prefer_fewer_gpus_and_no_recompute(two_h200_nodes):
    plan = sizing.plan_sized(request("tiny-mixtral", two_h200_nodes, global_batch=64), ALL)
    rec = plan.document["sizing"]
    best = rec["candidates"][0]
    same = [c for c in rec["candidates"] if c["stepSeconds"] == best["stepSeconds"]]
    assert best["nodeCount"] * best["gpusPerNode"] == min(
        c["nodeCount"] * c["gpusPerNode"] for c in same
    )
    assert not best["activationCheckpointing"] or all(c["activationCheckpointing"] for c in same)


def _fits_on(req: PlanRequest, n: int, template: ClusterTopology, auto: sizing.AutoFields) -> bool:
    """Brute force: does any shape fit on ``n`` nodes like ``template``'s?"""
    per_node = template.num_gpus // len(template.nodes)
    topo = ClusterTopology.synthetic(n, per_node, per_node, memory_bytes=min(template.memory_bytes))
    world = topo.num_gpus
    batch = max(req.global_batch, world)
    batch += -batch % world
    hypo = replace(
        req,
        topology=topo,
        nodes=None,
        gpus_per_node=per_node,
        global_batch=batch,
        gpu=sizing._cluster(replace(req, gpus_per_node=None))[1],
    )
    found, _, _ = sizing.search(hypo, replace(auto, nodes=False, gpus_per_node=False))
    return bool(found)


def test_refusal_names_the_smallest_node_count_that_fits():
    """mixtral-8x7b at seq 4096 on one 8 x H100 node fits nowhere there; the refusal names the
    fewest such nodes on which it fits, and a brute-force search over node counts agrees."""
    topo_reports = reports("nvswitch-h100-8", "node-a")
    req = request("mixtral-8x7b", topo_reports, global_batch=64, seq_len=4096)
    with pytest.raises(sizing.NoShapeFits) as info:
        sizing.plan_sized(req, ALL)
    msg = str(info.value)
    assert msg.startswith("memory: no shape fits in GPU memory on node-a")
    n = int(msg.split("It needs ")[1].split(" nodes x 8")[0])
    template = ClusterTopology.from_reports(topo_reports)
    assert _fits_on(req, n, template, LEAN)
    assert not any(_fits_on(req, m, template, LEAN) for m in range(1, n))
    gib = float(re.search(r"It needs \d+ nodes x 8 [^(]*\([^)]*: ([\d.]+) GiB per GPU", msg)[1])
    assert gib * GiB <= 0.9 * min(template.memory_bytes)


def test_refusal_names_the_user_values_to_change():
    """With a fixed micro-batch that no node count rescues (activations do not shard), the
    refusal says which user-given values to change, and on how many nodes."""
    req = request(
        "mixtral-8x7b",
        reports("nvswitch-h100-8", "node-a"),
        global_batch=64,
        seq_len=4096,
        micro_batch=8,
    )
    auto = sizing.AutoFields(nodes=True, gpus_per_node=True, ep_size=True, persistence=True)
    with pytest.raises(sizing.NoShapeFits, match=r"It needs \d+ nodes x 8 .* with microBatch \d"):
        sizing.plan_sized(req, auto)


def test_auto_needs_gpus():
    req = PlanRequest(
        "j",
        "ns",
        models.resolve_model("tiny-mixtral"),
        None,
        device="cpu",
        global_batch=4,
        seq_len=64,
    )
    with pytest.raises(FieldError, match="Auto sizing plans GPU jobs") as info:
        sizing.plan_sized(req, ALL)
    assert info.value.field == "device"


def test_prediction_terms_move_the_right_way():
    spec = models.resolve_model("bench-mixtral-3b").spec
    base = dict(
        seq_len=2048,
        world_size=1,
        ep_size=1,
        autoep=False,
        compiled=True,
        fused_optimizer=True,
        persistence_threshold=10**12,
        bytes_per_elem=2,
    )
    one = throughput.workload(
        spec, micro_batch=8, grad_accum=1, activation_checkpointing=False, **base
    )
    ckpt = throughput.workload(
        spec, micro_batch=8, grad_accum=1, activation_checkpointing=True, **base
    )
    small = throughput.workload(
        spec, micro_batch=1, grad_accum=8, activation_checkpointing=False, **base
    )
    p1, p2, p3 = (throughput.predict(w, "NVIDIA H200") for w in (one, ckpt, small))
    assert p2.terms["compute"] == pytest.approx(p1.terms["compute"] * 4 / 3)
    per_step = throughput.load_calibration().coefficients.host_step
    assert p3.terms["layers"] - per_step == pytest.approx(8 * (p1.terms["layers"] - per_step))
    assert p3.terms["compute"] == pytest.approx(p1.terms["compute"])
    assert p1.calibrated and not throughput.predict(one, "NVIDIA A100-SXM4-80GB").calibrated
    # an older GPU computes slower (datasheet ratio), the same host work
    a100 = throughput.predict(one, "NVIDIA A100-SXM4-80GB")
    assert a100.terms["compute"] > p1.terms["compute"]
    assert a100.terms["layers"] == p1.terms["layers"]


def test_the_shipped_calibration_says_where_it_came_from():
    cal = throughput.load_calibration()
    assert cal.gpu == "NVIDIA H200"
    src = cal.source
    assert src["fittedFiles"] and src["heldOutFiles"]
    assert set(src["fittedFiles"]) != set(src["heldOutFiles"])
    assert 0 < src["heldOut"]["meanAbsError"] < 1
    assert all(v >= 0 for v in vars(cal.coefficients).values())
    assert 0 < 1 / cal.coefficients.compute <= 1  # no plan beats the measured peak


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations([1, 2, 4], 2)))
def test_no_less_memory_and_no_slower_step_with_a_larger_micro_batch(two_h200_nodes, a, b):
    req = request("bench-mixtral", two_h200_nodes, global_batch=32)
    auto = sizing.AutoFields(micro_batch=True)
    fits, _, _ = sizing.search(replace(req, nodes=["gpu-a"], gpus_per_node=1), auto)
    assert fits
    ca = sizing._evaluate(
        req,
        replace(fits[0].shape, micro_batch=a),
        *sizing._cluster(replace(req, nodes=["gpu-a"], gpus_per_node=1)),
        0.0,
    )
    cb = sizing._evaluate(
        req,
        replace(fits[0].shape, micro_batch=b),
        *sizing._cluster(replace(req, nodes=["gpu-a"], gpus_per_node=1)),
        0.0,
    )
    assert ca.peak_bytes <= cb.peak_bytes  # equal while the optimizer step is the peak
    assert ca.step.seconds >= cb.step.seconds
