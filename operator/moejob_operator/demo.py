"""``moectl demo``: a whole MoETrainingJob on this machine, end to end.

Starts the local control plane (kube-apiserver v1.20.2 + etcd + controller manager + scheduler),
the node agent playing the kubelet for two fake 8-GPU nodes, and the operator (``kopf run``);
``kubectl apply -f examples/tiny-cpu.yaml`` (tiny Mixtral, CPU, 2 node ranks, DeepSpeed ZeRO-3 +
AutoEP); waits for ``Succeeded``; prints ``kubectl get moejob`` and ``kubectl describe``, and
where the expert-load heatmap and routing statistics are; stops everything it started.
This is what ``scripts/dev.sh demo`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from . import constants as C

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="run a tiny MoE training job on a local control plane",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--manifest", default=str(EXAMPLE), help="job manifest (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for Succeeded")
    p.add_argument("--keep", metavar="DIR", help="keep logs and checkpoints in DIR (default: a temp dir)")
    p.set_defaults(func=run_demo)


def _say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        return _demo(Path(args.keep), Path(args.manifest), args.timeout)
    with tempfile.TemporaryDirectory(prefix="moe-demo-") as tmp:
        return _demo(Path(tmp), Path(args.manifest), args.timeout)


def _demo(work: Path, manifest: Path, timeout: float) -> int:
    from kubernetes.client.rest import ApiException

    from moe_localkube import binaries, procs
    from moe_localkube.controlplane import ControlPlane
    from moe_localkube.nodeagent import NodeAgent, NodeSpec
    from moe_localkube.testing import Kube

    doc = yaml.safe_load(manifest.read_text())
    name = doc["metadata"]["name"]
    ckpt = work / "checkpoints"
    vol = (doc["spec"].get("checkpoint") or {}).get("volume") or {}
    if "hostPath" in vol:            # keep the demo's files with its logs
        vol["hostPath"]["path"] = str(ckpt)
    # JSON, not re-dumped YAML: PyYAML writes "1e-3" unquoted and kubectl reads that as a number
    applied = work / "job.json"
    applied.write_text(json.dumps(doc, indent=1))

    _say("starting the local control plane (kube-apiserver v1.20.2, etcd, controller manager, scheduler)")
    cp = ControlPlane(work / "controlplane").start()
    agent = operator = None
    try:
        _say(f"control plane ready in {cp.startup_seconds:.1f}s at {cp.server}")
        kube = Kube.from_api_client(cp.api_client())
        kubectl_env = cp.kubectl_env()
        kubectl = str(binaries.kubectl_binary())

        def k(*a: str, check: bool = True) -> str:
            res = subprocess.run([kubectl, *a], env=kubectl_env, capture_output=True, text=True, timeout=120)
            if check and res.returncode:
                raise RuntimeError(f"kubectl {' '.join(a)}: {res.stderr.strip()}")
            return res.stdout

        # --validate=false: kubectl validates against the server's OpenAPI, and a 1.20 server
        # does not know x-kubernetes-validations (it drops the CEL rules; see docs/crd.md)
        k("apply", "--validate=false", "-f", str(ROOT / "crds" / "moetrainingjob.yaml"))
        k("wait", "--for=condition=Established", f"crd/{C.PLURAL}.{C.GROUP}", "--timeout=60s")
        _say("starting the node agent: nodes node-a and node-b (fake NVSwitch H100 x8 topology)")
        agent = NodeAgent(cp.api_client(), [NodeSpec("node-a"), NodeSpec("node-b")],
                          run_dir=work / "nodeagent", api_server=cp.server)
        agent.start()
        _say("starting the operator (kopf run -A -m moejob_operator.handlers)")
        # the demo's checkpoints are a hostPath under its work dir: the one host path it allows
        env = dict(os.environ, KUBECONFIG=str(cp.kubeconfig), MOE_ALLOWED_HOST_PATH_PREFIXES=str(ckpt))
        operator = procs.spawn([sys.executable, "-m", "kopf", "run", "--standalone", "-A", "-m",
                                "moejob_operator.handlers"], work / "operator.log", env=env)
        for _ in range(100):   # the default ServiceAccount needs its token before pods are admitted
            try:
                if kube.core.read_namespaced_service_account("default", "default").secrets:
                    break
            except ApiException:
                pass
            time.sleep(0.2)

        _say(f"kubectl apply -f {manifest}")
        print(k("apply", "-f", str(applied)), end="")
        _say(f"waiting for condition Succeeded (up to {timeout:.0f}s; the first run JIT-builds "
             "nothing but imports DeepSpeed in every pod)")
        start = time.monotonic()
        last = None
        while time.monotonic() - start < timeout:
            job = kube.custom.get_namespaced_custom_object(C.GROUP, C.VERSION, "default", C.PLURAL, name)
            st = job.get("status") or {}
            prog = st.get("progress") or {}
            line = f"phase {st.get('phase', 'Pending')}" + (
                f", step {prog.get('step')}/{prog.get('totalSteps')}, loss {prog.get('loss')}" if prog else "")
            if line != last:
                _say(f"{time.monotonic() - start:5.0f}s  {line}")
                last = line
            if st.get("phase") in ("Succeeded", "Failed"):
                break
            time.sleep(1)
        out = k("wait", "--for=condition=Succeeded", f"moejob/{name}", "--timeout=5s", check=False)
        ok = "condition met" in out
        print("\n$ kubectl get moejob -o wide\n" + k("get", "moejob", "-o", "wide"))
        print(f"$ kubectl describe moejob {name}\n" + k("describe", "moejob", name))
        print("$ kubectl get pods,configmaps -l " + f"{C.LABEL_JOB}={name}\n"
              + k("get", "pods,configmaps", "-l", f"{C.LABEL_JOB}={name}"))
        job_dirs = sorted(ckpt.glob(f"{name}-*"))
        if job_dirs:
            d = job_dirs[-1]
            _say(f"expert-load heatmap:  {d / 'expert_load.png'}"
                 + ("" if (d / "expert_load.png").exists() else " (not written)"))
            _say(f"routing statistics:   {d / C.ROUTING_STATS_KEY} and ConfigMap {name}-routing-stats "
                 f"(plan a later job from them: spec.placement.routingStatsFrom.jobName: {name})")
        _say(f"logs: operator {work / 'operator.log'}, pods {work / 'nodeagent'}")
        _say("job Succeeded" if ok else "job did NOT succeed (see describe above)")
        return 0 if ok else 1
    finally:
        _say("stopping the operator, the node agent and the control plane")
        if operator is not None:
            procs.stop(operator)
        if agent is not None:
            agent.stop()
        cp.stop()
