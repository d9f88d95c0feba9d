"""DeepSpeed config rules, refusals, and acceptance by DeepSpeed 0.19.8's own parser."""

import pytest

from moejob_operator.core import dsconfig, models
from moejob_operator.core.dsconfig import CPU, GpuCaps, deepspeed_config
from moejob_operator.core.errors import DocumentError

H200 = GpuCaps("NVIDIA H200", 150754820096, "9.0")
V100 = GpuCaps("Tesla V100-SXM2-32GB", 34359738368, "7.0")
TINY = models.resolve_model("tiny-mixtral").spec


def test_zero3_autoep_on_h200():
    spec = models.resolve_model("mixtral-8x7b").spec
    cfg, warnings = deepspeed_config(
        spec, world_size=16, ep_size=8, global_batch=256, micro_batch=2, gpu=H200
    )
    h = 4096
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (h * h, int(0.9 * h * h), 10 * h)
    assert (
        cfg["train_batch_size"],
        cfg["train_micro_batch_size_per_gpu"],
        cfg["gradient_accumulation_steps"],
    ) == (256, 2, 8)
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["expert_parallel"] == {"enabled": True, "autoep_size": 8, "preset_model": "mixtral"}
    assert cfg["gradient_clipping"] == 1.0
    assert warnings == []


@pytest.mark.parametrize(
    ("name", "preset"), [("qwen3-30b-a3b", "qwen3_moe"), ("deepseek-v3", "deepseek_v3")]
)
def test_autoep_preset_per_family(name, preset):
    spec = models.resolve_model(name).spec
    cfg, _ = deepspeed_config(spec, world_size=8, ep_size=8, global_batch=8, gpu=H200)
    assert cfg["expert_parallel"]["preset_model"] == preset


def test_precision_follows_the_hardware():
    cfg, _ = deepspeed_config(TINY, world_size=2, ep_size=2, global_batch=4, gpu=V100)
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0 and "bf16" not in cfg
    cfg, _ = deepspeed_config(TINY, world_size=2, ep_size=2, global_batch=4, gpu=CPU)
    assert "fp16" not in cfg and "bf16" not in cfg


def test_optimizer_blocks_only_on_request():
    cfg, _ = deepspeed_config(TINY, world_size=2, ep_size=2, global_batch=4, gpu=CPU)
    assert "optimizer" not in cfg and "scheduler" not in cfg  # the trainer builds its own
    cfg, _ = deepspeed_config(
        TINY,
        world_size=2,
        ep_size=2,
        global_batch=4,
        gpu=CPU,
        lr=3e-4,
        warmup_steps=5,
        include_optimizer=True,
    )
    assert cfg["optimizer"]["params"]["torch_adam"] is True  # FusedAdam needs CUDA
    assert cfg["optimizer"]["params"]["lr"] == 3e-4
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 5
    cfg, _ = deepspeed_config(
        TINY, world_size=2, ep_size=2, global_batch=4, gpu=H200, include_optimizer=True
    )
    assert cfg["optimizer"]["params"]["torch_adam"] is False and "scheduler" not in cfg
    assert GpuCaps("A100", 1, "8.0").supports_bf16 and not GpuCaps("T4", 1, "7.5").supports_bf16


def test_batch_sizes():
    assert dsconfig.batch_sizes(world_size=4, global_batch=64, micro_batch=None) == (16, 1)
    assert dsconfig.batch_sizes(world_size=4, global_batch=128, micro_batch=None) == (16, 2)
    assert dsconfig.batch_sizes(world_size=3, global_batch=9, micro_batch=None) == (3, 1)
    with pytest.raises(
        DocumentError,
        match=r"globalBatch: 10 is not divisible by the "
        r"data-parallel size 4",
    ):
        dsconfig.batch_sizes(world_size=4, global_batch=10, micro_batch=None)
    with pytest.raises(DocumentError, match=r"microBatch: 3 does not divide the per-rank batch 8"):
        dsconfig.batch_sizes(world_size=2, global_batch=16, micro_batch=3)


def test_no_autoep_falls_back_to_plain_zero3():
    cfg, _ = deepspeed_config(TINY, world_size=2, ep_size=1, global_batch=2, autoep=False)
    assert "expert_parallel" not in cfg and cfg["zero_optimization"]["stage"] == 3
    with pytest.raises(DocumentError, match=r"epSize: 2 needs AutoEP"):
        deepspeed_config(TINY, world_size=2, ep_size=2, global_batch=2, autoep=False)


def test_ep_size_must_divide_experts_and_world():
    with pytest.raises(DocumentError, match=r"epSize: 3 does not divide numExperts 8"):
        deepspeed_config(TINY, world_size=3, ep_size=3, global_batch=3)
    with pytest.raises(DocumentError, match=r"epSize: 4 does not divide worldSize 6"):
        deepspeed_config(TINY, world_size=6, ep_size=4, global_batch=6)


def test_choose_ep_size_keeps_groups_inside_nvlink():
    assert dsconfig.choose_ep_size([8, 8], num_experts=8, world_size=16) == 8
    assert dsconfig.choose_ep_size([8], num_experts=128, world_size=8) == 8
    assert dsconfig.choose_ep_size([4, 4], num_experts=8, world_size=8) == 4
    assert dsconfig.choose_ep_size([2, 2, 2, 2], num_experts=8, world_size=8) == 2
    assert dsconfig.choose_ep_size([1, 1, 1, 1], num_experts=8, world_size=4) == 1  # no NVLink
    assert dsconfig.choose_ep_size([6], num_experts=8, world_size=6) == 2
    with pytest.raises(DocumentError, match="worldSize: 5 ranks"):
        dsconfig.choose_ep_size([4], num_experts=8, world_size=5)


def test_overrides_merge_deep_and_warn():
    cfg, warnings = deepspeed_config(
        TINY,
        world_size=2,
        ep_size=2,
        global_batch=4,
        gpu=H200,
        overrides={
            "zero_optimization": {"reduce_bucket_size": 5_000_000_000},
            "steps_per_print": 1,
        },
    )
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 5_000_000_000
    assert cfg["zero_optimization"]["stage"] == 3  # siblings kept
    assert cfg["steps_per_print"] == 1
    assert any("reduce_bucket_size" in w and "elements, not bytes" in w for w in warnings)

    _, warnings = deepspeed_config(
        TINY,
        world_size=2,
        ep_size=2,
        global_batch=4,
        gpu=H200,
        overrides={"bf16": {"enabled": False}},
    )
    assert any("bf16 is off on NVIDIA H200" in w for w in warnings)
    _, warnings = deepspeed_config(
        TINY,
        world_size=2,
        ep_size=2,
        global_batch=4,
        gpu=H200,
        overrides={"zero_optimization": {"stage": 2}},
    )
    assert any("stage 2 with AutoEP works" in w for w in warnings)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"zero_optimization": {"zero_hpz_partition_size": 8}}, r"zero_hpz_partition_size: 8"),
        ({"zero_optimization": {"zero_quantized_gradients": True}}, r"zero_quantized_gradients"),
        ({"sequence_parallel_size": 2}, r"sequence_parallel_size: 2"),
        (
            {"expert_parallel": {"expert_tensor_parallel_size": 2}},
            r"expert_tensor_parallel_size: 2",
        ),
        (
            {"expert_parallel": {"autoep_size": 4}},
            r"autoep_size: 4 differs from the plan's epSize 2",
        ),
        ({"zero_optimization": {"mics_shard_size": 8}}, r"MiCS was removed"),
        ({"train_batch_size": 6}, r"train_batch_size: 6 != train_micro_batch_size_per_gpu 2"),
        ({"fp16": {"enabled": True}}, r"both true"),
        ({"zero_optimization": {"stage": 4}}, r"stage: 4 is not 0, 1, 2 or 3"),
    ],
)
def test_refused_overrides(override, match):
    with pytest.raises(DocumentError, match=match):
        deepspeed_config(
            TINY, world_size=2, ep_size=2, global_batch=4, gpu=H200, overrides=override
        )


def test_refusals_outside_overrides():
    with pytest.raises(DocumentError, match=r"native MoE layer"):
        deepspeed_config(TINY, world_size=2, ep_size=1, global_batch=2, native_moe=True)
    cfg, warnings = deepspeed_config(
        TINY,
        world_size=2,
        ep_size=1,
        global_batch=2,
        native_moe=True,
        overrides={"zero_optimization": {"stage": 2}},
    )
    assert "expert_parallel" not in cfg and any("targets stage 3" in w for w in warnings)
    with pytest.raises(DocumentError, match=r"V100.*has no bf16"):
        deepspeed_config(
            TINY,
            world_size=2,
            ep_size=2,
            global_batch=2,
            gpu=V100,
            overrides={"bf16": {"enabled": True}, "fp16": {"enabled": False}},
        )


@pytest.mark.parametrize(
    "name", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3", "deepseek-v3"]
)
@pytest.mark.parametrize("gpu", [CPU, H200, V100], ids=["cpu", "h200", "v100"])
def test_deepspeed_accepts_the_config(name, gpu, monkeypatch):
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    spec = models.resolve_model(name).spec
    # world size 1, as DeepSpeedConfig sees it without torch.distributed
    cfg, _ = deepspeed_config(
        spec,
        world_size=1,
        ep_size=1,
        global_batch=4,
        gpu=gpu,
        warmup_steps=2,
        include_optimizer=True,
    )
    parsed = ds_config.DeepSpeedConfig(cfg)
    assert parsed.optimizer_name == "adamw" and parsed.scheduler_name == "WarmupLR"
    assert parsed.zero_optimization_stage == 3 and parsed.gradient_accumulation_steps == 1
    assert parsed.expert_parallel_config.enabled
    assert parsed.bfloat16_config.enabled == gpu.supports_bf16
    # a larger world: DeepSpeed reads the DP size from torch.distributed
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: 8)
    cfg, _ = deepspeed_config(
        spec, world_size=8, ep_size=8, global_batch=64, micro_batch=4, gpu=gpu
    )
    parsed = ds_config.DeepSpeedConfig(cfg)
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (64, 2)
    assert parsed.expert_parallel_config.autoep_size == 8
    assert parsed.zero_config.prefetch_bucket_size == int(0.9 * spec.hidden_size**2)


@pytest.mark.parametrize("name", ["tiny-mixtral", "qwen3-235b-a22b", "deepseek-v3"])
def test_deepspeed_autoep_validation_accepts_the_block(name):
    auto_ep = pytest.importorskip("deepspeed.module_inject.auto_ep_config")
    spec = models.resolve_model(name).spec
    cfg, _ = deepspeed_config(spec, world_size=16, ep_size=8, global_batch=16, gpu=H200)
    parsed = auto_ep.parse_autoep_config(cfg["expert_parallel"])
    auto_ep.validate_autoep_config(parsed, 16, 1, 1, 1, zero_stage=3)
    assert parsed.preset_model in auto_ep.PRESET_MODELS
