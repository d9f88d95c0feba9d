"""Predicted step time of a plan: device work, host work and communication.

One optimizer step on one rank. The GPU runs what the host launches asynchronously, so the step
takes the longer of the two, plus the communication that nothing hides:

    step = max(device, host) + communication

* device: the model FLOPs the rank runs (:func:`model_flops_per_token`, x 4/3 with activation
  checkpointing: the forward runs twice) over the measured peak matmul rate of the GPU, times
  ``compute`` (1 / the efficiency the kernels reach); plus the optimizer step over the elements
  of the rank's partition, times ``optimizer_fused`` (torch's fused AdamW, the planner's choice)
  or ``optimizer_unfused`` (DeepSpeed's step): memory bound;
* host: ``host_step`` once per optimizer step (the step's own launches and bookkeeping: loss,
  clipping, optimizer, scheduler); decoder layers x micro-steps, times ``host_compiled``
  (compiled layers, ZeRO-3 leaf modules: the planner's path at EP size 1) or ``host_eager`` (HF
  blocks and AutoEP: hooks per submodule, one launch per op); the parameter tensors ZeRO-3
  fetches and releases per step (those above ``stage3_param_persistence_threshold``, forward and
  backward), times ``fetch`` (hook work and, on several ranks, one all-gather's latency each);
* communication: the all-to-all seconds of the cost model (:mod:`.cost`, the link tiers' nominal
  bandwidth) and the ZeRO-3 gathers and reduce-scatters not hidden behind compute, times
  ``link`` (measured over nominal collective time).

The coefficients are not set by hand: ``benchmarks/sizing_calibrate.py`` fits them to measured
H200 runs (``benchmarks/results``) and writes ``fixtures/throughput_h200.json`` with the runs it
fitted on, the runs it held out and the errors on both (docs/planning.md, "Sizing"). On another
GPU model the compute term scales with its datasheet bf16 rate and the optimizer term with its
memory bandwidth relative to the calibrated GPU (:data:`DATASHEET`); the prediction then says it
is not calibrated there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .memory import _param_tensors
from .models import MoEModelSpec

CALIBRATION_FILE = Path(__file__).parent / "fixtures" / "throughput_h200.json"
# Dense bf16 tensor rate (TFLOP/s) and memory bandwidth (TB/s) from the vendors' datasheets, by a
# substring of the NVML product name; only ratios to the calibrated GPU are used.
DATASHEET = {
    "H200": (989.5, 4.8),
    "H100": (989.5, 3.35),
    "A100": (312.0, 2.0),
    "V100": (125.0, 0.9),
}
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold


@dataclass(frozen=True)
class Coefficients:
    """Seconds per unit of each term's count (module docstring)."""

    compute: float
    host_step: float
    host_compiled: float
    host_eager: float
    optimizer_fused: float
    optimizer_unfused: float
    fetch: float
    link: float

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(Coefficients.__dataclass_fields__)


@dataclass(frozen=True)
class Calibration:
    """Fitted coefficients for one GPU model, with where they came from."""

    gpu: str
    peak_tflops: float  # measured bf16 matmul rate on that GPU (the runs' own measurement)
    coefficients: Coefficients
    source: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "peakTflops": self.peak_tflops,
            "coefficients": asdict(self.coefficients),
            "source": self.source,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Calibration:
        return cls(
            str(doc["gpu"]),
            float(doc["peakTflops"]),
            Coefficients(**{k: float(v) for k, v in doc["coefficients"].items()}),
            dict(doc.get("source") or {}),
        )


@lru_cache(maxsize=1)
def load_calibration(path: str = str(CALIBRATION_FILE)) -> Calibration:
    """The shipped calibration (written by ``benchmarks/sizing_calibrate.py``)."""
    return Calibration.from_json(json.loads(Path(path).read_text()))


def model_flops_per_token(spec: MoEModelSpec, seq_len: int) -> float:
    """Model FLOPs per trained token, forward + backward: 6 x the matmul parameters one token
    uses (attention, router, its top-k experts, shared experts and dense MLPs, the LM head; not
    the input embedding, a lookup) + causal attention's scores, 6 x layers x seq x q width."""
    counts = spec.counts()
    matmul = counts.active_no_embedding
    if spec.mla is not None:
        m = spec.mla
        qk_v = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
        q_width = spec.num_attention_heads * qk_v // 2  # QK^T and AV widths, averaged
    else:
        q_width = spec.num_attention_heads * spec.head_dim
    return float(6 * matmul + 6 * spec.num_layers * seq_len * q_width)


@dataclass(frozen=True)
class Workload:
    """What one rank does in one optimizer step, in the counts the terms scale with."""

    flops: float  # model FLOPs on this rank, recompute included
    layer_passes: int  # decoder layers x micro-steps
    compiled: bool  # compiled decoder layers + ZeRO-3 leaf modules (else HF/AutoEP blocks)
    optimizer_elements: float  # elements of the rank's optimizer partition
    fused_optimizer: bool
    fetches: int  # parameter tensors fetched per step (forward + backward, every micro-step)
    all_to_all_seconds: float  # at nominal link bandwidth, forward + backward
    zero_comm_seconds: float  # ZeRO-3 gathers + reduce-scatters at nominal bandwidth
    tokens_per_step: int  # over all ranks

    def counts(self, peak_flops: float, compute: float) -> dict[str, float]:
        """The multiplier of each coefficient (``step = sum(coef * count)``): the compute count
        is the seconds the FLOPs take at ``peak_flops``; the exposed part of the ZeRO-3 traffic
        depends on the compute time (``compute``: the compute coefficient)."""
        at_peak = self.flops / peak_flops
        exposed = max(0.0, self.zero_comm_seconds - compute * at_peak)
        return {
            "compute": at_peak,
            "host_step": 1.0,
            "host_compiled": self.layer_passes if self.compiled else 0.0,
            "host_eager": 0.0 if self.compiled else self.layer_passes,
            "optimizer_fused": self.optimizer_elements if self.fused_optimizer else 0.0,
            "optimizer_unfused": 0.0 if self.fused_optimizer else self.optimizer_elements,
            "fetch": float(self.fetches),
            "link": self.all_to_all_seconds + exposed,
        }


def workload(
    spec: MoEModelSpec,
    *,
    seq_len: int,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    ep_size: int,
    autoep: bool,
    activation_checkpointing: bool,
    compiled: bool,
    fused_optimizer: bool,
    persistence_threshold: int,
    bytes_per_elem: int,
    all_to_all_seconds: float = 0.0,
    data_parallel_gbps: float = 0.0,
) -> Workload:
    """The counts of one plan. ``all_to_all_seconds``: the cost model's MoE all-to-all time per
    step (forward + backward) at nominal bandwidth; ``data_parallel_gbps``: the slowest link the
    ZeRO-3 collectives of all ranks cross (GB/s per GPU; 0 on one rank)."""
    tokens_rank = micro_batch * seq_len * grad_accum
    flops = tokens_rank * model_flops_per_token(spec, seq_len)
    if activation_checkpointing:
        flops *= 4 / 3
    ep = ep_size if autoep else 1
    tensors = _param_tensors(spec, ep)
    fetched = [n for n in tensors if n > persistence_threshold]
    # with leaf modules one fetch per decoder layer (+ embedding / LM head), else per tensor
    per_pass = min(len(fetched), spec.num_layers + 2) if compiled else len(fetched)
    counts = spec.counts()
    zero_s = 0.0
    if world_size > 1 and data_parallel_gbps > 0:
        # per micro-step: gathers forward and backward (non-persistent), a reduce-scatter of every
        # gradient; dense parameters over all ranks, experts over the expert-data-parallel group
        dense, expert = counts.dense, counts.expert
        edp = world_size // ep
        gathered = sum(fetched) / max(sum(tensors), 1)  # share of elements that are fetched
        ring_dense = dense * (world_size - 1) / world_size
        ring_expert = (expert / ep) * (edp - 1) / edp if edp > 1 else 0.0
        elements = ring_dense + ring_expert
        per_micro = bytes_per_elem * elements * (2 * gathered + 1)
        zero_s = grad_accum * per_micro / (data_parallel_gbps * 1e9)
    return Workload(
        flops=flops,
        layer_passes=spec.num_layers * grad_accum,
        compiled=compiled,
        optimizer_elements=counts.total / world_size,
        fused_optimizer=fused_optimizer,
        fetches=2 * per_pass * grad_accum,
        all_to_all_seconds=all_to_all_seconds,
        zero_comm_seconds=zero_s,
        tokens_per_step=micro_batch * seq_len * grad_accum * world_size,
    )


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds per optimizer step by term (``device``/``host`` overlap: the longer one
    counts), and whether the GPU is the calibrated one."""

    terms: dict[str, float]  # compute, optimizer (device); layers, fetch (host); communication
    tokens_per_step: int
    calibrated: bool
    gpu: str

    @property
    def device(self) -> float:
        return self.terms["compute"] + self.terms["optimizer"]

    @property
    def host(self) -> float:
        return self.terms["layers"] + self.terms["fetch"]

    @property
    def bound(self) -> str:
        return "device" if self.device >= self.host else "host"

    @property
    def seconds(self) -> float:
        return max(self.device, self.host) + self.terms["communication"]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.seconds if self.seconds > 0 else 0.0


def _datasheet(gpu: str) -> tuple[float, float] | None:
    for key, value in DATASHEET.items():
        if key in gpu:
            return value
    return None


def step_terms(n: dict[str, float], c: Coefficients, memory_scale: float = 1.0) -> dict[str, float]:
    """Seconds per term from the counts of :meth:`Workload.counts`."""
    return {
        "compute": c.compute * n["compute"],
        "optimizer": memory_scale
        * (c.optimizer_fused * n["optimizer_fused"] + c.optimizer_unfused * n["optimizer_unfused"]),
        "layers": c.host_step * n["host_step"]
        + c.host_compiled * n["host_compiled"]
        + c.host_eager * n["host_eager"],
        "fetch": c.fetch * n["fetch"],
        "communication": c.link * n["link"],
    }


def predict(w: Workload, gpu: str, cal: Calibration | None = None) -> StepTime:
    """Step time of ``w`` on GPU model ``gpu`` (NVML product name)."""
    cal = cal or load_calibration()
    c = cal.coefficients
    calibrated = cal.gpu in gpu or gpu in cal.gpu
    compute_scale = memory_scale = 1.0
    ref, here = _datasheet(cal.gpu), _datasheet(gpu)
    if not calibrated and ref and here:
        compute_scale, memory_scale = ref[0] / here[0], ref[1] / here[1]
    n = w.counts(cal.peak_tflops * 1e12 / compute_scale, c.compute)
    return StepTime(step_terms(n, c, memory_scale), w.tokens_per_step, calibrated, gpu)
