"""The training loop: plan -> model (placement applied) -> DeepSpeed ZeRO-3 (AutoEP) -> steps.

One optimizer step:
  for each micro step: forward, LM loss + coef * balancing loss (routing.balance_loss),
  backward; then engine.step() (gradient clipping, LR warmup + cosine) and one small all-reduce of
  this step's routing counts plus an all-gather of step times (statistics, health, stragglers).
Every `checkpointEverySteps` steps and at the end: checkpoint + RoutingStats + progress.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from moe_contracts import env as contract_env
from moe_contracts.dispatch import TIERS
from moe_contracts.plan import MoEPlan
from moe_contracts.progress import progress_doc
from moe_contracts.routing import routing_stats_doc
from moe_trainer import capabilities
from moe_trainer import checkpoint as ckpt
from moe_trainer.dispatch import dedup_replicas
from moe_trainer.distenv import DistEnv
from moe_trainer.inputs import data as data_mod
from moe_trainer.model import export, model_setup, models, perf
from moe_trainer.model.placement import check_placement
from moe_trainer.replan import Replanner
from moe_trainer.replan import refusal as replan_refusal
from moe_trainer.telemetry import routing
from moe_trainer.telemetry.commtime import CommTimer
from moe_trainer.telemetry.health import HealthMonitor, fragmentation, memory_peaks
from moe_trainer.telemetry.progress import ConfigMapPublisher, Metrics, write_json_atomic
from moe_trainer.telemetry.routing_publish import RoutingStatsPublisher, RoutingStatsStatus
from moe_trainer.telemetry.token_samples import TokenSampler, samples_doc

log = logging.getLogger("moe_trainer")

EXIT_OK, EXIT_DATAERR, EXIT_RETRYABLE, EXIT_CONFIG = 0, 65, 75, 78
RECENT_STEPS = 20


class NonFiniteLoss(RuntimeError):
    pass


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio` x peak at `total`."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        span = max(1, total - warmup)
        progress = min(1.0, (step - warmup) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def deepspeed_config(plan: MoEPlan) -> dict:
    """The plan's DeepSpeed config, with batch sizes and clipping filled in where it leaves them
    out."""
    cfg = dict(plan.deepspeed)
    t = plan.training
    cfg.setdefault("train_micro_batch_size_per_gpu", t.micro_batch)
    cfg.setdefault("gradient_accumulation_steps", t.grad_accum)
    cfg.setdefault("gradient_clipping", t.grad_clip)
    cfg.setdefault("steps_per_print", 10**9)
    cfg.setdefault("wall_clock_breakdown", False)
    if (
        cfg["train_micro_batch_size_per_gpu"] != t.micro_batch
        or cfg["gradient_accumulation_steps"] != t.grad_accum
    ):
        raise ValueError(
            "deepspeed.train_micro_batch_size_per_gpu/gradient_accumulation_steps differ from "
            f"training.microBatch={t.micro_batch}/gradAccum={t.grad_accum}"
        )
    return cfg


RATE_WINDOW = 10  # steps over which tokens/s and the ETA are measured


class Trainer:
    def __init__(self, plan: MoEPlan, env: DistEnv, ckpt_dir: str | None):
        self.plan, self.env, self.ckpt_dir = plan, env, ckpt_dir
        self.t = plan.training
        self.is_rank0 = env.rank == 0
        self.model_name = plan.model.preset or plan.model.family

    # ---- setup -------------------------------------------------------------------------------
    def initial_model(self):
        """The model as the plan describes it, before any permutation, built and seeded on the
        device the trainer builds on (a GPU draws other random numbers than the CPU for the same
        seed), so a reference built here equals the trained model weight for weight."""
        p = self.plan
        return models.build_model(
            p.model.hf_config,
            p.model.path,
            seed=self.t.seed,
            device=self.env.device if self.env.device.type == "cuda" else None,
        )

    def build(self) -> None:
        import deepspeed

        p, t = self.plan, self.t
        cfg = deepspeed_config(p)
        dispatcher = p.placement.dispatcher if p.placement and p.ep_size > 1 else None
        capabilities.check(cfg, dispatcher)  # before our layers import DeepSpeed's
        restoring = ckpt.latest_step(self.ckpt_dir) is not None  # resume() overwrites weights
        prepared = model_setup.prepare(
            p, cfg, self.env.rank, self.initial_model, restoring=restoring
        )
        model, originals = prepared.model, prepared.originals
        self.permutation, self.load_report = prepared.permutation, prepared.load_report
        self.exporter = export.Exporter(p, self.permutation)
        self.perf = t.performance
        self.num_experts = models.num_experts_of(model)
        self.top_k = models.top_k_of(model)
        self.source = data_mod.make_batch_source(
            t.data, t.seq_len, t.micro_batch, t.seed, model.config.vocab_size
        )
        self.timer = CommTimer().install()
        has_opt = "optimizer" in cfg
        try:
            done = perf.apply_before_initialize(model, self.perf, self.env.device)
        except perf.PerfError as exc:
            raise models.ModelError(str(exc)) from exc
        fused_opt = perf.fused_optimizer_ok(self.perf, self.env.device)
        if fused_opt:
            cfg.setdefault("zero_allow_untested_optimizer", True)
            done.append("fused AdamW")
        if self.is_rank0 and done:
            log.info("performance options: %s", "; ".join(done))

        def make_opt(params):
            return torch.optim.AdamW(
                params,
                lr=t.lr,
                betas=(0.9, 0.95),
                weight_decay=0.0,
                **({"fused": True} if fused_opt else {}),
            )

        def make_sched(opt):
            return torch.optim.lr_scheduler.LambdaLR(
                opt, lr_lambda(t.warmup_steps, t.steps, t.min_lr_ratio)
            )

        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=[q for q in model.parameters() if q.requires_grad],
            optimizer=None if has_opt else make_opt,
            lr_scheduler=None if "scheduler" in cfg else make_sched,
            config=cfg,
        )
        lean = perf.install_zero3_fused_step(self.engine.optimizer) if fused_opt else []
        if self.perf.fused_optimizer:  # these need no fused kernel (CPU too)
            lean += perf.install_single_rank_grads(self.engine.optimizer)
            lean += perf.install_flat_sub_group_grads(self.engine.optimizer)
        if self.is_rank0 and lean:
            log.info("ZeRO-3 step: %s", "; ".join(lean))
        self.blocks = [r.block for r in models.find_moe_layers(self.engine.module)]
        self.dispatcher = self.install_dispatcher()
        self.probe = routing.RouterProbe(self.blocks)
        if self.is_rank0:
            log.info(
                "MoE blocks after initialize: %d x %s (moeImpl=%s, AutoEP=%s, dispatcher=%s)",
                len(self.blocks),
                type(self.blocks[0]).__name__,
                t.moe_impl,
                p.autoep_enabled,
                self.dispatcher,
            )
        if originals is not None:
            check_placement(self.blocks, self.permutation, originals, self.env.rank, self.ckpt_dir)
        L, E = len(self.blocks), self.num_experts
        self.acc = routing.RoutingAccumulator(L, E, self.env.device)
        self.samples = TokenSampler(
            L, self.top_k, t.routing_sample_tokens, t.seed, self.env.rank, self.env.world_size
        )
        self.recent_load: deque = deque(maxlen=RECENT_STEPS)  # load[L, E] per step, original ids
        self.bytes_since_start = {"steps": 0, "byTier": dict.fromkeys(TIERS, 0)}
        self._logged: set[tuple[str, str]] = set()
        self.health = HealthMonitor(
            L,
            E,
            self.env.world_size,
            dead_steps=t.dead_expert_steps,
            dead_fraction=t.dead_expert_fraction,
            router_logit_limit=t.router_logit_limit,
            straggler_factor=t.straggler_factor,
            straggler_steps=t.straggler_steps,
            fragmentation_limit=t.fragmentation_limit,
        )
        self.losses: list[float] = []
        self.on_step = None  # optional fn(step) after each finished step (benchmarks, profiling)
        self.start_step = 0
        self.last_ckpt: dict | None = None
        self.publisher = ConfigMapPublisher.from_env() if self.is_rank0 else None
        self.routing_publisher = RoutingStatsPublisher.from_env() if self.is_rank0 else None
        self._routing_written_step: int | None = None
        self.window = routing.RoutingWindow()  # the RoutingStats `window` (re-planning)
        refused = replan_refusal(p, self.engine)  # not ZeRO-3: updates are refused
        self.replan = Replanner(L, E, refused, prepared.family.router, p)
        port = os.environ.get(contract_env.METRICS_PORT)
        self.metrics = Metrics(int(port), p.job_name) if (port and self.is_rank0) else None

    def rank_tiers(self) -> tuple[list[int], list[int]]:
        """NVLink group and node index of every global rank, from the plan's ranks (a plan without
        ``ranks[].group``: the node is the group; without ranks: every rank its own group)."""
        ranks, world = self.plan.ranks, self.env.world_size
        if not ranks:
            return list(range(world)), list(range(world))
        nodes = [r.node_rank for r in ranks]
        return [r.group if r.group is not None else r.node_rank for r in ranks], nodes

    def install_dispatcher(self) -> str:
        """Class-swap the AutoEP layers to the dedup dispatcher when the plan says so (EP > 1);
        count all-to-all bytes by tier either way."""
        p = self.plan
        group_of, node_of = self.rank_tiers()
        self.timer.set_tiers(group_of, node_of)
        reps = p.placement.replicas if p.placement is not None else None
        if (
            p.placement is None
            or p.placement.dispatcher != "dedup"
            or not p.autoep_enabled
            or p.ep_size == 1
        ):
            dedup_replicas.refuse_copies(reps)  # AutoEP's own all-to-all cannot serve copies
            return "autoep"
        from moe_trainer.dispatch import dedup_ep

        P = p.ep_size
        base = (self.env.rank // P) * P
        layout = dedup_ep.contiguous_layout(
            self.num_experts, P, group_of[base : base + P], node_of[base : base + P]
        )
        layouts = [layout] * len(self.blocks)
        if reps is not None:
            layouts = dedup_replicas.plan_layouts(layout, reps, self.permutation)
        dedup_ep.install(self.blocks, layouts)
        if self.is_rank0:
            log.info(
                "dedup dispatcher: %d group(s) x %d rank(s) per EP group",
                len(layout.group_ranks),
                len(layout.group_ranks[0]),
            )
        return "dedup"

    def resume(self) -> None:
        step = ckpt.latest_step(self.ckpt_dir)
        if step is None:
            return
        state = ckpt.load(self.engine, self.ckpt_dir, step, self.env.rank)
        self.start_step = int(state["step"])
        self.acc.load_state_dict(state["routing"])
        self.samples.load_state_dict(state.get("samples"))
        self.health.load_state_dict(state["health"])
        self.losses = list(state["losses"])
        self.window.load_state_dict(state.get("routingWindow"))
        self.replan.load_state_dict(self, state.get("placement"))  # the checkpoint's slot order
        self.last_ckpt = {
            "step": step,
            "path": str(ckpt.ds_dir(self.ckpt_dir) / ckpt.tag_for(step)),
        }
        log.info("rank %d resumed from step %d", self.env.rank, step)

    # ---- one step ----------------------------------------------------------------------------
    def train_step(
        self, step: int
    ) -> tuple[float, float, torch.Tensor, torch.Tensor, torch.Tensor]:
        t, env = self.t, self.env
        faults = ckpt.test_faults()
        L, E = len(self.blocks), self.num_experts
        load = torch.zeros(L, E, dtype=torch.float64, device=env.device)
        coact = torch.zeros(L, E, E, dtype=torch.float64, device=env.device)
        maxlog = torch.zeros(L, dtype=torch.float64, device=env.device)
        # summed on the device in fp64 (the same arithmetic as Python floats of each micro step's
        # values) and read once per step: a read per micro-batch stalls the GPU each time
        lm_total = torch.zeros((), dtype=torch.float64, device=env.device)
        aux_total = torch.zeros((), dtype=torch.float64, device=env.device)
        for micro in range(t.grad_accum):
            inputs, targets = (
                torch.from_numpy(a).to(env.device)
                for a in self.source.inputs_targets(
                    step, micro, t.grad_accum, env.rank, env.world_size
                )
            )
            self.probe.clear()
            if self.perf.fused_loss:
                lm = self.engine(input_ids=inputs, targets=targets).loss
            else:
                logits = self.engine(input_ids=inputs).logits
                lm = data_mod.lm_loss(logits, targets, self.source.masked)
            if faults is not None and faults.nan_due(step + 1):  # test hook: poison the loss
                lm = lm * float("nan")
            if not self.probe.captured():
                raise RuntimeError(
                    "router hooks did not fire: the MoE blocks were not found after initialize"
                )
            aux = routing.balance_loss(self.probe, E, t.balance.mode)
            loss = lm if aux is None or t.balance.coef == 0 else lm + t.balance.coef * aux
            # counted before backward: an activation-checkpoint recompute fires the hooks again
            sl, sc, sm = routing.step_counts(self.probe, E)
            self.samples.add(self.probe.topk, step + 1, micro)
            self.engine.backward(loss)
            self.engine.step()
            load += sl
            coact += sc
            maxlog = torch.maximum(maxlog, sm)
            lm_total += lm.detach().to(torch.float64) / t.grad_accum
            if aux is not None:
                aux_total += aux.detach().to(torch.float64) / t.grad_accum
            self.probe.clear()
        return float(lm_total), float(aux_total), load, coact, maxlog

    # ---- reports -----------------------------------------------------------------------------
    def routing_doc(self, merged: dict | None = None, window: dict | None = None) -> dict:
        """Whole-run RoutingStats; with ``merged`` (TokenSampler.merge) it carries the token
        sample and the step of each sampled token (same order: the sampler keeps whole tokens),
        with ``window`` (TokenSampler.take_window) the window's own sample in ``window``."""
        load, coact = routing.to_original_ids(
            self.acc.load.cpu().numpy(), self.acc.coact.cpu().numpy(), self.permutation
        )
        whole = samples_doc(merged, self.permutation) or {}
        recent = samples_doc(window, self.permutation)
        return routing_stats_doc(
            load,
            coact,
            self.acc.tokens,
            self.acc.steps,
            self.top_k,
            self.model_name,
            samples=whole.get("experts"),
            sample_steps=whole.get("steps"),
            window=self.window.doc(load, coact, self.acc.tokens, self.acc.steps, recent),
        )

    def write_routing(self, merged: dict | None = None) -> None:
        """Whole-run RoutingStats (rank 0): file in the checkpoint dir + ConfigMap for the next
        plan. Collective (every rank calls it: the token samples are merged over ranks)."""
        if self._routing_written_step == self.acc.steps:
            return
        merged = self.samples.merge(self.env.device) if merged is None else merged
        window = self.samples.take_window(self.env.device)  # and the next window starts
        self._routing_written_step = self.acc.steps
        if not self.is_rank0:
            return
        doc = self.routing_doc(merged, window)
        path = None
        if self.ckpt_dir:
            path = str(Path(self.ckpt_dir) / contract_env.ROUTING_STATS_KEY)
            write_json_atomic(path, doc)
        if self.routing_publisher:
            self.routing_publisher.publish(doc, self.acc.steps, path)
        self.window.advance(doc["load"], doc["coactivation"], self.acc.tokens, self.acc.steps)

    def routing_status(self) -> RoutingStatsStatus | None:
        """The progress document's `routingStats` section (None without a ConfigMap to publish
        to)."""
        return None if self.routing_publisher is None else self.routing_publisher.status

    def save(self, step: int) -> None:
        if not self.ckpt_dir:
            return
        merged = self.samples.merge(self.env.device)
        self.write_routing(merged)  # first: the state keeps the window that starts here
        state = {
            "step": step,
            "routing": self.acc.state_dict(),
            "health": self.health.state_dict(),
            "losses": list(self.losses),
            "samples": self.samples.state_dict(merged),
            "placement": self.replan.state_dict(self.permutation),
            "routingWindow": self.window.state_dict(),
        }
        path = ckpt.save(self.engine, self.ckpt_dir, step, self.env.rank, state)
        self.last_ckpt = {"step": step, "path": str(path)}

    def publish(self, doc: dict, tokens: int, force: bool = False) -> None:
        if not self.is_rank0:
            return
        if (placement := self.replan.section()) is not None:
            doc["placement"] = placement  # the running generation, from the first document on
        if self.ckpt_dir:
            write_json_atomic(Path(self.ckpt_dir) / contract_env.PROGRESS_KEY, doc)
        if self.publisher:
            self.publisher.publish(doc, force=force)
        if self.metrics:
            self.metrics.update(doc, tokens)

    def log_findings(self, step: int, findings) -> None:
        """Log a finding when it appears (not on every step it persists)."""
        now = {(f.type, f.message.split(":")[0]) for f in findings}
        for f in findings:
            if (f.type, f.message.split(":")[0]) not in self._logged:
                log.warning("step %d health %s: %s", step, f.type, f.message)
        self._logged = now

    def moe_section(self, comm: dict, frag: float | None, per_rank: list[list[float]]) -> dict:
        """Load balance over the last RECENT_STEPS steps; comm times, all-to-all bytes sent by each
        rank and fragmentation of this step; each rank's memory peaks since the start (CUDA)."""
        load = sum(self.recent_load)
        cuda = self.env.device.type == "cuda"
        tiers = {k: int(sum(r[2 + i] for r in per_rank)) for i, k in enumerate(TIERS)}
        total = self.bytes_since_start  # called once per step: this step's bytes added
        total["steps"] += 1
        total["byTier"] = {k: total["byTier"][k] + v for k, v in tiers.items()}
        return {
            "maxMeanLoadPerLayer": [round(x, 4) for x in routing.max_mean_per_layer(load)],
            "deadExperts": self.health.dead_experts(),
            "allToAllSecondsPerStep": round(comm["allToAll"], 6),
            "allGatherSecondsPerStep": round(comm["allGather"], 6),
            "fragmentation": frag,
            "allToAllBytesPerStepByRank": [int(r[1]) for r in per_rank],
            "dispatcher": self.dispatcher,
            "allToAllBytesPerStepByTier": tiers,
            "allToAllBytesSinceStart": {"steps": total["steps"], "byTier": dict(total["byTier"])},
            "peakMemoryAllocatedBytesByRank": [int(r[5]) for r in per_rank] if cuda else None,
            "peakMemoryReservedBytesByRank": [int(r[6]) for r in per_rank] if cuda else None,
            "replicaSyncBytesPerStepByTier": dedup_replicas.progress_tiers(
                self.blocks, per_rank, 7
            ),
        }

    # ---- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        t, env = self.t, self.env
        faults = ckpt.test_faults()
        tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * env.world_size
        step = self.start_step
        self.publish(
            progress_doc(
                phase="Starting" if step == 0 else "Training",
                step=step,
                total_steps=t.steps,
                loss=None,
                tokens_per_second=0.0,
                eta_seconds=None,
                checkpoint=self.last_ckpt,
                moe={},
                health=[],
            ),
            0,
            force=True,
        )
        t_run = time.perf_counter()
        marks: deque = deque(maxlen=RATE_WINDOW + 1)  # (time, step) after each step
        self.timer.take()
        while step < t.steps:
            t0 = time.perf_counter()
            lm, aux, load, coact, maxlog = self.train_step(step)
            dt = time.perf_counter() - t0
            comm = self.timer.take()
            # One all-reduce for counts + loss, one for the logit max, one all-gather for step
            # times.
            flat = torch.cat(
                [
                    load.reshape(-1),
                    coact.reshape(-1),
                    torch.tensor([lm], dtype=torch.float64, device=env.device),
                ]
            )
            dist.all_reduce(flat)
            dist.all_reduce(maxlog, op=dist.ReduceOp.MAX)
            # Per rank, in one all-gather: the straggler signal (step time minus time blocked in
            # collectives: in synchronous training everyone's wall time equals the slowest rank's,
            # the time outside collectives does not), all-to-all bytes sent, memory peaks.
            busy = max(0.0, dt - comm["allToAll"] - comm["allGather"])
            tiers = comm["allToAllTierBytes"]
            mine = torch.tensor(
                [
                    busy,
                    comm["allToAllBytes"],
                    tiers["intraGroup"],
                    tiers["crossGroup"],
                    tiers["crossNode"],
                    *memory_peaks(env.device),
                    *dedup_replicas.sync_counters.take().values(),  # copies' weights (tiers)
                ],
                dtype=torch.float64,
                device=env.device,
            )
            per_rank = [torch.zeros_like(mine) for _ in range(env.world_size)]
            dist.all_gather(per_rank, mine)
            per_rank = torch.stack(per_rank).cpu().tolist()
            L, E = load.shape
            g_load = flat[: L * E].reshape(L, E)
            g_coact = flat[L * E : L * E + L * E * E].reshape(L, E, E)
            loss = float(flat[-1].item()) / env.world_size
            step += 1
            self.acc.add(g_load, g_coact, tokens_per_step)
            self.acc.steps += 1
            self.losses.append(loss)
            orig_load = routing.load_to_original_ids(g_load.cpu().numpy(), self.permutation)
            self.recent_load.append(orig_load)
            findings = self.health.check_loss(loss)
            findings += self.health.check_router_logits(maxlog.cpu().numpy())
            findings += self.health.update_dead(orig_load)
            findings += self.health.update_stragglers([r[0] for r in per_rank])
            frag = fragmentation(env.device)
            findings += self.health.check_fragmentation(frag)
            self.log_findings(step, findings)
            # Rate and ETA over the last RATE_WINDOW steps: a run's first steps (allocator warm-up,
            # compiles) are several times slower, and an average since start hid the steady rate
            # (an H200 run reported 55k tok/s at step 30 while steps 10-30 ran at 135k).
            marks.append((time.perf_counter(), step))
            (t_first, s_first), (t_last, s_last) = marks[0], marks[-1]
            if s_last > s_first and t_last > t_first:
                step_s = (t_last - t_first) / (s_last - s_first)
            else:
                step_s = t_last - t_run
            tps = tokens_per_step / step_s if step_s > 0 else 0.0
            eta = (t.steps - step) * step_s
            if self.is_rank0:
                log.info(
                    "step %d/%d loss %.4f aux %.4f %.0f tok/s a2a %.3fs ag %.3fs",
                    step,
                    t.steps,
                    loss,
                    aux,
                    tps,
                    comm["allToAll"],
                    comm["allGather"],
                )
            nonfinite = not math.isfinite(loss)
            phase = "Failed" if nonfinite else "Training"
            doc = progress_doc(
                phase=phase,
                step=step,
                total_steps=t.steps,
                loss=loss,
                tokens_per_second=tps,
                eta_seconds=eta,
                checkpoint=self.last_ckpt,
                moe=self.moe_section(comm, frag, per_rank),
                health=[f.to_doc() for f in findings],
            )
            if nonfinite:
                self.publish(doc, tokens_per_step, force=True)
                raise NonFiniteLoss(f"loss is {loss} at step {step}")
            if step % t.checkpoint_every_steps == 0 or step == t.steps:
                if self.is_rank0 and self.ckpt_dir:
                    write_json_atomic(
                        Path(self.ckpt_dir) / contract_env.PROGRESS_KEY,
                        dict(doc, phase="Checkpointing"),
                    )
                self.replan.at_checkpoint(self, step)  # a newer PlacementUpdate: re-place first
                self.save(step)
                doc["checkpoint"] = self.last_ckpt
            if step == t.steps:
                self.write_routing()  # no-op when the final checkpoint just wrote it
            if (output := self.exporter.after_step(self.engine, step, t.steps)) is not None:
                doc["output"] = output  # the latest Hugging Face export (plan output)
            if self.routing_status() is not None:
                doc["routingStats"] = self.routing_status()
            if step == t.steps:
                doc["phase"] = "Finished"
            self.publish(doc, tokens_per_step, force=step == t.steps)
            if self.on_step is not None:
                self.on_step(step)
            code = faults.exit_due(step, self.ckpt_dir) if faults is not None else None
            if code is not None:
                dist.barrier()
                faults.mark_exit(step, self.ckpt_dir, env.rank)
                log.warning("fault injection: exiting with %d after step %d", code, step)
                return code
        log.info("rank %d trained steps %d..%d of %d", env.rank, self.start_step + 1, step, t.steps)
        self.finish()
        return EXIT_OK

    def finish(self) -> None:
        self.write_routing()
        if not (self.is_rank0 and self.ckpt_dir):
            return
        write_json_atomic(Path(self.ckpt_dir) / "losses.json", {"losses": self.losses})
        try:
            from moe_trainer.telemetry.heatmap import save_heatmap

            save_heatmap(self.routing_doc(), Path(self.ckpt_dir) / "expert_load.png")
        except Exception as exc:  # noqa: BLE001 - a missing plot never fails a finished run
            log.warning("heatmap not written: %s", exc)

    def close(self) -> None:
        # also after a failed build(), which may stop before the timer exists: the exit code
        # and the termination message must survive the cleanup
        if getattr(self, "timer", None) is not None:
            self.timer.uninstall()
        if getattr(self, "metrics", None):
            self.metrics.close()
