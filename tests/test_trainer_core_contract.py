"""The contract both ways: a MoEPlan the planning core wrote is read (and run) by the trainer,
and the RoutingStats the trainer wrote are read by the planning core."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moe_contracts import routing as contract_routing
from moe_contracts.plan import parse_plan
from moe_trainer.telemetry import routing

core_plan = pytest.importorskip("moejob_operator.core.plan")
core_models = pytest.importorskip("moejob_operator.core.models")
core_routing = pytest.importorskip("moejob_operator.core.routing")

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def cpu_plan(steps=4):
    """Core plan for 2 CPU processes, with clustered routing stats so the permutation is not the
    identity."""
    stats = core_routing.synthetic_trace(
        4, 8, 2, 4096, zipf_s=0.6, num_clusters=2, cluster_affinity=0.9, seed=3
    ).without_tokens()
    return core_plan.build_plan(
        core_plan.PlanRequest(
            "demo",
            "default",
            core_models.resolve_model("tiny-mixtral"),
            None,
            device="cpu",
            nodes=["node-a"],
            procs_per_node=2,
            cpu_memory_bytes=4 << 30,
            global_batch=4,
            seq_len=64,
            routing_stats=stats,
            training=core_plan.TrainingOptions(
                steps=steps, checkpoint_every_steps=2, data={"kind": "corpus"}
            ),
        )
    )


def test_trainer_reads_a_core_plan():
    doc = cpu_plan().document
    plan = parse_plan(json.loads(json.dumps(doc)))
    assert (plan.world_size, plan.ep_size, plan.autoep_enabled) == (2, 2, True)
    assert plan.placement.permutation == tuple(tuple(r) for r in doc["placement"]["permutation"])
    assert plan.training.micro_batch == doc["deepspeed"]["train_micro_batch_size_per_gpu"]
    assert plan.training.balance.mode == "per_layer_aux" and plan.training.data.kind == "corpus"
    assert plan.raw["device"] == "cpu"


def test_core_reads_trainer_routing_stats():
    rng = np.random.default_rng(0)
    E, K, T = 8, 2, 300
    topk = [np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(3)]

    class Probe:
        logits = [None] * 3

    Probe.topk = [__import__("torch").as_tensor(t) for t in topk]
    Probe.logits = [__import__("torch").zeros(T, E)] * 3
    load, coact, _ = routing.step_counts(Probe, E)
    perm = [list(rng.permutation(E)) for _ in range(3)]
    load, coact = routing.to_original_ids(load.numpy(), coact.numpy(), perm)
    doc = contract_routing.routing_stats_doc(load, coact, tokens=T, steps=1, top_k=K, model="x")
    stats = contract_routing.parse_routing_stats(json.loads(json.dumps(doc)))
    assert stats.load.sum() == 3 * T * K and stats.top_k == K


@pytest.mark.parametrize(
    "name", ["routing_stats_real_text.json", "routing_stats_real_text_global_aux.json"]
)
def test_core_reads_recorded_real_text_stats(name):
    if not (RESULTS / name).exists():
        pytest.skip(f"{name} not recorded")
    stats = contract_routing.read_routing_stats(RESULTS / name)
    assert stats.source == "trainer" and stats.num_experts == 64


@pytest.mark.slow
def test_core_plan_trains_on_two_cpu_processes(tmp_path):
    from moe_trainer.launch import launch

    p = cpu_plan(steps=4)
    perm = p.document["placement"]["permutation"]
    assert any(row != sorted(row) for row in perm)
    (tmp_path / "plan.json").write_text(json.dumps(p.document))
    env = dict(os.environ, MOE_VERIFY_PLACEMENT="1")
    codes = launch(
        2,
        ["--plan", str(tmp_path / "plan.json"), "--checkpoint-dir", str(tmp_path / "ck")],
        env=env,
        timeout=400,
        log_prefix=str(tmp_path / "log"),
    )
    assert codes == [0, 0], (tmp_path / "log.rank0.log").read_text()[-3000:]
    for rank in range(2):
        rep = json.loads((tmp_path / "ck" / f"placement_check_rank{rank}.json").read_text())
        assert rep["ok"] and [x["experts"] for x in rep["layers"]] == [
            r[rank * 4 : rank * 4 + 4] for r in perm
        ]
    stats = contract_routing.read_routing_stats(tmp_path / "ck" / "routing_stats.json")
    assert (stats.num_layers, stats.num_experts, stats.top_k, stats.steps) == (4, 8, 2, 4)
    assert stats.tokens == 4 * 4 * 64  # steps x global batch x seqLen
    # the sample (merged over both ranks) says which step each of its tokens came from
    assert stats.token_steps is not None and len(stats.token_steps) == stats.token_experts.shape[1]
    assert set(stats.token_steps.tolist()) == {1, 2, 3, 4}
