"""spec.placement.replicas end to end on the operator side: the spec's refusals, the plan's
``placement.replicas`` and ``quality.replicas``, the memory model's ``expertCopiesBytes``, and
``moectl plan``'s line (docs/placement.md, "Replicated experts")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_contracts.dispatch import tier_bytes
from moe_contracts.plan import load_plan
from moejob_operator import cli
from moejob_operator.core import memory, models, routing
from moejob_operator.core.dsconfig import GpuCaps, deepspeed_config
from moejob_operator.spec import SpecError, parse_spec

MINIMAL = {"image": "img", "model": {"preset": "tiny-mixtral"}}


def _spec(**placement):
    return parse_spec({**MINIMAL, "placement": placement})


def test_spec_defaults_and_values():
    spec = _spec()
    assert spec.placement.replicas is None and spec.placement.overhead_percent == 25
    spec = _spec(replicas="Auto", maxExpertMemoryOverhead="12%")
    assert spec.placement.replicas == "Auto" and spec.placement.overhead_percent == 12
    assert _spec(replicas=3, dispatcher="Dedup").placement.replicas == 3


@pytest.mark.parametrize(
    ("placement", "words"),
    [
        ({"replicas": "Some"}, r"placement\.replicas"),
        ({"replicas": -1}, r"placement\.replicas"),
        ({"maxExpertMemoryOverhead": "25"}, r"maxExpertMemoryOverhead: '25' is not a percentage"),
        ({"maxExpertMemoryOverhead": "150%"}, r"maxExpertMemoryOverhead: '150%' is above"),
        ({"replicas": 2, "dispatcher": "AutoEP"}, r"placement\.replicas: 2 needs dispatcher Dedup"),
    ],
)
def test_spec_refusals_name_the_field(placement, words):
    with pytest.raises(SpecError, match=words):
        _spec(**placement)


def test_memory_counts_copies_as_real_experts():
    spec = models.resolve_model("mixtral-8x7b").spec
    cfg, _ = deepspeed_config(
        spec,
        world_size=16,
        ep_size=8,
        global_batch=16,
        micro_batch=1,
        gpu=GpuCaps("NVIDIA H200", 150754820096, "9.0"),
    )
    kw = dict(world_size=16, ep_size=8, seq_len=4096, micro_batch=1)
    base = memory.estimate_memory(spec, cfg, **kw)
    more = memory.estimate_memory(spec, cfg, expert_copies=3, **kw)
    assert "expertCopiesBytes" not in base.breakdown
    p, accum = memory.precision_bytes(cfg), memory.grad_accum_bytes(cfg)
    adam, _ = memory.optimizer_bytes(cfg)
    # ZeRO-3: each copy's params, grads and Adam states sharded over 16 / 8 = 2 ranks
    want = 3 * spec.expert_params() * (p + accum + adam) / 2
    assert more.breakdown["expertCopiesBytes"] == int(want)
    assert sum(more.breakdown.values()) == pytest.approx(more.total, abs=16)
    assert more.total > base.total + want


def _files(tmp_path, experts=16, tokens=True):
    cfg = dict(
        models.preset_hf_config("tiny-mixtral"), num_local_experts=experts, num_experts_per_tok=2
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    stats = routing.synthetic_trace(cfg["num_hidden_layers"], experts, 2, 512, seed=2)
    if not tokens:
        stats = stats.without_tokens()
    (tmp_path / "routing.json").write_text(json.dumps(stats.to_json()))
    return cfg, stats


def _plan(capsys, tmp_path, *extra):
    argv = [
        "plan",
        "--cpu",
        "--nodes",
        "a,b",
        "--procs-per-node",
        "2",
        "--cpu-memory-gib",
        "4",
        "--model",
        str(tmp_path / "config.json"),
        "--stats",
        str(tmp_path / "routing.json"),
        "--ep-size",
        "4",
        "--global-batch",
        "8",
        "--seq-len",
        "64",
        "-o",
        str(tmp_path / "plan.json"),
        *extra,
    ]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# tokens per step where tiny-mixtral's copies pay for their weights (8 x 1024 tokens: a hot
# expert keeps more than 1.5 x F = 192 of its group's tokens at home per micro step and layer)
PAYS = ("--seq-len", "1024")


def test_auto_writes_replicas_their_figures_and_memory(capsys, tmp_path):
    cfg, stats = _files(tmp_path)
    code, out, err = _plan(
        capsys, tmp_path, "--replicas", "auto", "--max-expert-memory-overhead", "50", *PAYS
    )
    assert code == 0, err
    assert "replicas   auto: " in out and "expertCopies" in out
    plan = load_plan(tmp_path / "plan.json", complete=True)  # the contract's checks pass
    doc = plan.raw
    rep, q = doc["placement"]["replicas"], doc["placement"]["quality"]["replicas"]
    assert q["chosen"] and q["extraCopies"] == sum(
        len(h) - 1 for layer in rep for h in layer["holders"]
    )
    assert 0 < q["extraCopies"] <= 2 * 4 * cfg["num_hidden_layers"]  # 50% of 4 = 2 per rank
    # the figures are the byte model on the samples with the plan's serve table, per step
    te = stats.token_experts
    serve = np.array([layer["serve"] for layer in rep])
    src = np.arange(te.shape[1]) % 4
    hidden = cfg["hidden_size"] * 4  # fp32 on CPU
    got = tier_bytes(serve, te, src, [0, 0, 1, 1], [0, 0, 1, 1], 4, hidden_bytes=hidden)
    scale = 8 * 1024 / te.shape[1]
    cross = q["crossGroupBytesPerStep"]
    assert cross["withCopies"] == round(got["dedup"]["crossGroup"] * scale)
    assert cross["withCopies"] < cross["withoutCopies"]
    # the copies' weights: one expert's w1 + w2 + w3 there and back per micro step, per copy
    # outside its home's group (ranks 0-1 and 2-3 are the groups)
    expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"] * 4
    micro = doc["deepspeed"]["gradient_accumulation_steps"]
    away = sum(1 for layer in rep for h in layer["holders"] for r in h[1:] if r // 2 != h[0] // 2)
    assert q["syncBytesPerStep"]["crossGroupBytesPerStep"] == 2 * expert * micro * away > 0
    net = q["netCrossGroupBytesPerStep"]
    assert (
        net["withCopies"] == cross["withCopies"] + q["syncBytesPerStep"]["crossGroupBytesPerStep"]
    )
    assert net["withCopies"] < net["withoutCopies"] == cross["withoutCopies"]
    assert (
        doc["placement"]["quality"]["dispatch"]["dedup"]["crossGroupBytesPerStep"]
        == (cross["withCopies"])
    )
    assert doc["memory"]["breakdown"]["expertCopiesBytes"] > 0


def test_auto_declines_copies_whose_weights_cost_more_than_they_save(capsys, tmp_path):
    """At 8 x 64 tokens per step no copy keeps enough tokens at home to pay for moving its
    expert's weights: Auto places none and says why, with the figures; an explicit count is kept
    as asked, with the same figures."""
    _files(tmp_path)
    code, out, err = _plan(
        capsys, tmp_path, "--replicas", "auto", "--max-expert-memory-overhead", "50"
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "plan.json").read_text())
    q = doc["placement"]["quality"]["replicas"]
    assert "replicas" not in doc["placement"] and not q["chosen"]
    assert "would cost more than the token bytes they save" in q["reason"]
    assert "would cost more" in out
    net, token = q["netCrossGroupBytesPerStep"], q["crossGroupBytesPerStep"]
    assert token["withCopies"] < token["withoutCopies"] <= net["withCopies"]
    assert "expertCopiesBytes" not in doc["memory"]["breakdown"]
    code, _out, err = _plan(capsys, tmp_path, "--replicas", "2")
    assert code == 0, err
    doc = json.loads((tmp_path / "plan.json").read_text())
    q = doc["placement"]["quality"]["replicas"]
    assert q["chosen"] and "replicas" in doc["placement"] and "netCrossGroupBytesPerStep" in q


def test_absent_replicas_change_nothing(capsys, tmp_path):
    _files(tmp_path)
    assert _plan(capsys, tmp_path)[0] == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert "replicas" not in doc["placement"] and "replicas" not in doc["placement"]["quality"]
    assert "expertCopiesBytes" not in doc["memory"]["breakdown"]


def test_auto_explains_why_not(capsys, tmp_path):
    _files(tmp_path, tokens=False)
    code, out, err = _plan(capsys, tmp_path, "--replicas", "auto")
    assert code == 0, err
    assert "replicas   auto: none (no routing statistics with tokenSamples" in out
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert "replicas" not in doc["placement"]
    code, out, err = _plan(capsys, tmp_path, "--replicas", "auto", "--dispatcher", "autoep")
    assert code == 0 and "replicas   auto: none (dispatcher 'autoep'" in out


@pytest.mark.parametrize(
    ("tokens", "extra", "words"),
    [
        (False, [], "no routing statistics with tokenSamples"),
        (True, ["--dispatcher", "autoep"], "replicas need 'dedup'"),
        (True, [], "exceed maxExpertMemoryOverhead 25% = 1 per rank x 4 EP ranks = 4"),
    ],
)
def test_explicit_count_is_refused_when_it_cannot_be_served(capsys, tmp_path, tokens, extra, words):
    _files(tmp_path, tokens=tokens)
    code, _out, err = _plan(capsys, tmp_path, "--replicas", "5", *extra)
    assert code == 2 and words in err, err


@pytest.mark.parametrize(
    ("placement", "want"),
    [({}, (None, 25)), ({"replicas": "Auto", "maxExpertMemoryOverhead": "50%"}, ("auto", 50))],
)
def test_the_operator_hands_the_spec_to_the_planner(placement, want):
    from moejob_operator.builders.common import JobRef
    from moejob_operator.core.topology import load_topology
    from moejob_operator.reconcile import planning

    spec = parse_spec(
        {
            "image": "img",
            "model": {"preset": "bench-mixtral"},
            "device": "GPU",
            "placement": placement,
        }
    )
    reports = {n: load_topology("nvswitch-h100-8").model_copy(update={"node": n}) for n in "ab"}
    req = planning.plan_request(JobRef("ns", "j", "uid"), spec, ["a", "b"], reports, None, 0)
    assert (req.replicas, req.max_expert_memory_overhead) == want


@pytest.mark.parametrize("mode", ["some", -1])
def test_the_planner_refuses_an_unknown_mode(mode):
    from moejob_operator.core.errors import FieldError
    from moejob_operator.core.plan_replicas import plan_replicas

    with pytest.raises(FieldError, match="is not 'auto', 'none' or a number of copies"):
        plan_replicas(mode, 25, None, None, None, "dedup", hidden_bytes=2, tokens_per_step=1)  # type: ignore[arg-type]


def test_the_trainer_takes_the_planners_copies_as_they_are(capsys, tmp_path):
    """The plan moectl writes with copies is what the trainer's dispatcher builds its layers from:
    every layer passes the trainer's own checks and serves each (source rank, expert) from the
    rank the plan says (original ids through the permutation to the router's slot ids)."""
    from moe_trainer.dispatch.dedup_ep import contiguous_layout
    from moe_trainer.dispatch.dedup_replicas import check_replicas, plan_layouts, sync_bytes

    _files(tmp_path)
    code, _out, err = _plan(
        capsys, tmp_path, "--replicas", "auto", "--max-expert-memory-overhead", "50", *PAYS
    )
    assert code == 0, err
    pl = load_plan(tmp_path / "plan.json", complete=True).placement
    assert pl is not None and pl.replicas is not None
    base = contiguous_layout(pl.num_experts, pl.ep_size, [0, 0, 1, 1])
    layouts = plan_layouts(base, pl.replicas, pl.permutation)
    copies = 0
    for layer, lay in enumerate(layouts):
        check_replicas(lay, pl.ep_size)
        for slot, e in enumerate(pl.permutation[layer]):
            assert lay.holders[slot] == pl.replicas[layer].holders[e]
            for p in range(pl.ep_size):
                assert lay.serve[p][slot] == pl.replicas[layer].serve[p][e]
        copies += sum(len(h) - 1 for h in lay.holders)
    assert copies > 0
    # the plan's weight-sync figure is what the trainer's sync counters add up (one EP group)
    doc = json.loads((tmp_path / "plan.json").read_text())
    cfg = json.loads((tmp_path / "config.json").read_text())
    expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"] * 4
    micro = doc["deepspeed"]["gradient_accumulation_steps"]
    trainer = {
        t: micro * sum(sync_bytes(lay, expert)[t] for lay in layouts)
        for t in ("intraGroup", "crossGroup", "crossNode")
    }
    planned = doc["placement"]["quality"]["replicas"]["syncBytesPerStep"]
    assert {t: planned[f"{t}BytesPerStep"] for t in trainer} == trainer
