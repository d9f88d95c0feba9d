"""The plans the upgrade gate's smoke run trains: real ``build_plan`` output for small models.

A smoke test that passes while real jobs fail tests the wrong thing. So the smoke run does not
write its own DeepSpeed config: the operator renders, with the same :func:`.plan.build_plan` that
plans every job, one ``MoEPlan`` per *case* and hands them to `moe-smoke` as a ``SmokePlans``
document (docs/contracts.md), mounted like a job's plan. A DeepSpeed release that rejects a key the
planner emits therefore fails the gate exactly as it would fail every job.

The cases cover what real jobs run (docs/gate.md has the table):

* the families with a ``smoke_config`` (``core.families``: Mixtral, Qwen3-MoE, DeepSeek-V3),
* a model big enough that ZeRO-3 partitions most parameters: with the planner's
  ``stage3_param_persistence_threshold = 10 h`` every tensor of ``>= 10 h`` elements is
  partitioned, so the router (``E x h``, 16 experts) and all projections are; only norms stay
  persistent,
* gradient accumulation 2, the per-layer balancing loss, activation checkpointing in one case,
* on CPU (2 ranks) EP = world in two cases and EP 1 < world in one, so that AutoEP's
  expert-data-parallel gradient reduction runs; on one GPU every case has world = EP = 1,
* on one GPU both paths a job can take: the planner's fast settings (:mod:`.perf`: grouped
  block, compiled decoder layers, every parameter persistent) in the Mixtral case, and the stock
  configuration (AutoEP, partitioned ZeRO-3) in the others, since on one GPU the fast settings
  keep every parameter whole and would leave ZeRO-3's partitioning untested.

The placement is the planner's ``round_robin`` (no routing statistics needed, and unlike
``contiguous`` it moves experts between EP ranks, so a misplaced expert is visible).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import families
from .dsconfig import CPU, GpuCaps
from .errors import DocumentError
from .models import ResolvedModel, spec_from_hf_config
from .plan import PlanRequest, TrainingOptions, build_plan
from .topology import ClusterTopology

SMOKE_PLANS_KIND, SMOKE_PLANS_VERSION = "SmokePlans", 1
SMOKE_NAMESPACE, SMOKE_JOB = "moe-smoke", "smoke"

# Shared dims: the tiny models' (``families.TINY``: hidden 64, byte vocabulary padded to 320) with
# 2 layers and 256 positions; 16 experts top-2 (router 16 x 64 = 1024 elements >= 10 h = 640, so
# ZeRO-3 partitions it).
_COMMON = dict(families.TINY, num_hidden_layers=2, max_position_embeddings=256)
# The small model of each family the gate covers (``FamilySpec.smoke_config``).
SMOKE_HF_CONFIGS: dict[str, dict[str, Any]] = {
    f.name: dict(_COMMON, **f.smoke_config)
    for f in families.REGISTRY.values()
    if f.smoke_config is not None
}


@dataclass(frozen=True)
class SmokeCase:
    """One plan of the smoke run. ``ep_size`` None: the planner's choice (= world on CPU).
    ``performance``: let the planner pick its fast settings, as for a job (GPU plans only)."""

    name: str
    family: str
    ep_size: int | None = None
    activation_checkpointing: bool = False
    performance: bool = True


# CPU: 2 gloo ranks. The Qwen3 case has EP 1 < world 2: experts are ZeRO-partitioned over the
# expert-data-parallel group and their gradients reduced there.
CPU_CASES = (
    SmokeCase("mixtral", "mixtral"),
    SmokeCase("qwen3-moe-edp", "qwen3_moe", ep_size=1, activation_checkpointing=True),
    SmokeCase("deepseek-v3", "deepseek_v3"),
)
# One GPU: world = EP = 1 (the expert-data-parallel reduction is covered by the CPU verdict).
GPU_CASES = (
    SmokeCase("mixtral", "mixtral"),
    SmokeCase("qwen3-moe", "qwen3_moe", activation_checkpointing=True, performance=False),
    SmokeCase("deepseek-v3", "deepseek_v3", performance=False),
)
CPU_WORLD = 2
SEQ_LEN, MICRO_BATCH, GRAD_ACCUM = 32, 2, 2
TRAIN_STEPS = 5
SEED = 1234


def smoke_training(
    steps: int = TRAIN_STEPS, activation_checkpointing: bool = False, seed: int = SEED
) -> TrainingOptions:
    """The training block: warmup 2, per-layer balancing loss, checkpoint at the last step;
    clipping at 0.5, below these models' gradient norms at every step (about 2), so the numeric
    check sees clipping act."""
    return TrainingOptions(
        steps=steps,
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every_steps=steps,
        seed=seed,
        grad_clip=0.5,
        activation_checkpointing=activation_checkpointing,
        balance_mode="per_layer_aux",
        balance_coef=0.05,
        data={"kind": "synthetic"},
    )


def _gpu_topology(gpu: GpuCaps) -> ClusterTopology:
    import numpy as np

    return ClusterTopology(
        nodes=("smoke-node",),
        gpus=(("smoke-node", 0),),
        node_of=np.zeros(1, int),
        group_of=np.zeros(1, int),
        nvlink_gbps=np.zeros(1),
        memory_bytes=(gpu.memory_bytes,) if gpu.memory_bytes else (),
    )


def smoke_plan(
    case: SmokeCase,
    *,
    device: str,
    gpu: GpuCaps | None = None,
    steps: int = TRAIN_STEPS,
    seed: int = SEED,
) -> dict[str, Any]:
    """The MoEPlan v1 document of one case, from :func:`build_plan`."""
    if case.family not in SMOKE_HF_CONFIGS:
        raise DocumentError(
            f"smoke case {case.name}: family {case.family!r} is not one of "
            f"{tuple(SMOKE_HF_CONFIGS)}"
        )
    hf = dict(SMOKE_HF_CONFIGS[case.family])
    model = ResolvedModel(
        spec=spec_from_hf_config(hf, f"smoke {case.family}"),
        hf_config=hf,
        preset=f"smoke-{case.family.replace('_', '-')}",
        path=None,
    )
    training = smoke_training(steps, case.activation_checkpointing, seed)
    if device == "cpu":
        world = CPU_WORLD
        plan = build_plan(
            PlanRequest(
                SMOKE_JOB,
                SMOKE_NAMESPACE,
                model,
                None,
                device="cpu",
                nodes=["localhost"],
                procs_per_node=world,
                strategy="round_robin",
                ep_size=case.ep_size,
                global_batch=MICRO_BATCH * GRAD_ACCUM * world,
                micro_batch=MICRO_BATCH,
                seq_len=SEQ_LEN,
                training=training,
            )
        )
    elif device == "cuda":
        caps = gpu or GpuCaps("gpu", 0, "8.0")
        plan = build_plan(
            PlanRequest(
                SMOKE_JOB,
                SMOKE_NAMESPACE,
                model,
                _gpu_topology(caps),
                gpu=caps,
                strategy="round_robin",
                ep_size=case.ep_size,
                global_batch=MICRO_BATCH * GRAD_ACCUM,
                micro_batch=MICRO_BATCH,
                seq_len=SEQ_LEN,
                training=training,
                performance=case.performance,
            )
        )
    else:
        raise DocumentError(f"device: {device!r} is not 'cpu' or 'cuda'")
    return plan.document


def smoke_plans(
    device: str,
    gpu: GpuCaps | None = None,
    *,
    steps: int = TRAIN_STEPS,
    cases: tuple[SmokeCase, ...] | None = None,
    seed: int = SEED,
) -> dict[str, Any]:
    """The ``SmokePlans`` v1 document: ``{"kind", "version", "device", "cases": [{"name",
    "plan"}]}``.

    ``gpu``: the capabilities of the GPU model the verdict is for (bf16 on compute capability
    >= 8.0, fp16 below, as for a job); None on CPU.
    """
    cases = cases or (CPU_CASES if device == "cpu" else GPU_CASES)
    return {
        "kind": SMOKE_PLANS_KIND,
        "version": SMOKE_PLANS_VERSION,
        "device": device,
        "cases": [
            {
                "name": c.name,
                "plan": smoke_plan(
                    c, device=device, gpu=gpu if device == "cuda" else CPU, steps=steps, seed=seed
                ),
            }
            for c in cases
        ],
    }
