"""Memory model: sharding arithmetic, the effect of each knob, and the readable table."""

import pytest

from moejob_operator.core import memory, models
from moejob_operator.core.dsconfig import CPU, GpuCaps, deepspeed_config

H200 = GpuCaps("NVIDIA H200", 150754820096, "9.0")
GiB = 1 << 30


def _estimate(
    name="mixtral-8x7b",
    *,
    world=8,
    ep=8,
    seq=4096,
    micro=1,
    gpu=H200,
    autoep=True,
    overrides=None,
    **kw,
):
    spec = models.resolve_model(name).spec
    cfg, _ = deepspeed_config(
        spec,
        world_size=world,
        ep_size=ep,
        global_batch=world * micro,
        micro_batch=micro,
        gpu=gpu,
        autoep=autoep,
        overrides=overrides,
    )
    return spec, memory.estimate_memory(
        spec, cfg, world_size=world, ep_size=ep, seq_len=seq, micro_batch=micro, **kw
    )


def test_model_states_are_sharded_over_the_world():
    spec, e8 = _estimate(world=8, ep=8)
    _, e16 = _estimate(world=16, ep=8)
    total = spec.counts().total
    b8, b16 = e8.breakdown, e16.breakdown
    # 2 B/param for bf16 params and grads, 12 B/param Adam, each divided by the world size
    assert b8["gradientsBytes"] == pytest.approx(2 * total / 8, rel=1e-6)
    assert b8["optimizerBytes"] == pytest.approx(12 * total / 8, rel=1e-6)
    assert b16["optimizerBytes"] == pytest.approx(b8["optimizerBytes"] / 2, rel=1e-6)
    # parameters add only the small persistent ones (norms, routers) on top of the shard
    assert 0 < b8["parametersBytes"] - 2 * total / 8 < 1e-3 * b8["parametersBytes"]


def test_bf16_master_weights_count_bf16_adam_states_and_temporaries():
    """deepspeed.bf16 bf16_master_weights_and_grads + bf16_optimizer_states: the 16-bit partition
    is the master, the moments are bf16: 4 B/param of state (not 12), 4 B of step temporaries
    (not 8)."""
    spec, fp32 = _estimate(world=8, ep=8)
    bf16 = {
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True,
        }
    }
    _, masters = _estimate(world=8, ep=8, overrides=bf16)
    total = spec.counts().total
    assert masters.breakdown["optimizerBytes"] == pytest.approx(4 * total / 8, rel=1e-6)
    assert fp32.total - masters.total >= 8 * total / 8
    # only one of the two keys: DeepSpeed keeps fp32 states (and wants offload) -> counted as fp32
    half = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
    _, one_key = _estimate(world=8, ep=8, overrides=half)
    assert one_key.breakdown["optimizerBytes"] == fp32.breakdown["optimizerBytes"]


def test_autoep_gathers_only_local_experts():
    spec, with_ep = _estimate(world=8, ep=8)
    _, without = _estimate(world=8, ep=1, autoep=False)
    expert_bytes = 2 * spec.expert_params()
    prefetch = 2 * int(0.9 * spec.hidden_size**2)
    # one expert per rank with EP 8: params + full grads of that module, plus the prefetch bucket
    assert with_ep.breakdown["gatheredParametersBytes"] == 2 * expert_bytes + prefetch
    assert without.breakdown["gatheredParametersBytes"] == 2 * 8 * expert_bytes + prefetch
    assert with_ep.breakdown["moeDispatchBytes"] > 0 == without.breakdown["moeDispatchBytes"]


def test_activation_terms_scale_with_tokens_and_checkpointing():
    _, e1 = _estimate(micro=1)
    _, e2 = _estimate(micro=2)
    _, ckpt = _estimate(micro=1, activation_checkpointing=True)
    assert e2.breakdown["activationsBytes"] == pytest.approx(
        2 * e1.breakdown["activationsBytes"], rel=1e-6
    )
    assert ckpt.breakdown["activationsBytes"] < e1.breakdown["activationsBytes"] / 4
    assert ckpt.total < e1.total


def test_activation_formula_for_a_mixtral_layer():
    spec = models.resolve_model("tiny-mixtral").spec  # h 64, F 128, 4 heads x 16, 2 kv heads
    h, q, kv, f, k, e, p = 64, 64, 32, 128, 2, 8, 2
    attn = p * (2 * h + 3 * q + 3 * kv + q)
    norms = 2 * (4 * h + p * h)
    mlp = 8 * e + p * (h + k * (h + 4 * f) + k * h)
    assert memory.activation_bytes_per_token_layer(spec, 0, p) == attn + norms + mlp


def test_stage2_override_keeps_parameters_resident():
    spec, e = _estimate(world=8, ep=8, overrides={"zero_optimization": {"stage": 2}})
    counts = spec.counts()
    assert e.breakdown["parametersBytes"] == int(2 * (counts.dense + counts.expert / 8))
    assert e.breakdown["gatheredParametersBytes"] == 0


def test_fits_and_shortfall():
    _, e = _estimate(seq=4096, micro=1, activation_checkpointing=True)
    assert e.fits(H200.memory_bytes)
    assert not e.fits(e.total, headroom=0.5) and e.fits(e.total, headroom=1.0)
    assert e.shortfall(e.total, headroom=0.5) == pytest.approx(e.total / 2, abs=1)
    _, big = _estimate("deepseek-v3", world=64, ep=8, seq=4096)
    assert not big.fits(H200.memory_bytes) and big.shortfall(H200.memory_bytes) > 0


def test_optimizer_step_can_be_the_peak():
    # tiny activations, many parameters per rank: the fp32 gradient copy at the step dominates
    _, e = _estimate("mixtral-8x7b", world=8, ep=8, seq=8, micro=1)
    assert e.peak_phase == "optimizer step"
    assert e.breakdown["optimizerStepExtraBytes"] > 0
    assert sum(e.breakdown.values()) == pytest.approx(e.total, abs=len(e.breakdown))
    _, e = _estimate("mixtral-8x7b", world=8, ep=8, seq=4096, micro=1)
    assert e.peak_phase == "forward/backward"


def test_cpu_mode_is_fp32_with_process_baseline():
    _, e = _estimate("tiny-mixtral", world=2, ep=2, seq=128, micro=2, gpu=CPU, device="cpu")
    spec = models.resolve_model("tiny-mixtral").spec
    assert e.breakdown["gradientsBytes"] == pytest.approx(4 * spec.counts().total / 2, rel=1e-6)
    assert e.breakdown["overheadBytes"] >= memory.CPU_BASELINE_BYTES


def test_explain_is_a_readable_table():
    _, e = _estimate()
    text = e.explain(H200.memory_bytes)
    for term in (
        "parameters",
        "gradients",
        "optimizer",
        "gatheredParameters",
        "activations",
        "moeDispatch",
        "buffers",
        "overhead",
        "total (peak)",
    ):
        assert term in text
    assert "140.40 GiB" in text and ("fits" in text or "DOES NOT FIT" in text)
    assert sum(e.breakdown.values()) == pytest.approx(e.total, abs=len(e.breakdown))


def test_benchmark_estimate_is_exposed():
    gpu = memory.benchmark_estimate()
    cpu = memory.benchmark_estimate(device="cpu")
    assert gpu.fits(H200.memory_bytes)
    assert 5 * GiB < gpu.total < 40 * GiB
    assert cpu.breakdown["optimizerBytes"] == gpu.breakdown["optimizerBytes"]  # 12 B/param both
    assert cpu.breakdown["gradientsBytes"] == 2 * gpu.breakdown["gradientsBytes"]  # fp32 vs bf16


def test_one_rank_gradient_handoff_keeps_one_gradient_not_all():
    """With the trainer's one-rank hand-off (fusedOptimizer, ZeRO-3) a 16-bit gradient lives only
    until it is copied into its partition, and the reduce bucket it no longer uses is freed: the
    gradients term is the partitions plus the largest tensor's gradient, and no bucket (DeepSpeed's
    path holds the bucket and concatenates it to reduce). More than one rank, or optimizer
    offload, keep DeepSpeed's reduce path."""
    spec, stock = _estimate("bench-mixtral-3b", world=1, ep=1, seq=2048, micro=8, autoep=False)
    _, lean = _estimate(
        "bench-mixtral-3b", world=1, ep=1, seq=2048, micro=8, autoep=False, grad_handoff=True
    )
    largest, total = max(memory._param_tensors(spec, 1)), spec.counts().total
    bucket = spec.hidden_size**2  # deepspeed_config's reduce_bucket_size (h*h)
    assert stock.breakdown["gradientsBytes"] == pytest.approx(2 * total, rel=1e-6)
    assert stock.breakdown["buffersBytes"] == 2 * (2 * bucket)  # bucket + its concatenation
    assert lean.breakdown["gradientsBytes"] == pytest.approx(2 * total + 2 * largest, rel=1e-6)
    assert lean.breakdown["buffersBytes"] == 0
    assert lean.total - stock.total == pytest.approx(
        1.1 * (2 * largest - 4 * bucket), rel=1e-3
    )  # + fragmentation
    _, all_in_one = _estimate(
        "bench-mixtral-3b",
        world=1,
        ep=1,
        seq=2048,
        micro=8,
        autoep=False,
        overrides={"zero_optimization": {"reduce_bucket_size": total}},
    )
    assert all_in_one.breakdown["buffersBytes"] == 2 * (2 * total)  # bucket + its concatenation
    _, two = _estimate("bench-mixtral-3b", world=2, ep=1, seq=2048, autoep=False, grad_handoff=True)
    _, two_stock = _estimate("bench-mixtral-3b", world=2, ep=1, seq=2048, autoep=False)
    assert two.total == two_stock.total
    z3 = {"zero_optimization": {"stage": 3}}
    assert memory.grad_handoff_applies(z3, {"fusedOptimizer": True})
    assert not memory.grad_handoff_applies(z3, {"fusedOptimizer": False})
    assert not memory.grad_handoff_applies(z3, None)
    assert not memory.grad_handoff_applies(
        {"zero_optimization": {"stage": 2}}, {"fusedOptimizer": True}
    )
    off = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert not memory.grad_handoff_applies(off, {"fusedOptimizer": True})


def test_fp32_gradient_accumulation_counts_4_bytes_and_drops_the_step_copy():
    """``data_types.grad_accum_dtype: fp32``: the gradient partitions are 4 B per element; with the
    trainer's lean step the optimizer's fp32 gradients are those partitions (no 4 B copy at the
    step), without it DeepSpeed still copies each sub-group."""
    fp32 = {"data_types": {"grad_accum_dtype": "fp32"}}
    kw = dict(world=1, ep=1, seq=2048, micro=8, autoep=False, overrides=fp32)
    spec, lean = _estimate("bench-mixtral-3b", grad_handoff=True, **kw)
    _, stock = _estimate("bench-mixtral-3b", **kw)
    total, largest = spec.counts().total, max(memory._param_tensors(spec, 1))
    assert lean.breakdown["gradientsBytes"] == pytest.approx(4 * total + 2 * largest, rel=1e-6)
    assert stock.breakdown["gradientsBytes"] == pytest.approx(4 * total, rel=1e-6)
    assert memory.grad_accum_bytes(fp32) == 4
    assert memory.grad_accum_bytes({"bf16": {"enabled": True}}) == 2
    assert memory.grad_accum_bytes({"data_types": {"grad_accum_dtype": "bf16"}}) == 2
    # the step phase: a model whose optimizer step is the peak (tiny activations)
    step = dict(world=1, ep=1, seq=16, micro=1, autoep=False)
    _, s_lean = _estimate("bench-mixtral-3b", grad_handoff=True, overrides=fp32, **step)
    _, s_bf16 = _estimate("bench-mixtral-3b", grad_handoff=True, **step)
    assert s_lean.peak_phase == s_bf16.peak_phase == "optimizer step"
    sub_group = 1_000_000_000  # deepspeed_config's sub_group_size
    # fp32 partitions: +2 B per element, and no 4 B fp32 copy of a sub-group
    assert s_lean.total - s_bf16.total == pytest.approx(1.1 * (2 * total - 4 * sub_group), rel=1e-3)


def test_one_rank_parameters_are_their_partitions():
    """On one rank ZeRO-3 hands out a parameter as a view of its partition
    (``_no_gather_coalesced``): no persistent copies, nothing gathered. On two ranks both count."""
    spec, one = _estimate("bench-mixtral-3b", world=1, ep=1, seq=2048, micro=8, autoep=False)
    _, two = _estimate("bench-mixtral-3b", world=2, ep=1, seq=2048, micro=8, autoep=False)
    total = spec.counts().total
    assert one.breakdown["parametersBytes"] == pytest.approx(2 * total, rel=1e-6)
    assert one.breakdown["gatheredParametersBytes"] == 0
    assert two.breakdown["parametersBytes"] > 2 * total / 2
    assert two.breakdown["gatheredParametersBytes"] > 0


def test_compiled_layers_save_fewer_activations():
    """compileLayers: the non-logit activations scale by COMPILED_ACTIVATION_FACTOR instead of
    ACTIVATION_FACTOR; the fused loss's buffers do not change."""
    kw = dict(world=1, ep=1, seq=2048, micro=8, autoep=False, fused_loss_chunk=8192)
    _, eager = _estimate("bench-mixtral-3b", **kw)
    _, compiled = _estimate("bench-mixtral-3b", compiled_layers=True, **kw)
    spec = models.resolve_model("bench-mixtral-3b").spec
    logits = memory.fused_loss_bytes(spec, 2048 * 8, 8192, 2)
    a_eager = eager.breakdown["activationsBytes"] - logits
    a_compiled = compiled.breakdown["activationsBytes"] - logits
    ratio = memory.COMPILED_ACTIVATION_FACTOR / memory.ACTIVATION_FACTOR
    assert a_compiled == pytest.approx(ratio * a_eager, rel=1e-6)
    assert compiled.total < eager.total


def test_loading_a_pretrained_checkpoint_is_counted():
    """model.path: partitions + (AutoEP) one MoE layer's experts whole and the rank's local copy;
    where that exceeds the training peak (here: a huge expert layer on many GPUs) the estimate's
    peak is the loading, and the terms still add up."""
    spec, plain = _estimate(world=8, ep=8)
    _, loaded = _estimate(world=8, ep=8, pretrained=True)
    load = memory.loading_bytes(
        spec,
        {"bf16": {"enabled": True}, "expert_parallel": {"enabled": True}},
        world_size=8,
        ep_size=8,
    )
    experts = spec.moe_layer_expert_params()
    assert load.autoep_layer == int(2 * (experts + experts / 8))
    assert load.partitions == int(2 * spec.counts().total / 8)
    assert loaded.breakdown["loadingExtraBytes"] == 0  # Mixtral-8x7B: training dominates
    assert loaded.total == plain.total and "loading model.path" in loaded.notes[-1]
    # two layers of 256 wide experts on 256 GPUs: a gathered expert layer (~90 GB) outweighs
    # each GPU's training states
    cfg = models.preset_hf_config("mixtral-8x7b") | {
        "num_local_experts": 256,
        "num_hidden_layers": 2,
    }
    wide = models.spec_from_hf_config(cfg)
    ds, _ = deepspeed_config(wide, world_size=256, ep_size=256, global_batch=256, gpu=H200)
    big = memory.estimate_memory(
        wide, ds, world_size=256, ep_size=256, seq_len=1024, micro_batch=1, pretrained=True
    )
    assert big.peak_phase == "loading" and big.breakdown["loadingExtraBytes"] > 0
    assert sum(big.breakdown.values()) == big.total
    _, no_ep = _estimate("deepseek-v3", world=256, ep=1, seq=1024, autoep=False, pretrained=True)
    assert no_ep.breakdown["loadingExtraBytes"] == 0  # without AutoEP nothing is gathered whole
