"""The operator benchmark against a floor measured in the same run: the same child objects created
by a plain client, at the same concurrency, against the same API server.

    .venv/bin/python benchmarks/operator_floor.py [--runs 3] [--jobs 100] [--out benchmarks/results]

Each run starts one control plane (kube-apiserver v1.20.2 + etcd + controller manager) and one
operator (``moectl operator -n bench``: it watches only the namespace of its phase), set up as
``operator_bench.py`` sets it up (two fake GPU nodes, cached topology, gate off, workers that
are created and never scheduled), and then two bursts of ``--jobs`` tiny CPU jobs, each applied
from 8 client threads:

- operator phase (namespace ``bench``): the operator launches the jobs (operator_bench.py);
- floor phase (namespace ``floor``): this process creates each job's children itself as soon as
  the job's create returns: 8 threads (the operator's handler threads), each object batch sent
  concurrently through a 16-thread pool (the operator's ``create_all``), in the operator's
  order and batches: plan ConfigMap + ServiceAccount, then the worker pods; once every job has
  its pods the rest (Role, then Service, progress and routing-stats ConfigMaps, RoleBinding),
  then the status patch; the Events after the burst. Which objects: a real reconcile pass of the
  operator (``reconcile.job.reconcile``) over the job as a server dry-run create returned it,
  with a client that records its writes instead of sending them (its reads go to the server),
  so the floor sends exactly what the operator would, from the operator's own code.

Both phases are timed the same way (operator_bench.py): per job, the later of its two worker
pods' ADDED watch events minus the moment its create request was sent (and apply -> the job's
first watch event with ``status.gangComplete``). The phases alternate their order from run to run
(floor first in odd runs) so that a machine's drift does not favour one. Per phase: the 1-min load
average before it, p50/p99, API requests by verb and resource from its first create to its last
launch + 1 s (all clients), CPU of this process, of the operator and of the control plane; per
run the operator's p50/p99 as ratios to the floor's. Writes ``operator_floor.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from moe_localkube import procs
from moe_localkube.controlplane import ControlPlane
from moe_localkube.testing import Kube, create_namespace, operator_command
from moejob_operator import constants as C
from moejob_operator.reconcile.client import CREATE_THREADS, Client
from moejob_operator.reconcile.job import reconcile
from moejob_operator.reconcile.settings import Settings
from operator_bench import (
    GC_DISCOVERY_SECONDS,
    calibration_cpu_seconds,
    cpu_model,
    cpu_seconds,
    percentile,
    register_nodes,
    request_counts,
    row,
    stamp_first,
)
from operator_harness import install_crd, seed_topology

OP_NS, FLOOR_NS = "bench", "floor"
APPLY_THREADS = 8  # the benchmark's client threads (operator_bench.py)
FLOOR_THREADS = 8  # the operator's handler threads (moectl operator --workers default)
OPERATOR_ENV = {
    "MOE_GATE_ENABLED": "false",
    "MOE_ALLOWED_HOST_PATH_PREFIXES": "/tmp/moe-checkpoints",
}
STATUS = "status"  # a recorded write: the job's status patch


class Recorder(Client):
    """The operator's client with its writes recorded instead of sent: ``batches`` holds each
    create / create_all call (objects sent together) and the status patch, in order; ``events``
    the Events. Reads go to the API server."""

    def __init__(self, api) -> None:
        super().__init__(api)
        self.batches: list[list[dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []

    def create(self, obj: dict[str, Any]) -> bool:
        self.batches.append([copy.deepcopy(obj)])
        return True

    def create_all(
        self, objs: list[dict[str, Any]], *, claim: Sequence[dict[str, Any]] = ()
    ) -> list[bool]:
        # ``claim``: reads of names the pass creates later (nothing held here), not writes
        self.batches.append(copy.deepcopy(objs))
        return [True] * len(objs)

    def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.batches.append([{"kind": STATUS, "name": name, "status": copy.deepcopy(status)}])

    def event(self, job: dict[str, Any], etype: str, reason: str, message: str) -> None:
        self.events.append(self._event_body(job, etype, reason, message))


def capture(api, kube: Kube, body: dict[str, Any]) -> dict[str, Any]:
    """The writes one operator pass makes to launch ``body`` (a new job in FLOOR_NS), from a
    server dry-run create of it (the defaulted object, with a uid that the real create's uid
    replaces). Returns {"uid", "batches", "events"}."""
    dry = kube.custom.create_namespaced_custom_object(
        C.GROUP, C.VERSION, FLOOR_NS, C.PLURAL, body, dry_run="All"
    )
    rec = Recorder(api)
    settings = Settings.from_env(OPERATOR_ENV)
    reconcile(rec, FLOOR_NS, body["metadata"]["name"], settings=settings, body=dry)
    kinds = [o["kind"] for b in rec.batches for o in b]
    if kinds.count("Pod") < 2 or STATUS not in kinds:
        raise SystemExit(f"the recorded pass did not launch {body['metadata']['name']}: {kinds}")
    return {"uid": dry["metadata"]["uid"], "batches": rec.batches, "events": rec.events}


def with_uid(writes: dict[str, Any], uid: str) -> dict[str, Any]:
    """``writes`` with the dry run's uid replaced by the created job's (ownerReferences, ...)."""
    return json.loads(json.dumps(writes).replace(writes["uid"], uid))


class PlainClient:
    """A plain kubernetes client: one create per object, raw responses (no model decoding)."""

    def __init__(self, api) -> None:
        self.core = k8s.CoreV1Api(api)
        self.rbac = k8s.RbacAuthorizationV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.pool = cf.ThreadPoolExecutor(CREATE_THREADS, thread_name_prefix="floor-create")
        self.retries = 0  # creates refused with "retry" (1.20: ServiceAccount token not yet made)

    def send(self, obj: dict[str, Any]) -> None:
        if obj["kind"] == STATUS:
            _ = self.custom.patch_namespaced_custom_object_status(
                C.GROUP,
                C.VERSION,
                FLOOR_NS,
                C.PLURAL,
                obj["name"],
                {"status": obj["status"]},
                _preload_content=False,
            ).data  # read: a connection goes back to the pool only with its body consumed
            return
        fn = {
            "ConfigMap": self.core.create_namespaced_config_map,
            "Service": self.core.create_namespaced_service,
            "Pod": self.core.create_namespaced_pod,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "Event": self.core.create_namespaced_event,
        }[obj["kind"]]
        while True:
            try:
                _ = fn(FLOOR_NS, obj, _preload_content=False).data  # read, as above
                return
            except ApiException as exc:
                if exc.status in (429, 500, 503) and "retry" in (exc.body or "").lower():
                    self.retries += 1
                    time.sleep(0.05)
                    continue
                raise

    def send_all(self, objs: list[dict[str, Any]]) -> None:
        for f in [self.pool.submit(self.send, o) for o in objs]:
            f.result()


class Watches:
    """First ADDED event of each worker pod and first job event with ``status.gangComplete``,
    keyed "namespace/name", stamped on arrival (raw watch lines, as operator_bench.py does)."""

    def __init__(self, kube: Kube) -> None:
        self.pods: dict[str, float] = {}
        self.launched: dict[str, float] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        for ns in (OP_NS, FLOOR_NS):
            self._start(
                lambda ns=ns: kube.core.list_namespaced_pod(
                    ns,
                    label_selector=f"{C.LABEL_COMPONENT}=worker",
                    watch=True,
                    timeout_seconds=900,
                    _preload_content=False,
                ),
                lambda ev: ev.get("type") == "ADDED",
                self.pods,
            )
            self._start(
                lambda ns=ns: kube.custom.list_namespaced_custom_object(
                    C.GROUP,
                    C.VERSION,
                    ns,
                    C.PLURAL,
                    watch=True,
                    timeout_seconds=900,
                    _preload_content=False,
                ),
                lambda ev: "gangComplete" in ((ev.get("object") or {}).get("status") or {}),
                self.launched,
            )

    def _start(self, start_watch: Callable, wanted: Callable, into: dict[str, float]) -> None:
        threading.Thread(
            target=stamp_first,
            args=(start_watch, wanted, into, self.lock, self.done),
            kwargs={"key": lambda meta: f"{meta['namespace']}/{meta['name']}"},
            daemon=True,
        ).start()

    def wait(self, keys: list[str], into: dict[str, float], deadline: float) -> None:
        while time.monotonic() < deadline:
            with self.lock:
                if all(k in into for k in keys):
                    return
            time.sleep(0.02)

    def pods_of(self, ns: str, name: str) -> float | None:
        with self.lock:
            t = [self.pods.get(f"{ns}/{name}-worker-{r}") for r in (0, 1)]
        return None if None in t else max(t)  # type: ignore[type-var]


def job_body(base: dict[str, Any], name: str) -> dict[str, Any]:
    d = copy.deepcopy(base)
    d["metadata"] = {"name": name}
    return d


def phase(kind: str, ctx: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """One burst of ``names`` in the phase's namespace; the operator's or the floor's launch."""
    kube, w, cp, op = ctx["kube"], ctx["watches"], ctx["cp"], ctx["op"]
    ns = OP_NS if kind == "operator" else FLOOR_NS
    floor: PlainClient | None = ctx["plain"] if kind == "floor" else None
    writes = ctx["writes"]
    work: queue.Queue = queue.Queue()
    rest: list[tuple[str, list[list[dict[str, Any]]]]] = []
    pods_sent = threading.Semaphore(0)
    errors: list[Exception] = []

    def floor_worker() -> None:  # the floor's launch, up to the pods; the rest waits
        assert floor is not None
        while (item := work.get()) is not None:
            name, uid = item
            try:
                batches = with_uid(writes[name], uid)["batches"]
                first_pods = next(i for i, b in enumerate(batches) if b[0]["kind"] == "Pod")
                for b in batches[: first_pods + 1]:
                    floor.send_all(b)
                rest.append((name, batches[first_pods + 1 :]))
            except Exception as exc:  # noqa: BLE001 - reported by the phase
                errors.append(exc)
            finally:
                pods_sent.release()

    threads = [threading.Thread(target=floor_worker) for _ in range(FLOOR_THREADS if floor else 0)]
    for t in threads:
        t.start()
    load = os.getloadavg()[0]
    calibration = calibration_cpu_seconds()
    cp_pids = {n: p.pid for n, p in cp._procs.items()}
    cp_before = {n: cpu_seconds(p) for n, p in cp_pids.items()}
    op_before, me_before = cpu_seconds(op.pid), cpu_seconds(os.getpid())
    req_before = request_counts(cp)
    applied: dict[str, float] = {}

    def apply(name: str) -> None:
        applied[name] = time.monotonic()
        if floor is None:
            kube.custom.create_namespaced_custom_object(
                C.GROUP, C.VERSION, ns, C.PLURAL, job_body(ctx["base"], name)
            )
            return
        resp = floor.custom.create_namespaced_custom_object(
            C.GROUP, C.VERSION, ns, C.PLURAL, job_body(ctx["base"], name), _preload_content=False
        )
        work.put((name, json.loads(resp.data)["metadata"]["uid"]))

    start = time.monotonic()
    with cf.ThreadPoolExecutor(APPLY_THREADS) as pool:
        list(pool.map(apply, names))
    deadline = start + 300
    if floor is not None:
        for _ in names:
            pods_sent.acquire()
        for _ in threads:
            work.put(None)
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"floor: {len(errors)} job(s) failed") from errors[0]
        with cf.ThreadPoolExecutor(FLOOR_THREADS) as pool:  # Role, then the rest, then status
            list(pool.map(lambda r: [floor.send_all(b) for b in r[1]], rest))
    keys = [f"{ns}/{n}-worker-{r}" for n in names for r in (0, 1)]
    w.wait(keys, w.pods, deadline)
    w.wait([f"{ns}/{n}" for n in names], w.launched, deadline)
    last_launch = time.monotonic() - start
    if floor is not None:  # the Events, after the burst (the operator's poster yields too)
        for n in names:
            floor.send_all(writes[n]["events"])
    time.sleep(1.0)  # the last Events go out
    lat = {n: t - applied[n] for n in names if (t := w.pods_of(ns, n)) is not None}
    with w.lock:
        full = [w.launched[f"{ns}/{n}"] - applied[n] for n in names if f"{ns}/{n}" in w.launched]
    req = {
        k: int(v - req_before.get(k, 0))
        for k, v in request_counts(cp).items()
        if v - req_before.get(k, 0) >= 1
    }
    values = list(lat.values())
    return {
        "phase": kind,
        "namespace": ns,
        "jobs": len(names),
        "completed": len(lat),
        "loadAverage1mBefore": round(load, 2),
        "calibrationCpuSeconds": calibration,
        "p50Seconds": round(percentile(values, 50), 3) if values else None,
        "p99Seconds": round(percentile(values, 99), 3) if values else None,
        "meanSeconds": round(statistics.mean(values), 3) if values else None,
        "launchCompleted": len(full),
        "launchP50Seconds": round(percentile(full, 50), 3) if full else None,
        "launchP99Seconds": round(percentile(full, 99), 3) if full else None,
        "lastLaunchSeconds": round(last_launch, 3),
        "operatorCpuSeconds": round(cpu_seconds(op.pid) - op_before, 2),
        "benchmarkProcessCpuSeconds": round(cpu_seconds(os.getpid()) - me_before, 2),
        "controlPlaneCpuSeconds": {
            n: round(cpu_seconds(p) - cp_before[n], 2) for n, p in cp_pids.items()
        },
        "floorCreateRetries": floor.retries if floor is not None else None,
        "apiRequests": dict(sorted(req.items(), key=lambda kv: -kv[1])),
        "apiRequestsTotal": sum(req.values()),
        "apiRequestsPerJob": round(sum(req.values()) / len(names), 2),
    }


def run(jobs: int, workdir: Path, floor_first: bool) -> dict[str, Any]:
    cp = ControlPlane(workdir / "cp").start()
    op = None
    try:
        api = cp.api_client()
        kube = Kube.from_api_client(api)
        install_crd(kube)
        crd_installed = time.monotonic()
        register_nodes(kube)
        for ns in (OP_NS, FLOOR_NS):
            create_namespace(kube, ns)
            seed_topology(kube, ns)
        command = [("-n" if a == "-A" else a) for a in operator_command()]
        command.insert(command.index("-n") + 1, OP_NS)
        env = dict(os.environ, KUBECONFIG=str(cp.kubeconfig), **OPERATOR_ENV)
        op = procs.spawn(command, workdir / "operator.log", env=env)
        base = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
        base["spec"]["scheduling"] = {"schedulerName": "benchmark-no-scheduler"}
        watches = Watches(kube)
        ctx: dict[str, Any] = {"kube": kube, "watches": watches, "cp": cp, "op": op, "base": base}
        # what the operator would write for each floor job (untimed; its reads hit the server)
        names = [f"job-{i:03d}" for i in range(jobs)]
        ctx["writes"] = {n: capture(api, kube, job_body(base, n)) for n in ["warmup", *names]}
        time.sleep(2.0)  # the operator and the watches up
        # warm-up, one job each way (not measured): imports, connections
        kube.custom.create_namespaced_custom_object(
            C.GROUP, C.VERSION, OP_NS, C.PLURAL, job_body(base, "warmup")
        )
        watches.wait(
            [f"{OP_NS}/warmup-worker-0", f"{OP_NS}/warmup-worker-1"],
            watches.pods,
            time.monotonic() + 120,
        )
        if watches.pods_of(OP_NS, "warmup") is None:
            raise SystemExit(f"warm-up job never got its workers: see {workdir / 'operator.log'}")
        ctx["plain"] = PlainClient(cp.api_client())
        phase("floor", ctx, ["warmup"])
        # the garbage collector's CRD discovery (operator_bench.py): both phases after it
        time.sleep(max(0.0, GC_DISCOVERY_SECONDS - (time.monotonic() - crd_installed)))
        phases = {}
        for kind in ("floor", "operator") if floor_first else ("operator", "floor"):
            ctx["plain"] = PlainClient(cp.api_client())
            phases[kind] = phase(kind, ctx, names)
        watches.done.set()
        fl, opr = phases["floor"], phases["operator"]
        return {
            "order": "floor, operator" if floor_first else "operator, floor",
            "cpus": os.cpu_count(),
            "cpuModel": cpu_model(),
            "python": sys.version.split()[0],
            "floor": fl,
            "operator": opr,
            "ratios": {k: ratio(opr[k], fl[k]) for k in RATIO_KEYS},
            "floorWrites": [[o["kind"] for o in b] for b in ctx["writes"][names[0]]["batches"]],
        }
    finally:
        if op is not None:
            procs.stop(op)
        cp.stop()


RATIO_KEYS = (
    "p50Seconds",
    "p99Seconds",
    "launchP50Seconds",
    "launchP99Seconds",
    "apiRequestsPerJob",
)
GOAL = {"p50Seconds": 1.5}  # the operator's p50 at most 1.5x the floor's


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def summarize(runs: list[dict[str, Any]], command: str) -> dict[str, Any]:
    def col(side: str, key: str) -> list:
        return [r[side][key] for r in runs]

    p50 = [r["ratios"]["p50Seconds"] for r in runs]
    return {
        "command": command,
        "runs": len(runs),
        "goal": {"p50RatioAtMost": GOAL["p50Seconds"]},
        "p50Ratio": p50,
        "p99Ratio": [r["ratios"]["p99Seconds"] for r in runs],
        "launchP50Ratio": [r["ratios"]["launchP50Seconds"] for r in runs],
        "p50RatioMedian": round(statistics.median(x for x in p50 if x is not None), 2),
        "goalMetRuns": sum(x is not None and x <= GOAL["p50Seconds"] for x in p50),
        **{f"floor_{k}": col("floor", k) for k in SUMMARY_KEYS},
        **{f"operator_{k}": col("operator", k) for k in SUMMARY_KEYS},
    }


SUMMARY_KEYS = ("loadAverage1mBefore", "p50Seconds", "p99Seconds", "apiRequestsPerJob")


REQUESTS_TITLE = (
    "API requests by verb and resource, run 1 (all clients, first create -> last launch + 1 s):"
)


def markdown(doc: dict[str, Any]) -> str:
    s, runs = doc["summary"], doc["runs"]
    header = [
        "run (order)",
        "phase",
        "load before",
        "p50",
        "p99",
        "launch p50 / p99",
        "requests per job",
        "operator CPU",
        "this process CPU",
    ]
    lines = [
        "# Operator benchmark against a floor measured in the same run",
        "",
        (
            f"{runs[0]['floor']['jobs']} tiny CPU jobs (2 worker pods each) applied from 8 "
            f"client threads per phase, against one local v1.20.2 control plane per run on a "
            f"{runs[0]['cpus']}-core machine ({runs[0]['cpuModel']}) shared with other work. "
            f"Floor: the same children (from a recorded operator pass) created by a plain "
            f"client, 8 threads. "
            f"Command: `{s['command']}`."
        ),
        "",
        (
            f"Operator p50 / floor p50 per run: {s['p50Ratio']} (median "
            f"{s['p50RatioMedian']}; goal <= {s['goal']['p50RatioAtMost']}: met in "
            f"{s['goalMetRuns']} of {s['runs']}); p99 "
            f"ratio {s['p99Ratio']}; launch-in-status p50 ratio {s['launchP50Ratio']}."
        ),
        "",
        row(*header),
        row(*["---"] * len(header)),
    ]
    for i, r in enumerate(runs, 1):
        for side in ("floor", "operator"):
            x = r[side]
            lines.append(
                row(
                    f"{i} ({r['order']})",
                    side,
                    x["loadAverage1mBefore"],
                    f"{x['p50Seconds']} s",
                    f"{x['p99Seconds']} s",
                    f"{x['launchP50Seconds']} / {x['launchP99Seconds']} s",
                    x["apiRequestsPerJob"],
                    f"{x['operatorCpuSeconds']} s",
                    f"{x['benchmarkProcessCpuSeconds']} s",
                )
            )
    r = runs[0]
    lines += [
        "",
        "Writes per job, in the operator's batches (objects in one batch sent concurrently): "
        + " -> ".join("[" + ", ".join(b) + "]" for b in r["floorWrites"]),
        "",
        REQUESTS_TITLE,
        "",
        row("request", "floor", "operator", "operator - floor"),
        row("---", "---", "---", "---"),
    ]
    fl, opr = r["floor"]["apiRequests"], r["operator"]["apiRequests"]
    for k in sorted(set(fl) | set(opr), key=lambda k: -opr.get(k, 0)):
        lines.append(row(k, fl.get(k, 0), opr.get(k, 0), opr.get(k, 0) - fl.get(k, 0)))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--workdir", help="keep the control plane's and the operator's logs here")
    args = ap.parse_args()
    if args.runs < 1 or args.jobs < 1:
        ap.error("--runs and --jobs must be at least 1")
    command = ".venv/bin/python benchmarks/operator_floor.py" + "".join(
        f" {flag} {value}"
        for flag, value, default in (("--jobs", args.jobs, 100), ("--runs", args.runs, 3))
        if value != default
    )
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="moe-opfloor-") as tmp:
            work = Path(args.workdir) / f"run-{i + 1}" if args.workdir else Path(tmp)
            r = run(args.jobs, work, floor_first=i % 2 == 0)
        runs.append(r)
        print(
            f"run {i + 1}/{args.runs} ({r['order']}): floor p50 {r['floor']['p50Seconds']} s "
            f"p99 {r['floor']['p99Seconds']} s (load {r['floor']['loadAverage1mBefore']}); "
            f"operator p50 {r['operator']['p50Seconds']} s p99 {r['operator']['p99Seconds']} s "
            f"(load {r['operator']['loadAverage1mBefore']}); ratios {r['ratios']}",
            flush=True,
        )
    doc = {"summary": summarize(runs, command), "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "operator_floor.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "operator_floor.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
