"""`moe-smoke`: a short real ZeRO-3 + AutoEP run that checks what DeepSpeed upgrades break.

The operator's upgrade gate runs it as a Job before the first launch on a trainer image /
DeepSpeed version it has not verified (docs/gate.md); `moectl smoke` runs it on a workstation.

Checks, in order; the run stops at the first failure (so injected faults fail fast):
  imports      torch / deepspeed / transformers import; versions (and CUDA) reported;
               `--expect-deepspeed` must match the installed DeepSpeed
  initialize   the trainer's own path: MoEPlan reader -> tiny Mixtral (models.build_model) ->
               placement permutation -> `deepspeed.initialize` with ZeRO-3 + AutoEP; every MoE
               block must come out as an AutoEP layer
  permutation  each EP rank holds exactly the experts the plan put there (placement.verify_placement)
               and the permuted, sharded model computes what the unpermuted original computes
  train        a few optimizer steps on a learnable token stream: loss finite and falling
  checkpoint   save, train one more step (weights move), load back: weights identical to the save
  fused_adam   GPU: DeepSpeed's FusedAdam builds and steps; CPU: the fallback is reported

World size: one process per GPU (1 by default: the gate asks for one GPU). On CPU two gloo
processes with EP size 2, because with EP size 1 AutoEP never dispatches tokens between ranks and
the permutation check could not see a misplaced expert; the all-to-all is what upgrades break.

Verdict (docs/contracts.md, `SmokeVerdict` v1): JSON on stdout (and `--output`), compacted into
`/dev/termination-log` when that file exists (the kubelet creates it), so the operator reads the
verdict from the pod status. Exit code 0 passed, 1 failed, 2 usage.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

CHECKS = ("imports", "initialize", "permutation", "train", "checkpoint", "fused_adam")
INJECTIONS = ("native-moe", "nan")
VERDICT_KIND, VERDICT_VERSION = "SmokeVerdict", 1
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LIMIT = 4096          # bytes the kubelet keeps of a termination message
EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
NAN_AT_STEP = 2                   # --inject nan poisons this step's loss (1-based)

# A learnable stream: the loss of a tiny model falls within a few steps (uniform random tokens
# would sit at ln(vocab) and prove nothing).
_TEXT = ("the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
         "sphinx of black quartz, judge my vow. ")


class CheckFailed(AssertionError):
    """A check ran and found something wrong (its message is the verdict's message)."""


# ---- the plan the smoke run trains ---------------------------------------------------------
def smoke_plan_doc(world_size: int, device: str, steps: int) -> dict:
    """A MoEPlan v1 document (docs/contracts.md) for the tiny Mixtral: EP size = world size, and
    a placement that moves every expert off its contiguous home (so misplacement is visible)."""
    from moe_trainer.models import TINY_HF_CONFIGS
    hf = dict(TINY_HF_CONFIGS["tiny-mixtral"])
    n_layers, n_experts = hf["num_hidden_layers"], hf["num_local_experts"]
    # layer l: slot s <- expert (s + 1 + l) mod E, a rotation: no expert stays in its slot
    perm = [[(s + 1 + layer) % n_experts for s in range(n_experts)] for layer in range(n_layers)]
    ds: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
                "expert_parallel": {"enabled": True, "autoep_size": world_size, "preset_model": "mixtral"}}
    if device == "cuda":
        ds["bf16"] = {"enabled": True}
    return {
        "kind": "MoEPlan", "version": 1, "job": {"namespace": "smoke", "name": "moe-smoke"},
        "device": device, "distBackend": "nccl" if device == "cuda" else "gloo",
        "model": {"family": "mixtral", "preset": "tiny-mixtral", "path": None, "hfConfig": hf},
        "worldSize": world_size, "epSize": world_size,
        "ranks": [{"rank": r, "node": "local", "nodeRank": 0, "localRank": r,
                   "gpu": r if device == "cuda" else None} for r in range(world_size)],
        "placement": {"strategy": "smoke-rotation", "numLayers": n_layers, "numExperts": n_experts,
                      "epSize": world_size, "permutation": perm},
        "deepspeed": ds,
        "training": {"steps": steps, "seqLen": 64, "microBatch": 2, "gradAccum": 1, "lr": 0.003,
                     "warmupSteps": 1, "checkpointEverySteps": steps, "seed": 1234,
                     "balance": {"mode": "none", "coef": 0.0}, "data": {"kind": "synthetic"}},
    }


# ---- one rank ------------------------------------------------------------------------------
class Recorder:
    """This rank's check results, rewritten to `path` after every check (the parent reads it
    even when the rank dies later)."""

    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank
        self.checks: list[dict] = []
        self.versions: dict = {}
        self.exception: str | None = None
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "checks": self.checks, "versions": self.versions,
                                   "exception": self.exception}))
        os.replace(tmp, self.path)

    def run(self, name: str, fn) -> bool:
        t0 = time.perf_counter()
        try:
            message = fn() or "ok"
            passed = True
        except Exception as exc:   # noqa: BLE001 - any failure is the verdict, not a crash
            passed = False
            message = f"{type(exc).__name__}: {exc}".strip()
            self.exception = "".join(traceback.format_exception(exc)[-6:])[-3000:]
        self.checks.append({"name": name, "passed": passed, "seconds": round(time.perf_counter() - t0, 3),
                            "message": message[:1000]})
        self.write()
        return passed


class SmokeRank:
    """The checks of one rank. Every collective runs on every rank in the same order."""

    def __init__(self, args: argparse.Namespace, rec: Recorder):
        self.args, self.rec = args, rec

    # imports ----------------------------------------------------------------------------------
    def imports(self) -> str:
        import deepspeed
        import torch
        import transformers
        cuda = torch.cuda.is_available() and not self.args.cpu
        v = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
             "transformers": transformers.__version__, "cuda": torch.version.cuda,
             "python": sys.version.split()[0], "device": "cuda" if cuda else "cpu",
             "gpu": torch.cuda.get_device_name(0) if cuda else None}
        if cuda:
            try:
                nccl = torch.cuda.nccl.version()
                v["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            except (RuntimeError, AttributeError):
                v["nccl"] = None
        self.rec.versions = v
        if not self.args.cpu and not cuda:
            raise CheckFailed("no CUDA device is visible (run with --cpu to test on CPU)")
        want = self.args.expect_deepspeed
        if want and v["deepspeed"] != want:
            raise CheckFailed(f"the image has deepspeed {v['deepspeed']}, the job declares {want}")
        return f"deepspeed {v['deepspeed']}, torch {v['torch']}, transformers {v['transformers']}, " \
               f"cuda {v['cuda']}"

    # initialize -------------------------------------------------------------------------------
    def initialize(self) -> str:
        import copy
        import deepspeed
        import torch
        from moe_trainer import distenv, models
        from moe_trainer.plan import parse_plan
        from moe_trainer.trainer import deepspeed_config, lr_lambda

        device = "cpu" if self.args.cpu else "cuda"
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.plan = plan = parse_plan(smoke_plan_doc(world, device, self.args.steps))
        self.env = env = distenv.read_env(plan.world_size, [r.gpu for r in plan.ranks], force_cpu=self.args.cpu)
        distenv.set_cpu_threads(env)
        distenv.init_distributed(env, timeout_s=120)
        t = plan.training
        model = models.build_model(plan.model.hf_config, seed=t.seed)
        self.reference = copy.deepcopy(model).to(env.device).eval()   # unpermuted, unsharded
        # verify_placement compares on the engine's device (the trainer's own call assumes CPU)
        self.originals = [{k: v.to(env.device) for k, v in layer.items()}
                          for layer in models.original_expert_tensors(model)]
        self.permutation = [list(r) for r in plan.placement.permutation]
        models.permute_experts(model, self.permutation)
        if self.args.inject == "native-moe":
            _swap_in_native_moe(model)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=t.lr, betas=(0.9, 0.95), weight_decay=0.0),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(t.warmup_steps, t.steps, 0.1)),
            config=deepspeed_config(plan))
        self.blocks = [r.block for r in models.find_moe_layers(self.engine.module)]
        kinds = sorted({type(b).__name__ for b in self.blocks})
        if len(self.blocks) != plan.placement.num_layers or not all("AutoEP" in k for k in kinds):
            raise CheckFailed(f"after initialize the MoE blocks are {kinds} x {len(self.blocks)}, "
                              f"expected {plan.placement.num_layers} AutoEP layers")
        return f"ZeRO-3 + AutoEP (EP size {plan.ep_size}) on {world} {device} rank(s): {len(self.blocks)} x {kinds[0]}"

    # permutation ------------------------------------------------------------------------------
    def permutation_check(self) -> str:
        import torch
        from moe_trainer.placement import verify_placement
        report = verify_placement(self.blocks, self.permutation, self.originals, self.env.rank)
        if not report["ok"]:
            bad = [x for x in report["layers"] if not x["ok"]]
            raise CheckFailed(f"rank {self.env.rank} does not hold the planned experts: {bad}")
        batch = self._batch(10_000)[:, :-1]
        with torch.no_grad():
            got = self.engine(input_ids=batch).logits.float()
            want = self.reference(input_ids=batch).logits.float()
        err = (got - want).abs().flatten()
        diff = float(err.max())
        if self.env.device.type == "cuda":
            # bf16: rounding can flip a near-tied top-k choice for a few tokens; judge the bulk
            tol = 5e-2 * max(1.0, float(want.abs().max()))
            measured, what = float(torch.quantile(err, 0.99)), "99th percentile"
        else:
            tol, measured, what = 1e-4, diff, "max"
        if not measured <= tol:
            raise CheckFailed(f"the permuted ZeRO-3/AutoEP model computes a different function: "
                              f"{what} |logits - reference| = {measured:.3g} > {tol:.3g}")
        del self.reference
        held = [x["experts"] for x in report["layers"]]
        return f"rank {self.env.rank} holds experts {held} per layer as planned; max |dlogits| {diff:.2g}"

    # train ------------------------------------------------------------------------------------
    def _batch(self, step: int):
        import numpy as np
        import torch
        from moe_trainer.data import BatchSource, ByteTokenizer
        if not hasattr(self, "source"):
            tokens = ByteTokenizer().encode(_TEXT * 64)
            t = self.plan.training
            self.source = BatchSource(np.asarray(tokens), t.seq_len, t.micro_batch, t.seed,
                                      self.engine.module.config.vocab_size)
        b = self.source.batch(step, 0, 1, self.env.rank, self.env.world_size)
        return torch.from_numpy(b).to(self.env.device)

    def step(self, step: int) -> float:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        batch = self._batch(step)
        logits = self.engine(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        if self.args.inject == "nan" and step + 1 == NAN_AT_STEP:
            loss = loss * float("nan")
        self.engine.backward(loss)
        self.engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean.item()) / self.env.world_size

    def train(self) -> str:
        self.losses = []
        for step in range(self.args.steps):
            loss = self.step(step)
            self.losses.append(loss)
            if not math.isfinite(loss):
                raise CheckFailed(f"loss is {loss} at step {step + 1} (losses so far {self._fmt(self.losses)})")
        first, last = self.losses[0], sum(self.losses[-2:]) / 2
        if not last < 0.9 * first:
            raise CheckFailed(f"loss did not fall: {self._fmt(self.losses)} (want the last two below 90% "
                              "of the first)")
        return f"{len(self.losses)} steps, loss {self._fmt(self.losses)}"

    @staticmethod
    def _fmt(xs) -> str:
        return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"

    # checkpoint -------------------------------------------------------------------------------
    def _weights(self) -> dict:
        import deepspeed
        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return {n: p.detach().float().cpu().clone() for n, p in params}

    def checkpoint(self) -> str:
        import torch
        from moe_trainer import checkpoint as ckpt
        step = len(self.losses)
        ckpt_dir = Path(self.args.workdir) / "ckpt"
        ckpt.save(self.engine, ckpt_dir, step, self.env.rank, {"step": step, "losses": self.losses})
        saved = self._weights()
        self.step(step)                                    # move the weights away from the save
        moved = self._weights()
        if all(torch.equal(saved[n], moved[n]) for n in saved):
            raise CheckFailed("an optimizer step after the save changed no weight (nothing to restore)")
        if ckpt.latest_step(ckpt_dir) != step:
            raise CheckFailed(f"{ckpt.ds_dir(ckpt_dir)}/latest does not name step {step}")
        state = ckpt.load(self.engine, ckpt_dir, step, self.env.rank)
        loaded = self._weights()
        diff = [n for n in saved if not torch.equal(saved[n], loaded[n])]
        if diff or int(state["step"]) != step:
            raise CheckFailed(f"after load_checkpoint {len(diff)} of {len(saved)} tensors differ from the "
                              f"save (first: {diff[:3]}), trainer step {state['step']}")
        return f"saved step {step}, stepped, loaded back: {len(saved)} tensors identical"

    # fused_adam -------------------------------------------------------------------------------
    def fused_adam(self) -> str:
        import torch
        if self.env.device.type != "cuda":
            return "fallback: no GPU, FusedAdam not built; the trainer uses torch.optim.AdamW on CPU"
        t0 = time.perf_counter()
        from deepspeed.ops.adam import FusedAdam
        p = torch.nn.Parameter(torch.ones(4096, device=self.env.device))
        opt = FusedAdam([p], lr=1e-2)
        p.grad = torch.ones_like(p)
        opt.step()
        torch.cuda.synchronize()
        if not bool((p < 1).all()):
            raise CheckFailed("FusedAdam.step() did not move the parameter against its gradient")
        return f"FusedAdam built and stepped in {time.perf_counter() - t0:.1f}s"

    def run_all(self) -> bool:
        steps = (("imports", self.imports), ("initialize", self.initialize),
                 ("permutation", self.permutation_check), ("train", self.train),
                 ("checkpoint", self.checkpoint), ("fused_adam", self.fused_adam))
        return all(self.rec.run(name, fn) for name, fn in steps)


def _swap_in_native_moe(model) -> None:
    """Fault injection: layer 0's HF MoE block becomes `deepspeed.moe.layer.MoE`, which ZeRO-3
    must refuse at initialize ("Native DeepSpeed MoE is not supported with ZeRO Stage 3")."""
    from deepspeed.moe.layer import MoE
    from torch import nn
    from moe_trainer.models import find_moe_layers, num_experts_of
    ref = find_moe_layers(model)[0]
    h = model.config.hidden_size
    expert = nn.Sequential(nn.Linear(h, model.config.intermediate_size), nn.GELU(),
                           nn.Linear(model.config.intermediate_size, h))
    parent = model.get_submodule(ref.name.rsplit(".", 1)[0])
    setattr(parent, "mlp", MoE(h, expert, num_experts=num_experts_of(model), ep_size=1, k=2))


def worker_main(args: argparse.Namespace) -> int:
    import logging
    import warnings
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=os.environ.get("MOE_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s smoke rank{os.environ.get('RANK', '0')} %(levelname)s %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank = int(os.environ.get("RANK", "0"))
    rec = Recorder(Path(args.workdir) / f"rank{rank}.json", rank)
    ok = SmokeRank(args, rec).run_all()
    return EXIT_PASS if ok else EXIT_FAIL


# ---- the parent: start the ranks, merge their results into one verdict ---------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, tail: collections.deque, prefix: str) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        tail.append(line)
        print(f"{prefix}{line}", file=sys.stderr, flush=True)


def run_ranks(args: argparse.Namespace, nproc: int) -> tuple[list[int | None], list[collections.deque], bool]:
    """Start `nproc` worker ranks; returns exit codes (None: killed at the timeout), output tails,
    and whether the timeout hit. When one rank fails the others get a few seconds, then are
    killed (they may wait forever in a collective the failed rank never joins)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "moe_trainer.smoke", "--worker", "--workdir", args.workdir,
           "--steps", str(args.steps)] + (["--cpu"] if args.cpu else []) \
        + (["--inject", args.inject] if args.inject else []) \
        + (["--expect-deepspeed", args.expect_deepspeed] if args.expect_deepspeed else [])
    procs, tails, pumps = [], [], []
    for rank in range(nproc):
        p = subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        tail: collections.deque = collections.deque(maxlen=40)
        th = threading.Thread(target=_pump, args=(p.stdout, tail, f"[rank{rank}] "), daemon=True)
        th.start()
        procs.append(p)
        tails.append(tail)
        pumps.append(th)
    deadline = time.monotonic() + args.timeout
    first_fail: float | None = None
    timed_out = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_fail is None and any(p.poll() not in (None, 0) for p in procs):
            first_fail = now
        if now > deadline or (first_fail is not None and now - first_fail > 5):
            timed_out = now > deadline
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            break
        time.sleep(0.1)
    codes = []
    for p, th in zip(procs, pumps):
        p.wait()
        th.join(timeout=2)
        codes.append(p.returncode)
    return codes, tails, timed_out


def merge(results: list[dict | None], codes: list[int | None], tails: list, timed_out: bool,
          timeout: float, duration: float) -> dict:
    """One SmokeVerdict from the ranks' check lists: a check passed when every rank passed it."""
    checks, failed, exception = [], None, None
    for name in CHECKS:
        entries = [(r, c) for r, res in enumerate(results) for c in (res or {}).get("checks", ()) if c["name"] == name]
        if not entries:
            break
        bad = [(r, c) for r, c in entries if not c["passed"]]
        if len(entries) < len(results) and not bad:
            missing = sorted(set(range(len(results))) - {r for r, _ in entries})
            bad = [(r, {"message": "did not finish this check"}) for r in missing]
        if bad:
            r, c = bad[0]
            msg = c["message"] if len(results) == 1 else f"rank {r}: {c['message']}"
            checks.append({"name": name, "passed": False, "seconds": max(x["seconds"] for _, x in entries),
                           "message": msg})
            failed = name
            exception = (results[r] or {}).get("exception")
            break
        main = entries[0][1]
        checks.append({"name": name, "passed": True, "seconds": max(c["seconds"] for _, c in entries),
                       "message": main["message"]})
    if failed is None and len(checks) < len(CHECKS):
        failed = CHECKS[len(checks)]
        dead = [(r, c) for r, c in enumerate(codes) if c != 0]
        r, code = dead[0] if dead else (0, None)
        why = f"timed out after {timeout:.0f}s" if timed_out else f"rank {r} exited with code {code}"
        checks.append({"name": failed, "passed": False, "seconds": 0.0,
                       "message": f"{why} before finishing this check"})
        exception = "\n".join(list(tails[r])[-15:])[-3000:] if tails else None
    versions = next((res["versions"] for res in results if res and res.get("versions")), {})
    return {"kind": VERDICT_KIND, "version": VERDICT_VERSION, "passed": failed is None,
            "failedCheck": failed, "checks": checks, "exception": exception, "versions": versions,
            "worldSize": len(results), "durationSeconds": round(duration, 2)}


def compact(verdict: dict, limit: int = TERMINATION_LIMIT) -> str:
    """The verdict as JSON of at most `limit` bytes: trims the exception, then check messages."""
    v = json.loads(json.dumps(verdict))
    text = json.dumps(v, separators=(",", ":"))
    for cap in (2000, 1000, 400, 160, 60, 0):
        if len(text.encode()) <= limit:
            return text
        if v.get("exception"):
            v["exception"] = v["exception"][-cap:] if cap else None
        for c in v["checks"]:
            if not c["passed"] and len(c["message"]) > max(cap, 200):
                c["message"] = c["message"][:max(cap, 200)]
            elif c["passed"]:
                c["message"] = c["message"][:cap]
        text = json.dumps(v, separators=(",", ":"))
    return text[:limit] if len(text.encode()) > limit else text


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moe-smoke", description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU + gloo even when a GPU is present")
    ap.add_argument("--gpu", action="store_true",
                    help="fail unless a GPU is used (no silent CPU fallback; the operator's GPU smoke Job)")
    ap.add_argument("--nproc", type=int, help="ranks (default: 2 on CPU, 1 on GPU); EP size = ranks")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps of the train check (>= 3)")
    ap.add_argument("--inject", choices=INJECTIONS, help="fault injection (tests): native-moe | nan")
    ap.add_argument("--expect-deepspeed", metavar="VERSION", help="fail unless this DeepSpeed is installed")
    ap.add_argument("--output", "-o", help="also write the verdict JSON here")
    ap.add_argument("--termination-log", default=TERMINATION_LOG,
                    help="compact verdict here when the file exists (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed")
    ap.add_argument("--workdir", help="scratch dir (checkpoints, rank results); default a temp dir")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_PASS
    if args.steps < 3 or (args.nproc is not None and args.nproc < 1):
        print("moe-smoke: error: --steps must be >= 3 and --nproc >= 1", file=sys.stderr)
        return EXIT_USAGE
    if args.worker:
        return worker_main(args)

    t0 = time.perf_counter()
    if args.cpu and args.gpu:
        print("moe-smoke: error: --cpu and --gpu exclude each other", file=sys.stderr)
        return EXIT_USAGE
    if not args.cpu and not args.gpu and not _cuda_visible():
        print("moe-smoke: no GPU visible: running on CPU (gloo)", file=sys.stderr)
        args.cpu = True
    nproc = args.nproc or (2 if args.cpu else 1)
    with tempfile.TemporaryDirectory(prefix="moe-smoke-") as tmp:
        args.workdir = args.workdir or tmp
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        codes, tails, timed_out = run_ranks(args, nproc)
        results = []
        for r in range(nproc):
            f = Path(args.workdir) / f"rank{r}.json"
            try:
                results.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                results.append(None)
    verdict = merge(results, codes, tails, timed_out, args.timeout, time.perf_counter() - t0)
    if args.inject:
        verdict["injected"] = args.inject
    text = json.dumps(verdict, indent=2)
    print(text, flush=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    term = Path(args.termination_log)
    if term.exists():
        try:
            term.write_text(compact(verdict))
        except OSError as exc:
            print(f"moe-smoke: cannot write {term}: {exc}", file=sys.stderr)
    return EXIT_PASS if verdict["passed"] else EXIT_FAIL


def _cuda_visible() -> bool:
    """Without importing torch in the parent (keeps its memory and start-up small)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def main(argv=None) -> None:
    code = run(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
