"""build_plan -> MoEPlan v1: ranks, EP size, placement quality, memory refusal, CPU mode, reader."""

import copy
import json

import numpy as np
import pytest

from moe_contracts.plan import load_plan
from moejob_operator.core import models, plan, routing, topology
from moejob_operator.core.dsconfig import GpuCaps
from moejob_operator.core.errors import DocumentError
from moejob_operator.core.plan import check_plan as parse_plan
from moejob_operator.core.plan import write_plan


def read_plan(path):
    return load_plan(path, complete=True).raw


def _reports(fixture, *names):
    base = topology.load_topology(fixture)
    return [base.model_copy(update={"node": n}) for n in names] if names else [base]


def _tiny_plan(**kw):
    args = dict(global_batch=8, seq_len=64)
    args.update(kw)
    topo = args.pop("topo", _reports("pcie-bridged-pairs-4"))
    return plan.build_plan(
        plan.PlanRequest(
            "tiny", "default", models.resolve_model(args.pop("model", "tiny-mixtral")), topo, **args
        )
    )


@pytest.fixture(scope="module")
def two_h200_nodes():
    return plan.build_plan(
        plan.PlanRequest(
            "mixtral",
            "ml",
            models.resolve_model("mixtral-8x7b"),
            _reports("nvswitch-h200-8", "gpu-a", "gpu-b"),
            global_batch=64,
            micro_batch=1,
            seq_len=4096,
            training=plan.TrainingOptions(activation_checkpointing=True, steps=100),
        )
    )


def test_two_nvswitch_nodes(two_h200_nodes):
    doc = two_h200_nodes.document
    assert (doc["worldSize"], doc["epSize"], doc["device"], doc["distBackend"]) == (
        16,
        8,
        "cuda",
        "nccl",
    )
    ranks = doc["ranks"]
    assert [(r["node"], r["nodeRank"], r["localRank"], r["gpu"]) for r in ranks[7:9]] == [
        ("gpu-a", 0, 7, 7),
        ("gpu-b", 1, 0, 0),
    ]
    # every EP group (8 consecutive ranks) sits on one node = one NVSwitch group
    assert all(len({r["node"] for r in ranks[i : i + 8]}) == 1 for i in (0, 8))
    ds = doc["deepspeed"]
    assert ds["expert_parallel"]["autoep_size"] == 8 and ds["bf16"]["enabled"]
    assert (ds["train_batch_size"], doc["training"]["gradAccum"]) == (64, 4)
    mem = doc["memory"]
    assert mem["fits"] and mem["gpuMemoryBytes"] == 150754820096
    assert mem["estimatedPeakBytes"] == two_h200_nodes.memory.total < 0.9 * mem["gpuMemoryBytes"]
    assert doc["placement"]["quality"]["crossGroupBytesPerStep"] == 0
    assert doc["training"]["activationCheckpointing"] is True and doc["training"]["steps"] == 100
    assert json.loads(json.dumps(doc)) == doc  # plain JSON


def test_trainer_reader_accepts_the_plan(two_h200_nodes, tmp_path):
    write_plan(two_h200_nodes, tmp_path / "plan.json")
    parsed = load_plan(tmp_path / "plan.json")  # what the trainer runs
    assert (parsed.world_size, parsed.ep_size, parsed.autoep_enabled) == (16, 8, True)
    assert [list(r) for r in parsed.placement.permutation] == two_h200_nodes.document["placement"][
        "permutation"
    ]
    assert [r.gpu for r in parsed.ranks] == [r["gpu"] for r in two_h200_nodes.document["ranks"]]
    assert read_plan(tmp_path / "plan.json") == two_h200_nodes.document


def test_gpus_per_node_takes_a_whole_nvlink_group():
    p = _tiny_plan(gpus_per_node=2, global_batch=4)
    assert [r["gpu"] for r in p.document["ranks"]] == [0, 1]
    assert p.document["epSize"] == 2  # the pair is one NVLink group
    assert _tiny_plan(topo=_reports("pcie-only-4")).document["epSize"] == 1  # no NVLink


def test_rank_gpus_count_the_gpus_the_container_sees():
    """A pod given 4 of a node's 8 GPUs sees them as CUDA 0-3 (device plugin renumbering): the
    plan's ``gpu`` indexes those, whichever NVML indices were selected."""
    topo = topology.ClusterTopology.synthetic(nodes=1, gpus_per_node=8, group_size=4)
    picked = plan.subset(topo, [4, 5, 6, 7])
    ranks = plan._ranks(picked, np.array([2, 0, 3, 1]), cpu=False)
    assert [r["gpu"] for r in ranks] == [2, 0, 3, 1]
    assert [r["localRank"] for r in ranks] == [0, 1, 2, 3]
    whole = plan._ranks(topo, np.arange(8), cpu=False)
    assert [r["gpu"] for r in whole] == list(range(8))


def test_topology_aware_beats_contiguous_when_ep_spans_groups():
    # EP 4 over two NVLink pairs: half of each EP group is across PCIe. Routing with planted
    # co-activation clusters of 4 experts: keeping a cluster inside a pair saves cross-group bytes.
    stats = routing.synthetic_trace(
        4, 8, 2, 4096, num_clusters=2, cluster_affinity=0.9, seed=3
    ).without_tokens()
    ours = _tiny_plan(ep_size=4, routing_stats=stats, strategy="topology_aware")
    base = _tiny_plan(ep_size=4, routing_stats=stats, strategy="contiguous")
    q, qb = ours.document["placement"]["quality"], base.document["placement"]["quality"]
    assert q["basis"] == "routingStats"
    assert q["crossGroupBytesPerStep"] < 0.95 * qb["crossGroupBytesPerStep"]
    assert q["crossGroupVsContiguous"] < 0.95 and qb["crossGroupVsContiguous"] == 1.0
    assert q["contiguousCrossGroupBytesPerStep"] == qb["crossGroupBytesPerStep"]
    assert q["contiguousMaxMeanLoad"] == qb["maxMeanLoad"]
    assert any("spans NVLink groups" in w for w in ours.warnings)


def test_quality_bytes_are_per_step_of_this_job():
    stats = routing.synthetic_trace(4, 8, 2, 2048, seed=1).without_tokens()
    a = _tiny_plan(ep_size=4, routing_stats=stats, global_batch=8)
    b = _tiny_plan(ep_size=4, routing_stats=stats, global_batch=16)
    qa, qb = (p.document["placement"]["quality"]["crossGroupBytesPerStep"] for p in (a, b))
    assert qa > 0 and qb == pytest.approx(2 * qa, rel=1e-3)


def test_a_fallback_plan_says_the_layout_it_has():
    """topology_aware without routing statistics falls back to contiguous: the document says so
    (placement.fellBackTo) and so do status.plan and the PlanReady message, which named the asked
    strategy before."""
    from moejob_operator.reconcile import planning

    fell = _tiny_plan(ep_size=4)
    pl = fell.document["placement"]
    assert (pl["strategy"], pl["fellBackTo"]) == ("topology_aware", "contiguous")
    assert parse_plan(fell.document)  # the reader accepts the field
    s = planning.summary(parse_plan(fell.document))
    assert (s["strategy"], s["requestedStrategy"]) == ("contiguous", "topology_aware")
    assert planning.describe(s).startswith(
        "contiguous placement (topology_aware asked, no routing statistics) on "
    )
    assert "placement  contiguous (topology_aware without routing statistics" in plan.summarize(
        fell
    )
    stats = routing.synthetic_trace(4, 8, 2, 2048, seed=1).without_tokens()
    used = _tiny_plan(ep_size=4, routing_stats=stats)
    assert "fellBackTo" not in used.document["placement"]
    s = planning.summary(parse_plan(used.document))
    assert s["strategy"] == "topology_aware" and "requestedStrategy" not in s
    assert planning.describe(s).startswith("topology_aware placement on ")


def test_cpu_mode():
    p = plan.build_plan(
        plan.PlanRequest(
            "demo",
            "default",
            models.resolve_model("tiny-qwen3-moe"),
            None,
            device="cpu",
            nodes=["node-a", "node-b"],
            procs_per_node=2,
            cpu_memory_bytes=4 << 30,
            global_batch=8,
            seq_len=64,
        )
    )
    doc = p.document
    assert (doc["device"], doc["distBackend"], doc["worldSize"], doc["epSize"]) == (
        "cpu",
        "gloo",
        4,
        2,
    )
    assert all(r["gpu"] is None for r in doc["ranks"])
    assert [r["nodeRank"] for r in doc["ranks"]] == [0, 0, 1, 1]
    assert "bf16" not in doc["deepspeed"] and "fp16" not in doc["deepspeed"]
    assert doc["deepspeed"]["expert_parallel"]["preset_model"] == "qwen3_moe"
    assert doc["memory"]["gpuMemoryBytes"] == 4 << 30 and doc["memory"]["fits"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ep_size": 3}, r"epSize: 3 does not divide the number of experts 8"),
        ({"strategy": "greedy"}, r"strategy: 'greedy' is not one of"),
        ({"gpus_per_node": 8}, r"gpusPerNode: 8 requested but node 'ws-a6000' has 4 GPU\(s\)"),
        ({"nodes": ["gpu-z"]}, r"nodes: \['gpu-z'\] not discovered"),
        ({"routing_stats": routing.synthetic_trace(2, 8, 2, 64)}, r"routingStats: 2 layers x 8"),
        ({"global_batch": 6}, r"globalBatch: 6 is not divisible by the data-parallel size 4"),
        ({"device": "tpu"}, r"device: 'tpu'"),
    ],
)
def test_refusals_name_the_field(kwargs, match):
    with pytest.raises(DocumentError, match=match):
        _tiny_plan(**kwargs)


def test_refuses_a_job_that_does_not_fit():
    with pytest.raises(
        DocumentError,
        match=r"memory: the job needs [\d.]+ GiB per GPU but 126\.4 "
        r"GiB are usable .* short by [\d.]+ GiB\. Try "
        r"activation checkpointing: [\d.]+ GiB",
    ):
        plan.build_plan(
            plan.PlanRequest(
                "big",
                "default",
                models.resolve_model("deepseek-v3"),
                _reports("nvswitch-h200-8"),
                global_batch=8,
                micro_batch=1,
                seq_len=4096,
            )
        )


def test_cluster_topology_input_needs_gpu_caps():
    topo = topology.ClusterTopology.synthetic(nodes=2, gpus_per_node=4, group_size=4)
    with pytest.raises(DocumentError, match=r"gpu: GPU capabilities are required"):
        plan.build_plan(
            plan.PlanRequest(
                "x",
                "default",
                models.resolve_model("tiny-mixtral"),
                topo,
                global_batch=8,
                seq_len=64,
            )
        )
    p = plan.build_plan(
        plan.PlanRequest(
            "x",
            "default",
            models.resolve_model("tiny-mixtral"),
            topo,
            gpu=GpuCaps("NVIDIA H100", 85899345920, "9.0"),
            global_batch=8,
            seq_len=64,
        )
    )
    assert p.document["epSize"] == 4 and p.document["deepspeed"]["bf16"]["enabled"]


# ---- the document reader ------------------------------------------------------------------


def _mutated(doc, path, value):
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value == "drop-layer":  # a placement consistent in itself, not with the model
        node[path[-1]] = dict(
            node[path[-1]], numLayers=3, permutation=node[path[-1]]["permutation"][:3]
        )
    else:
        node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("kind",), "Plan", r"MoEPlan kind: 'Plan' is not 'MoEPlan'"),
        (("version",), 2, r"MoEPlan version: 2 is not a known version"),
        (("ranks", 1, "gpu"), 0, r"ranks\[1\]\.gpu: ws-a6000:0 is already used by rank 0"),
        (("ranks", 1, "rank"), 5, r"ranks\[1\]\.rank: 5 out of order"),
        (
            ("ranks", 1, "nodeRank"),
            1,
            r"ranks\[1\]\.nodeRank: 1 but node 'ws-a6000' has nodeRank 0",
        ),
        (
            ("placement", "permutation", 2),
            [0, 0, 1, 2, 3, 4, 5, 6],
            r"placement\.permutation\[2\]: .* is not a permutation of 0\.\.7",
        ),
        (("placement", "numLayers"), 3, r"placement\.permutation: has 4 rows, numLayers is 3"),
        (("placement",), "drop-layer", r"placement: 3 layers x 8 experts, the model has 4"),
        (
            ("deepspeed", "expert_parallel", "autoep_size"),
            4,
            r"autoep_size: 4 differs from epSize 2",
        ),
        (("deepspeed", "train_batch_size"), 9, r"train_batch_size: 9 != 2 x 1 x worldSize 4"),
        (("training", "microBatch"), 1, r"training\.microBatch: 1 differs"),
        (
            ("memory", "fits"),
            "yes",
            r"memory\.fits: 'yes' is invalid \(Input should be a valid boolean\)",
        ),
        (("model", "family"), "qwen3_moe", r"model\.hfConfig\.model_type: 'mixtral' differs"),
        (("device",), "cpu", r"ranks\[0\]\.gpu: 0 on a CPU plan"),
        (("worldSize",), 3, r"epSize: 2 must divide worldSize 3"),
    ],
)
def test_reader_refuses_bad_documents(path, value, match):
    doc = _tiny_plan().document
    parse_plan(doc)
    with pytest.raises(DocumentError, match=match):
        parse_plan(_mutated(doc, path, value))


def test_read_plan_errors(tmp_path):
    with pytest.raises(DocumentError, match=r"MoEPlan: plan file .* does not exist"):
        read_plan(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DocumentError, match=r"not JSON"):
        read_plan(tmp_path / "bad.json")
    doc = _tiny_plan().document
    del doc["ranks"]
    with pytest.raises(DocumentError, match=r"ranks: has None entries, worldSize is 4"):
        write_plan(doc, tmp_path / "plan.json")
    assert not (tmp_path / "plan.json").exists()


def test_ranks_follow_rank2gpu():
    p = _tiny_plan(ep_size=4, routing_stats=routing.synthetic_trace(4, 8, 2, 512).without_tokens())
    gpus = [p.topology.gpus[g][1] for g in p.placement.rank2gpu]
    assert [r["gpu"] for r in p.document["ranks"]] == gpus
    assert np.array_equal(np.array(p.document["placement"]["permutation"]), p.placement.permutation)
