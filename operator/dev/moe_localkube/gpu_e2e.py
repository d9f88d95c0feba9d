"""The operator's whole path on this machine's real GPUs, through the entry points users run.

On a GPU machine with no Kubernetes (benchmarks/gpu_e2e.sh wraps this): a local control plane
(etcd, kube-apiserver, controller manager, scheduler), the CRD, the node agent as one GPU node
whose GPUs come from the real NVML (each pod gets the GPUs it was granted as
``CUDA_VISIBLE_DEVICES``, as the NVIDIA device plugin and runtime give them), and the operator.
Then:

1. job 1 (``device: GPU``, the model given as ``hfConfig``) is applied and watched to
   ``Succeeded``: discovery pod on the real NVML, the GPU smoke Job of the upgrade gate, the
   worker pod training;
2. ``moe-train`` is started directly on job 1's plan (what the operator path costs: time to the
   first step, tokens/s);
3. job 2 plans from job 1's routing statistics (``routingStatsFrom``) and runs to ``Succeeded``.

Everything a person would look at is written under ``--out``: ``gpu_e2e.json`` (the summary),
``collected.tar.gz`` (status, Events, every child as YAML, the metrics scrape, logs, plans) and
``topology.json`` (the discovery report from the real NVML).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import ApiextensionsV1Api

from moejob_operator import constants as C
from moejob_operator.core.models import preset_hf_config

from . import procs
from .controlplane import ControlPlane, free_ports
from .gpus import REAL_NVML, read_gpus
from .nodeagent import NodeAgent, NodeSpec
from .nodes import FAKE_NVML_ENV
from .testing import Kube, operator_command

ROOT = Path(__file__).resolve().parents[3]
NODE = "gpu-node-0"
STEP_RE = re.compile(
    r"^(?:\[rank\d+\] )?(\S+ \S+) rank0 INFO step (\d+)/\d+ loss \S+ aux \S+ (\d+) tok/s",
    re.MULTILINE,
)


def say(text: str) -> None:
    print(f"[gpu-e2e] {text}", flush=True)


def job_manifest(name: str, args: argparse.Namespace, ckpt: Path, stats_from: str | None) -> dict:
    placement: dict[str, Any] = {"strategy": "TopologyAware"}
    if stats_from:
        placement["routingStatsFrom"] = {"jobName": stats_from}
    spec = _base_spec(name, args, ckpt, placement)
    if args.finetune:  # job 1 exports; job 2 fine-tunes that export on JSONL text and exports
        spec["output"] = {"path": "/output", "volume": {"hostPath": {"path": str(ckpt / name)}}}
        if stats_from:
            spec["model"] = {
                "path": "/model",
                "volume": {"hostPath": {"path": str(ckpt / stats_from)}},
            }
            spec["data"] = {
                "kind": "JSONL",
                "path": "/data",
                "volume": {"hostPath": {"path": str(ckpt / "jsonl")}},
            }
    return {
        "apiVersion": f"{C.GROUP}/{C.VERSION}",
        "kind": C.KIND,
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def write_jsonl(directory: Path, max_bytes: int = 8_000_000) -> Path:
    """A JSONL data set of real text (``{"text": ...}`` per document) from the trainer's corpus."""
    from moe_trainer.inputs.corpus import iter_texts

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "corpus.jsonl"
    with path.open("w") as f:
        for doc in iter_texts(max_bytes):
            f.write(json.dumps({"text": doc}) + "\n")
    return path


def _base_spec(name: str, args: argparse.Namespace, ckpt: Path, placement: dict) -> dict:
    return {
        "image": "moe-trainer:local",
        "device": args.device,
        "model": {"hfConfig": preset_hf_config(args.model)},
        "checkpoint": {
            "everySteps": args.steps,
            "volume": {"hostPath": {"path": str(ckpt)}},
        },
        "nodes": {"count": 1, "gpusPerNode": args.gpus},
        "placement": placement,
        "training": {
            "steps": args.steps,
            "seqLen": args.seq_len,
            "globalBatch": args.micro_batch * args.gpus,
            "microBatch": args.micro_batch,
            "warmupSteps": 2,
        },
    }


def stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def watch_job(kube: Kube, name: str, timeout: float) -> dict[str, Any]:
    """Poll the job until it ends; the wall time each phase and each progress step was first
    seen (seconds after the call)."""
    t0 = time.monotonic()
    phases: dict[str, float] = {}
    first_step_seen = None
    job: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout:
        job = kube.custom.get_namespaced_custom_object(
            C.GROUP, C.VERSION, "default", C.PLURAL, name
        )
        st = job.get("status") or {}
        phase = st.get("phase", "Pending")
        now = round(time.monotonic() - t0, 2)
        if phase not in phases:
            phases[phase] = now
            say(f"{name}: {now:7.1f}s phase {phase}")
        step = (st.get("progress") or {}).get("step") or 0
        if step >= 1 and first_step_seen is None:
            first_step_seen = now
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.25)
    return {
        "phasesFirstSeenSeconds": phases,
        "firstStepInStatusSeconds": first_step_seen,
        "job": job,
    }


def gate_failure(job: dict[str, Any]) -> str | None:
    """The UpgradeVerified=False message of a job the gate blocked, else None."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "UpgradeVerified" and c.get("status") == "False":
            return f"{c.get('reason')}: {c.get('message')}"
    return None


def wait_gone(kube: Kube, name: str, timeout: float = 120) -> None:
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kube.custom.get_namespaced_custom_object(C.GROUP, C.VERSION, "default", C.PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{name} not deleted after {timeout:.0f}s")


def log_steps(text: str) -> list[tuple[datetime, int, float]]:
    """(time, step, tokens/s) of rank 0's step lines."""
    out = []
    for ts, step, rate in STEP_RE.findall(text):
        t = datetime.strptime(ts, "%Y-%m-%d %H:%M:%S,%f")
        out.append((t, int(step), float(rate)))
    return out


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def steady_rate(steps: list[tuple[datetime, int, float]]) -> float | None:
    """Median of the logged rates after step 10 (each is the rate over the last 10 steps)."""
    return median([r for _, s, r in steps if s > 10])


def collect(kube: Kube, agent: NodeAgent, name: str, out: Path) -> dict[str, Any]:
    """Status, Events, every child (as ``kubectl get -o yaml`` prints it), trainer logs."""
    api = kube.core.api_client
    sel = f"{C.LABEL_JOB}={name}"
    children: dict[str, list[Any]] = {
        "pods": kube.core.list_namespaced_pod("default", label_selector=sel).items,
        "configmaps": kube.core.list_namespaced_config_map("default", label_selector=sel).items,
        "services": kube.core.list_namespaced_service("default", label_selector=sel).items,
        "serviceaccounts": kube.core.list_namespaced_service_account(
            "default", label_selector=sel
        ).items,
        "jobs": kube.batch.list_job_for_all_namespaces().items,  # the gate's smoke Jobs
    }
    docs = {k: [api.sanitize_for_serialization(o) for o in v] for k, v in children.items()}
    job = kube.custom.get_namespaced_custom_object(C.GROUP, C.VERSION, "default", C.PLURAL, name)
    events = kube.core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={name}"
    ).items
    ev = [
        {
            "type": e.type,
            "reason": e.reason,
            "message": e.message,
            "count": e.count,
            "first": str(e.first_timestamp),
            "last": str(e.last_timestamp),
        }
        for e in events
    ]
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    (d / "events.yaml").write_text(yaml.safe_dump(ev, sort_keys=False))
    for kind, items in docs.items():
        (d / f"{kind}.yaml").write_text(yaml.safe_dump_all(items, sort_keys=False))
    logs = {}
    for pod in docs["pods"]:
        pname = pod["metadata"]["name"]
        try:
            logs[pname] = agent.read_log("default", pname)
        except (FileNotFoundError, ValueError):
            continue
        (d / f"log-{pname}.txt").write_text(logs[pname])
    for cm in docs["configmaps"]:
        if cm["metadata"]["name"] == f"{name}-plan":
            (d / "plan.json").write_text((cm.get("data") or {}).get(C.PLAN_KEY, ""))
    return {
        "job": job,
        "events": ev,
        "logs": logs,
        "configmaps": docs["configmaps"],
        "pods": docs["pods"],
    }


def plan_and_memory(configmaps: list[dict], name: str) -> dict[str, Any]:
    """The plan's placement (without the permutation) and memory estimate beside the peak the
    trainer measured (torch.cuda.max_memory_allocated / reserved per rank)."""
    data = {cm["metadata"]["name"]: cm.get("data") or {} for cm in configmaps}
    plan = json.loads(data.get(f"{name}-plan", {}).get(C.PLAN_KEY) or "{}")
    prog = json.loads(data.get(f"{name}-progress", {}).get(C.PROGRESS_KEY) or "{}")
    placement = {k: v for k, v in (plan.get("placement") or {}).items() if k != "permutation"}
    est = (plan.get("memory") or {}).get("estimatedPeakBytes")
    moe = prog.get("moe") or {}
    alloc = moe.get("peakMemoryAllocatedBytesByRank") or []
    reserved = moe.get("peakMemoryReservedBytesByRank") or []
    return {
        "placement": placement,
        "ranks": plan.get("ranks"),
        "estimatedPeakBytes": est,
        "measuredPeakAllocatedBytes": max(alloc) if alloc else None,
        "measuredPeakReservedBytes": max(reserved) if reserved else None,
        "estimateOverMeasuredReserved": (
            round(est / max(reserved), 3) if est and reserved and max(reserved) else None
        ),
    }


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def direct_run(
    worker_pod: dict, plan_json: str, work: Path, gpu_uuids: str, ckpt: Path
) -> dict[str, Any]:
    """The worker container's command started by hand on the same plan, with the same env less
    what needs the API server (progress and routing-statistics ConfigMaps, metrics port); its
    checkpoints in ``ckpt`` (the jobs' checkpoint volume: the same storage as the job's)."""
    plan = work / "direct-plan.json"
    plan.write_text(plan_json)
    c = worker_pod["spec"]["containers"][0]
    argv = [*(c.get("command") or []), *(c.get("args") or [])]
    env = dict(os.environ)
    env.pop(FAKE_NVML_ENV, None)
    env.update({e["name"]: e["value"] for e in c.get("env") or [] if "value" in e})
    for key in ("MOE_PROGRESS_CONFIGMAP", "MOE_ROUTING_STATS_CONFIGMAP", "MOE_METRICS_PORT"):
        env.pop(key, None)
    (port,) = free_ports(1)
    env.update(
        PATH=f"{Path(sys.prefix) / 'bin'}:{env.get('PATH', '')}",
        MOE_PLAN=str(plan),
        MOE_CHECKPOINT_DIR=str(ckpt),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES=gpu_uuids,
        NVIDIA_VISIBLE_DEVICES=gpu_uuids,
    )
    t_start = datetime.now(UTC).replace(tzinfo=None)
    t0 = time.monotonic()
    res = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    log_text = res.stdout + res.stderr
    (work / "direct-train.log").write_text(log_text)
    shutil.rmtree(ckpt, ignore_errors=True)
    steps = log_steps(log_text)
    return {
        "argv": argv,
        "exit": res.returncode,
        "wallSeconds": round(wall, 1),
        "startToFirstStepSeconds": (
            round((steps[0][0] - t_start).total_seconds(), 2) if steps else None
        ),
        "lastLoggedTokensPerSecond": steps[-1][2] if steps else None,
        "medianTokensPerSecondAfterStep10": steady_rate(steps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/moe-gpu-e2e"))
    ap.add_argument("--model", default="bench-mixtral-3b")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs per node the jobs ask for")
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--skip-direct", action="store_true")
    ap.add_argument(
        "--on-gate-failure",
        choices=("stop", "skip"),
        default="stop",
        help="skip: when the smoke test blocks job 1, keep its verdict and run the rest of the "
        "flow with gate.skip (the skip is audited in the job)",
    )
    ap.add_argument(
        "--finetune",
        action="store_true",
        help="job 1 exports the trained model; job 2 fine-tunes that export (spec.model.path) on "
        "a JSONL data set and exports again",
    )
    ap.add_argument(
        "--checkpoints",
        type=Path,
        help="the jobs' checkpoint hostPath (default WORK/checkpoints; a 3.4 B model's final "
        "ZeRO-3 checkpoint with its optimizer state is tens of GB: a tmpfs writes it in seconds)",
    )
    ap.add_argument("--crd", type=Path, default=ROOT / "crds" / "moetrainingjob.yaml")
    ap.add_argument(
        "--fixture",
        default=REAL_NVML,
        help="the node's GPUs: 'nvml' (real) or an NVML recording (a dry run on a CPU machine)",
    )
    ap.add_argument("--device", choices=("GPU", "CPU"), default="GPU")
    ap.add_argument("--skip-second", action="store_true")
    args = ap.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    coll = args.work / "collected"
    ckpt = args.checkpoints or args.work / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    if args.finetune:
        write_jsonl(ckpt / "jsonl")
    gpus = read_gpus(args.fixture)
    jobs = [("gpu-e2e-1", None)] + ([] if args.skip_second else [("gpu-e2e-2", "gpu-e2e-1")])
    summary: dict[str, Any] = {
        "kind": "GpuE2E",
        "gpus": [{"index": g.index, "name": g.name, "memoryBytes": g.memory_bytes} for g in gpus],
        "shape": {
            "model": args.model,
            "seqLen": args.seq_len,
            "microBatch": args.micro_batch,
            "gpusPerNode": args.gpus,
            "steps": args.steps,
        },
        "startedAt": stamp(),
    }
    cp = ControlPlane(args.work / "controlplane").start()
    agent = operator = None
    worker_pod: dict[str, Any] = {}
    try:
        summary["controlPlaneStartSeconds"] = round(cp.startup_seconds, 1)
        say(f"control plane ready in {cp.startup_seconds:.1f}s")
        kube = Kube.from_api_client(cp.api_client())
        crd = yaml.safe_load(args.crd.read_text())

        ApiextensionsV1Api(kube.api_client).create_custom_resource_definition(crd)
        agent = NodeAgent(
            cp.api_client(),
            [NodeSpec(NODE, args.fixture, cpu=str(os.cpu_count()), memory="120Gi")],
            run_dir=args.work / "nodeagent",
            api_server=cp.server,
        ).start()
        (metrics_port,) = free_ports(1)
        env = dict(
            os.environ,
            KUBECONFIG=str(cp.kubeconfig),
            MOE_ALLOWED_HOST_PATH_PREFIXES=str(ckpt),
        )
        operator = procs.spawn(
            operator_command(metrics_port=metrics_port),
            args.work / "operator.log",
            env=env,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # ready: metrics served and the SA token exists
            try:
                scrape(metrics_port)
                if kube.core.read_namespaced_service_account("default", "default").secrets:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.25)
        for name, stats_from in jobs:
            body = job_manifest(name, args, ckpt, stats_from)
            kube.custom.create_namespaced_custom_object(
                C.GROUP, C.VERSION, "default", C.PLURAL, body
            )
            applied = datetime.now(UTC).replace(tzinfo=None)
            watched = watch_job(kube, name, args.timeout)
            gate_failed = gate_failure(watched["job"])
            if gate_failed and args.on_gate_failure == "skip":
                # the verdict is kept (collected below); the rest of the flow still runs, with the
                # gate skipped and the skip audited in the job
                summary[f"{name}-gate-failure"] = gate_failed
                collect(kube, agent, name, coll / "gate-failed")
                say(f"{name}: the gate blocked it ({gate_failed}); again with gate.skip")
                kube.custom.delete_namespaced_custom_object(
                    C.GROUP, C.VERSION, "default", C.PLURAL, name
                )
                wait_gone(kube, name)
                body["spec"]["gate"] = {
                    "skip": True,
                    "skipReason": f"gpu_e2e: the smoke test failed first ({gate_failed[:200]})",
                }
                kube.custom.create_namespaced_custom_object(
                    C.GROUP, C.VERSION, "default", C.PLURAL, body
                )
                applied = datetime.now(UTC).replace(tzinfo=None)
                watched = watch_job(kube, name, args.timeout)
            got = collect(kube, agent, name, coll)
            st = got["job"].get("status") or {}
            worker_logs = [t for p, t in got["logs"].items() if "-worker-" in p]
            worker_pod = next(
                (p for p in got["pods"] if p["metadata"]["name"].startswith(f"{name}-worker-")),
                worker_pod,
            )
            steps = log_steps(worker_logs[0]) if worker_logs else []
            summary[name] = {
                "phase": st.get("phase"),
                "phasesFirstSeenSeconds": watched["phasesFirstSeenSeconds"],
                "conditions": st.get("conditions"),
                "progress": st.get("progress"),
                "applyToFirstStepSeconds": (
                    round((steps[0][0] - applied).total_seconds(), 2) if steps else None
                ),
                "firstStepInStatusSeconds": watched["firstStepInStatusSeconds"],
                "workerMedianTokensPerSecondAfterStep10": steady_rate(steps),
                "workerLastLoggedTokensPerSecond": steps[-1][2] if steps else None,
                "events": [f"{e['type']} {e['reason']}: {e['message']}" for e in got["events"]],
                "model": st.get("model"),
                "data": st.get("data"),
                "output": st.get("output"),
                "exportLog": [ln for t in worker_logs for ln in t.splitlines() if "export" in ln],
            }
            summary[name].update(plan_and_memory(got["configmaps"], name))
            for job_dir in ckpt.glob(f"{name}-*"):  # the optimizer state is tens of GB
                shutil.rmtree(job_dir / "ds", ignore_errors=True)
            say(f"{name}: {st.get('phase')} progress {st.get('progress')}")
            if name == "gpu-e2e-1" and not args.skip_direct:
                # right after job 1 (also with --skip-second): the same plan, the same GPU
                plan_text = (coll / "gpu-e2e-1" / "plan.json").read_text()
                say("the worker's command started directly on job 1's plan")
                uuids = ",".join(g.uuid for g in gpus[: args.gpus])
                summary["direct"] = direct_run(
                    worker_pod, plan_text, args.work, uuids, ckpt / "direct"
                )
                (coll / "direct-train.log").write_text((args.work / "direct-train.log").read_text())
                say(f"direct: {summary['direct']}")
        (coll / "metrics.txt").write_text(scrape(metrics_port))
        for cm in kube.core.list_config_map_for_all_namespaces().items:
            n = cm.metadata.name
            if n.startswith("moe-topology-"):
                (args.out / "topology.json").write_text(cm.data.get("topology.json", ""))
            if "verdict" in n or n.startswith("moe-gate"):
                (coll / f"cm-{n}.yaml").write_text(
                    yaml.safe_dump(kube.core.api_client.sanitize_for_serialization(cm))
                )
    finally:
        if operator is not None:
            procs.stop(operator)
            shutil.copy(args.work / "operator.log", coll / "operator.log")
        if agent is not None:
            agent.stop()
        cp.stop()
        summary["finishedAt"] = stamp()
        (args.out / "gpu_e2e.json").write_text(json.dumps(summary, indent=1, default=str))
        if coll.exists():
            with tarfile.open(args.out / "collected.tar.gz", "w:gz") as tar:
                tar.add(coll, arcname="collected")
    ok = all(summary.get(n, {}).get("phase") == "Succeeded" for n, _ in jobs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
