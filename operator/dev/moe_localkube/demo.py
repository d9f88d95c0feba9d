"""``moe-demo`` (``scripts/dev.sh demo``): a whole MoETrainingJob on this machine, end to end.

Starts the local control plane (kube-apiserver v1.20.2 + etcd + controller manager + scheduler),
the node agent playing the kubelet for two fake 8-GPU nodes, and the operator (``moectl operator``);
``kubectl apply -f examples/tiny-cpu.yaml`` (tiny Mixtral, CPU, 2 node ranks, DeepSpeed ZeRO-3 +
AutoEP); waits for ``Succeeded``; prints ``kubectl get moejob`` and ``kubectl describe``, and
where the expert-load heatmap and routing statistics are. Then the closed loop (``demo_loop``):
job 1 runs with DeepSpeed's own expert layout and all-to-all (contiguous, AutoEP) on real text;
job 2, the same job planned from job 1's routing statistics (``routingStatsFrom``, topology-aware
placement, de-duplicating dispatcher), runs to ``Succeeded`` and the demo prints both jobs'
cross-group bytes, predicted and counted over the run (``closed_loop.json``, ``closed_loop.png``);
--quick runs the example as written and stops after it. Logs,
checkpoints, the heatmap and the figures stay in --dir (default runs/demo). With --stay the
cluster keeps running after the jobs, for kubectl and helm through DIR/env.sh, until Ctrl-C or
``moe-demo --stop`` (``scripts/dev.sh down``).

Dev tooling (the dev package, operator/dev), not product: the operator image has no demo and
``moectl`` no ``demo`` command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from moejob_operator import constants as C

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
DEFAULT_DIR = ROOT / "runs" / "demo"
MARKER = ".moe-demo"  # a folder with this file is a demo's: a new demo may empty it
PID_FILE = "demo.pid"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-demo", description=__doc__.split("\n\n")[1].replace("\n", " ")
    )
    p.add_argument("--manifest", default=str(EXAMPLE), help="job manifest (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for Succeeded")
    p.add_argument(
        "--dir",
        "--keep",
        dest="dir",
        metavar="DIR",
        default=str(DEFAULT_DIR),
        help="logs, checkpoints, kubeconfig and env.sh go here; emptied first if an "
        "earlier demo left it (default: %(default)s)",
    )
    p.add_argument(
        "--stay",
        action="store_true",
        help="keep the cluster running after the job (until Ctrl-C or --stop)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one job only (no second job planned from the first one's routing statistics)",
    )
    p.add_argument(
        "--stop", action="store_true", help="stop the demo that --stay left running in --dir"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_demo(build_parser().parse_args(argv))


def _say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def _running_pid(work: Path) -> int | None:
    """The pid of a demo still running in ``work``, if any."""
    try:
        pid = int((work / PID_FILE).read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    return pid if cmdline.exists() and b"demo" in cmdline.read_bytes() else None


def stop_demo(work: Path, timeout: float = 120) -> int:
    pid = _running_pid(work)
    if pid is None:
        _say(f"no demo is running in {work}")
        return 0
    _say(f"stopping the demo in {work} (pid {pid})")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _running_pid(work) is None:
            _say("stopped")
            return 0
        time.sleep(0.2)
    _say(f"pid {pid} did not stop within {timeout:.0f}s")
    return 1


def _prepare(work: Path) -> None:
    """An empty ``work``: a folder an earlier demo left is emptied; anything else is refused."""
    if _running_pid(work) is not None:
        raise SystemExit(
            f"a demo is still running in {work} (pid {_running_pid(work)}): "
            f"stop it with `scripts/dev.sh down` (moe-demo --stop --dir {work})"
        )
    if work.exists() and any(work.iterdir()):
        if not (work / MARKER).exists():
            raise SystemExit(
                f"{work} is not empty and not an earlier demo's folder: choose another --dir"
            )
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("written by moe-demo; the next demo empties this folder\n")


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    work = Path(args.dir).resolve()
    if args.stop:
        return stop_demo(work)
    _prepare(work)
    signal.signal(signal.SIGTERM, _on_sigterm)  # stop what we started, as on Ctrl-C
    (work / PID_FILE).write_text(f"{os.getpid()}\n")
    try:
        return _demo(work, Path(args.manifest), args.timeout, stay=args.stay, quick=args.quick)
    except KeyboardInterrupt:
        return 130 if not args.stay else 0
    finally:
        (work / PID_FILE).unlink(missing_ok=True)


def _write_env(work: Path, kubeconfig: Path) -> Path:
    """``work/env.sh``: KUBECONFIG and the project's kubectl and helm (``work/bin``) on PATH;
    removed when the cluster stops."""
    from moe_localkube import binaries

    bindir = work / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in (binaries.kubectl_binary(), binaries.helm_binary()):
        link = bindir / tool.name
        link.unlink(missing_ok=True)
        link.symlink_to(tool)
    env = work / "env.sh"
    env.write_text(
        f"# source this file: the demo cluster in {work} (while `moe-demo --stay` runs)\n"
        f"export KUBECONFIG='{kubeconfig}'\n"
        f"export PATH='{bindir}':\"$PATH\"\n"
    )
    return env


def _show(path: Path) -> str:
    """``path`` as a person in the repository root would type it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _demo(
    work: Path, manifest: Path, timeout: float, *, stay: bool = False, quick: bool = False
) -> int:
    from kubernetes.client.rest import ApiException

    from moe_localkube import binaries, procs
    from moe_localkube.controlplane import ControlPlane
    from moe_localkube.nodeagent import NodeAgent, NodeSpec
    from moe_localkube.testing import Kube, crd_established, operator_command

    doc = yaml.safe_load(manifest.read_text())
    name = doc["metadata"]["name"]
    ckpt = work / "checkpoints"
    vol = (doc["spec"].get("checkpoint") or {}).get("volume") or {}
    if "hostPath" in vol:  # keep the demo's files with its logs
        vol["hostPath"]["path"] = str(ckpt)
    data_dir = work / "data"
    if not quick and (doc["spec"].get("data") or {}).get("kind", "Synthetic") == "Synthetic":
        from moe_localkube import demo_loop

        doc["spec"]["data"] = demo_loop.text_data(data_dir)  # both jobs train on real text
        doc = demo_loop.baseline_manifest(doc)  # job 1: DeepSpeed's own layout and all-to-all
    # JSON, not re-dumped YAML: PyYAML writes "1e-3" unquoted and kubectl reads that as a number
    applied = work / "job.json"
    applied.write_text(json.dumps(doc, indent=1))

    _say(
        "starting the local control plane (kube-apiserver v1.20.2, etcd, controller manager, "
        "scheduler)"
    )
    cp = ControlPlane(work / "controlplane").start()
    # SIGTERM unwinds like Ctrl-C, so the finally below stops the operator and the node agent
    # before the control plane (the control plane's own handler would stop it first)
    signal.signal(signal.SIGTERM, _on_sigterm)
    agent = operator = None
    try:
        _say(f"control plane ready in {cp.startup_seconds:.1f}s at {cp.server}")
        env_script = _write_env(work, cp.kubeconfig)
        _say(f"to watch from another shell: source {_show(env_script)}; kubectl get moejob -w")
        kube = Kube.from_api_client(cp.api_client())
        kubectl_env = cp.kubectl_env()
        kubectl = str(binaries.kubectl_binary())

        def k(*a: str, check: bool = True) -> str:
            res = subprocess.run(
                [kubectl, *a], env=kubectl_env, capture_output=True, text=True, timeout=120
            )
            if check and res.returncode:
                raise RuntimeError(f"kubectl {' '.join(a)}: {res.stderr.strip()}")
            return res.stdout

        # --validate=false: kubectl validates against the server's OpenAPI, and a 1.20 server
        # does not know x-kubernetes-validations (it drops the CEL rules; see docs/crd.md)
        k("apply", "--validate=false", "-f", str(ROOT / "crds" / "moetrainingjob.yaml"))
        crd_established(kube, f"{C.PLURAL}.{C.GROUP}")
        _say("starting the node agent: nodes node-a and node-b (fake NVSwitch H100 x8 topology)")
        agent = NodeAgent(
            cp.api_client(),
            [NodeSpec("node-a"), NodeSpec("node-b")],
            run_dir=work / "nodeagent",
            api_server=cp.server,
        )
        agent.start()
        _say("starting the operator (moectl operator -A --no-leader-election)")
        # the demo's checkpoints and text are hostPaths under its work dir: the ones it allows
        env = dict(
            os.environ,
            KUBECONFIG=str(cp.kubeconfig),
            MOE_ALLOWED_HOST_PATH_PREFIXES=f"{ckpt},{data_dir}",
        )
        operator = procs.spawn(
            operator_command(),
            work / "operator.log",
            env=env,
        )
        for _ in range(100):  # the default ServiceAccount needs its token before pods are admitted
            try:
                if kube.core.read_namespaced_service_account("default", "default").secrets:
                    break
            except ApiException:
                pass
            time.sleep(0.2)

        if quick:
            _say(f"kubectl apply -f {manifest}")
        else:
            _say(
                f"job 1: kubectl apply -f {manifest}, on real text with DeepSpeed's own expert "
                "layout and all-to-all (placement.strategy Contiguous, dispatcher AutoEP); it "
                "records its routing statistics"
            )
        print(k("apply", "-f", str(applied)), end="")
        _say(
            f"waiting for condition Succeeded (up to {timeout:.0f}s; the first run JIT-builds "
            "nothing but imports DeepSpeed in every pod)"
        )
        ok = _wait_job(kube, k, name, timeout)
        print("\n$ kubectl get moejob -o wide\n" + k("get", "moejob", "-o", "wide"))
        print(f"$ kubectl describe moejob {name}\n" + k("describe", "moejob", name))
        print(
            "$ kubectl get pods,configmaps -l "
            f"{C.LABEL_JOB}={name}\n" + k("get", "pods,configmaps", "-l", f"{C.LABEL_JOB}={name}")
        )
        job_dirs = sorted(ckpt.glob(f"{name}-*"))
        if job_dirs:
            d = job_dirs[-1]
            _say(
                f"expert-load heatmap:  {_show(d / 'expert_load.png')}"
                + ("" if (d / "expert_load.png").exists() else " (not written)")
            )
            _say(
                f"routing statistics:   {_show(d / C.ROUTING_STATS_KEY)} and ConfigMap "
                f"{name}-routing-stats "
                f"(plan a later job from them: spec.placement.routingStatsFrom.jobName: {name})"
            )
        if ok and not quick:
            ok = _second_job(kube, k, work, doc, name, timeout)
        _say(f"logs: operator {_show(work / 'operator.log')}, pods {_show(work / 'nodeagent')}")
        _say(
            ("job Succeeded" if quick else "jobs Succeeded")
            if ok
            else "job did NOT succeed (see describe above)"
        )
        if stay:
            _say(f"the cluster stays up (pid {os.getpid()}). In another shell, from {Path.cwd()}:")
            print(
                f"    source {_show(env_script)}      # KUBECONFIG, and the project's kubectl and "
                "helm on PATH\n"
                f"    kubectl get moejob -o wide\n"
                f"    kubectl describe moejob {name}\n",
                flush=True,
            )
            down = "scripts/dev.sh down" + ("" if work == DEFAULT_DIR else f" --dir {_show(work)}")
            _say(f"stop it: Ctrl-C here, or {down}")
            while True:  # until SIGTERM / Ctrl-C (KeyboardInterrupt)
                time.sleep(3600)
        return 0 if ok else 1
    finally:
        _say("stopping the operator, the node agent and the control plane")
        if operator is not None:
            procs.stop(operator)
        if agent is not None:
            agent.stop()
        cp.stop()
        (work / "env.sh").unlink(missing_ok=True)  # it would point at a stopped cluster


def _wait_job(kube, k, name: str, timeout: float) -> bool:
    """Print each new phase/step line of ``name`` until it ends; True when it Succeeded."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout:
        job = kube.custom.get_namespaced_custom_object(
            C.GROUP, C.VERSION, "default", C.PLURAL, name
        )
        st = job.get("status") or {}
        prog = st.get("progress") or {}
        line = f"phase {st.get('phase', 'Pending')}" + (
            f", step {prog.get('step')}/{prog.get('totalSteps')}, loss {prog.get('loss')}"
            if prog
            else ""
        )
        if line != last:
            _say(f"{time.monotonic() - start:5.0f}s  {line}")
            last = line
        if st.get("phase") in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    out = k("wait", "--for=condition=Succeeded", f"moejob/{name}", "--timeout=5s", check=False)
    return "condition met" in out


def _second_job(kube, k, work: Path, doc: dict, first: str, timeout: float) -> bool:
    """Job 2, planned from ``first``'s routing statistics, to Succeeded; then both plans' bytes
    side by side (``closed_loop.json``)."""
    from moe_localkube import demo_loop

    second = demo_loop.planned_manifest(doc, first)
    name = second["metadata"]["name"]
    path = work / "job-planned.json"
    path.write_text(json.dumps(second, indent=1))
    _say(
        f"job 2: {name}, the same job planned from {first}'s routing statistics "
        f"(spec.placement.routingStatsFrom.jobName: {first}; topology-aware placement, "
        "de-duplicating dispatcher)"
    )
    print(k("apply", "-f", str(path)), end="")
    ok = _wait_job(kube, k, name, timeout)
    print(f"\n$ kubectl get moejob {name} -o wide\n" + k("get", "moejob", name, "-o", "wide"))
    if not ok:
        print(f"$ kubectl describe moejob {name}\n" + k("describe", "moejob", name))
        return False
    a, b = demo_loop.report(kube, "default", first, name)
    _say(
        "both jobs side by side (predicted: placement.quality of each plan; counted: each job's "
        "progress)"
    )
    for line in demo_loop.comparison(a, b):
        print(line if line.startswith("  ") else f"[demo] {line}", flush=True)
    result, plot = demo_loop.write_result(work, a, b), demo_loop.write_plot(work, a, b)
    _say(f"figures: {_show(result)}, plot {_show(plot)}")
    return True


if __name__ == "__main__":
    sys.exit(main())
