"""One pod on a fake node, played like the kubelet would: prepare files and env, run init
containers in order, run the containers (restarting per ``restartPolicy`` with back-off), honour
``activeDeadlineSeconds`` and deletion, and report everything through ``pods/status``."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from kubernetes.client.exceptions import ApiException

from . import procs, sandbox
from .gpus import GpuAdmissionError
from .podfiles import ConfigError, Mount, PodFiles, container_mounts, expand, memory_dir, save_meta

if TYPE_CHECKING:
    from .nodeagent import NodeAgent

log = logging.getLogger("moe_localkube.nodeagent")
MAX_MESSAGE = 4096
BACKOFF_BASE, BACKOFF_MAX = 0.5, 10.0
TICK = 0.1


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tail_text(path: Path, n: int = 2048) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class ContainerRun:
    """Mutable state of one container of the pod."""

    def __init__(self, spec: dict, logs_dir: Path, term_dir: Path):
        self.spec, self.name = spec, spec["name"]
        self.logs_dir, self.term_file = logs_dir, term_dir / f"{spec['name']}.termination-log"
        self.proc = None
        self.restarts = -1  # incremented on each start: first start -> 0
        self.started_at: str | None = None
        self.waiting = {"reason": "ContainerCreating"}
        self.terminated: dict | None = None
        self.last_terminated: dict | None = None
        self.next_start = 0.0
        self.final = False  # terminated and will not restart
        self.image_id = ""  # what the node's runtime reports it ran (set at start)

    def log_path(self, attempt: int | None = None) -> Path:
        return self.logs_dir / f"{self.name}.{self.restarts if attempt is None else attempt}.log"

    def status(self, init: bool) -> dict:
        running = self.proc is not None and self.terminated is None
        if running:
            state = {"running": {"startedAt": self.started_at}}
        elif self.terminated is not None and (self.final or not self.waiting):
            state = {"terminated": self.terminated}
        else:
            state = {"waiting": self.waiting}
        last = self.last_terminated if "terminated" not in state else None
        return {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": self.image_id,
            "containerID": f"moe-localkube://{self.proc.pid}" if self.proc else None,
            "ready": running and not init,
            "started": running,
            "restartCount": max(self.restarts, 0),
            "state": state,
            "lastState": {"terminated": last} if last else {},
        }


class PodWorker(threading.Thread):
    def __init__(self, agent: NodeAgent, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent, self.pod = agent, pod
        self.ns, self.pod_name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.spec = pod["spec"]
        self.pod_dir = agent.pod_dir(self.ns, self.pod_name, self.uid)
        self.restart_policy = self.spec.get("restartPolicy", "Always")
        self._delete_req = threading.Event()
        self._shutdown_req = threading.Event()
        self.delete_grace = 30.0
        self.ip = ""
        self.start_time = ""
        self._t0 = 0.0
        self.phase = "Pending"
        self.reason: str | None = None
        self.message: str | None = None
        self.initialized = not self.spec.get("initContainers")
        self._conds: dict[str, tuple[str, str]] = {}
        self._last_sent: dict | None = None
        logs, term = self.pod_dir / "logs", self.pod_dir / "term"
        logs.mkdir(parents=True, exist_ok=True)
        term.mkdir(parents=True, exist_ok=True)
        self.inits = [ContainerRun(c, logs, term) for c in self.spec.get("initContainers") or []]
        self.mains = [ContainerRun(c, logs, term) for c in self.spec["containers"]]
        self.envs: dict[str, dict[str, str]] = {}
        self.mounts: dict[str, list] = {}
        save_meta(self.pod_dir, pod)

    # ------------------------------------------------------------ control
    def request_delete(self, grace_seconds: float | None) -> None:
        if grace_seconds is not None:
            self.delete_grace = min(float(grace_seconds), 30.0)
        self._delete_req.set()

    def shutdown(self) -> None:
        self._shutdown_req.set()

    def _stopping(self) -> bool:
        return self._delete_req.is_set() or self._shutdown_req.is_set()

    def _deadline_passed(self) -> bool:
        ads = self.spec.get("activeDeadlineSeconds")
        return ads is not None and time.monotonic() - self._t0 > float(ads)

    # ------------------------------------------------------------ status
    def _cond(self, typ: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        prev = self._conds.get(typ)
        if prev is None or prev[0] != status:
            self._conds[typ] = (status, now_iso())
        return {
            "type": typ,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": self._conds[typ][1],
        }

    def _status(self) -> dict:
        ready = self.phase == "Running" and all(
            c.proc is not None and c.terminated is None for c in self.mains
        )
        status = {
            "phase": self.phase,
            "hostIP": self.agent.host_ip,
            "podIP": self.ip or None,
            "podIPs": [{"ip": self.ip}] if self.ip else None,
            "startTime": self.start_time,
            "reason": self.reason,
            "message": self.message,
            "conditions": [
                self._cond("Initialized", self.initialized),
                self._cond("Ready", ready),
                self._cond("ContainersReady", ready),
                self._cond("PodScheduled", True),
            ],
            "containerStatuses": [c.status(False) for c in self.mains],
        }
        if self.inits:
            status["initContainerStatuses"] = [c.status(True) for c in self.inits]
        return status

    def report(self) -> None:
        status = self._status()
        if status == self._last_sent:
            return
        try:
            self.agent.core.patch_namespaced_pod_status(
                self.pod_name,
                self.ns,
                {"status": status},
                _content_type="application/merge-patch+json",
            )
            self._last_sent = status
        except ApiException as exc:
            if exc.status == 404:
                self._delete_req.set()  # gone: stop what we run
            else:
                log.warning(
                    "pod %s/%s: status update failed: %s", self.ns, self.pod_name, exc.reason
                )

    def event(
        self, reason: str, message: str, warning: bool = False, container: str | None = None
    ) -> None:
        """A kubelet-style Event on the pod (for ``kubectl describe``); best effort."""
        if self._shutdown_req.is_set():
            return
        obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": self.pod_name,
            "namespace": self.ns,
            "uid": self.uid,
        }
        if container:
            obj["fieldPath"] = f"spec.containers{{{container}}}"
        now = now_iso()
        try:
            self.agent.core.create_namespaced_event(
                self.ns,
                {
                    "metadata": {"generateName": f"{self.pod_name}."},
                    "involvedObject": obj,
                    "reason": reason,
                    "message": message,
                    "type": "Warning" if warning else "Normal",
                    "source": {"component": "kubelet", "host": self.spec.get("nodeName", "")},
                    "firstTimestamp": now,
                    "lastTimestamp": now,
                    "count": 1,
                },
            )
        except Exception as exc:  # noqa: BLE001 - events are not worth failing a pod over
            log.debug("event %s for %s/%s: %s", reason, self.ns, self.pod_name, exc)

    # ------------------------------------------------------------ containers
    def _start(self, c: ContainerRun) -> None:
        c.restarts += 1
        c.terminated, c.waiting = None, {}
        c.image_id = self.agent.image_ids.image_id(
            self.spec.get("nodeName", ""), c.spec.get("image", "")
        )
        c.term_file.write_bytes(b"")
        spec = c.spec
        env = self.envs[c.name]
        argv = [expand(a, env) for a in (spec.get("command") or []) + (spec.get("args") or [])]
        term_path = spec.get("terminationMessagePath") or "/dev/termination-log"
        mounts = [
            *self.mounts[c.name],
            *self.agent.fixed_mounts(),
            Mount(source=c.term_file, target=term_path, read_only=False),
        ]
        c.proc = sandbox.launch(
            argv=argv,
            env=env,
            mounts=mounts,
            hostname=self.hostname,
            working_dir=spec.get("workingDir"),
            log_path=c.log_path(),
            targets=self.agent.mount_targets,
        )
        self.agent.pids.add(c.proc.pid)
        c.started_at = now_iso()
        self.event("Started", f"Started container {c.name} (pid {c.proc.pid})", container=c.name)

    def _on_exit(self, c: ContainerRun, code: int) -> None:
        if code < 0:
            code = 128 - code  # killed by signal N -> 128 + N, as runtimes report
        message = (
            c.term_file.read_bytes()[:MAX_MESSAGE].decode(errors="replace")
            if c.term_file.exists()
            else ""
        )
        if (
            not message
            and code != 0
            and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        ):
            message = _tail_text(c.log_path())
        c.terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now_iso(),
            "containerID": f"moe-localkube://{c.proc.pid}",
        }
        if message:
            c.terminated["message"] = message
        c.proc = None
        restart = self.restart_policy == "Always" or (
            self.restart_policy == "OnFailure" and code != 0
        )
        if restart and not self._stopping():
            c.last_terminated = c.terminated
            delay = min(BACKOFF_BASE * 2**c.restarts, BACKOFF_MAX)
            c.next_start = time.monotonic() + delay
            c.waiting = {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:.1f}s restarting failed container={c.name} "
                f"pod={self.pod_name}",
            }
            self.event(
                "BackOff",
                f"Back-off restarting container {c.name} (exit code {code})",
                warning=code != 0,
                container=c.name,
            )
        else:
            c.final = True

    def _poll(self, c: ContainerRun) -> None:
        if c.proc is not None:
            code = c.proc.poll()
            if code is not None:
                self._on_exit(c, code)
        elif not c.final and time.monotonic() >= c.next_start and not self._stopping():
            self._start(c)

    def _kill_all(self, grace: float) -> None:
        for c in [*self.inits, *self.mains]:
            if c.proc is not None:
                code = procs.stop(c.proc, grace_seconds=grace)
                self._on_exit_final(c, code if code is not None else -9)

    def _on_exit_final(self, c: ContainerRun, code: int) -> None:
        saved = self.restart_policy
        self.restart_policy = "Never"
        try:
            self._on_exit(c, code)
        finally:
            self.restart_policy = saved

    # ------------------------------------------------------------ lifecycle
    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # the pod shows it; the agent keeps going
            log.exception("pod %s/%s: node agent error", self.ns, self.pod_name)
            self._kill_all(1.0)
            self.phase, self.reason, self.message = (
                "Failed",
                "NodeAgentError",
                str(exc)[:MAX_MESSAGE],
            )
            if not self._shutdown_req.is_set():
                self.report()
        finally:
            self._finish()

    def _finish(self) -> None:
        if self._delete_req.is_set() and not self._shutdown_req.is_set():
            if any(c.proc is not None for c in [*self.inits, *self.mains]):
                self.event("Killing", f"Stopping pod (grace period {self.delete_grace:g}s)")
            self._kill_all(self.delete_grace)
            self.agent.force_delete(self.ns, self.pod_name, self.uid)
        elif self._shutdown_req.is_set():
            self._kill_all(2.0)
        shutil.rmtree(memory_dir(self.uid), ignore_errors=True)  # tmpfs: give the memory back
        self.agent.release_gpus(self.uid)

    def _prepare(self) -> None:
        pod = {
            **self.pod,
            "status": {
                **(self.pod.get("status") or {}),
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "hostIP": self.agent.host_ip,
            },
        }
        files = PodFiles(self.agent.core, pod, self.pod_dir, self.agent.run_dir)
        volumes = files.volumes()
        granted = self.agent.allocate_gpus(pod)
        for c in [*self.inits, *self.mains]:
            if not c.spec.get("command"):
                raise sandbox.SandboxError(
                    f"container {c.name}: no command (the node agent ignores "
                    "images and their entrypoints)"
                )
            env = files.env(c.spec, self.agent.base_env(pod))
            env.update(self.agent.gpu_env(pod, granted.get(c.name, []), env))
            self.envs[c.name] = env
            self.mounts[c.name] = container_mounts(c.spec, volumes)

    def _run(self) -> None:
        self._t0 = time.monotonic()
        self.start_time = now_iso()
        self.hostname = self.spec.get("hostname") or self.pod_name
        self.ip = self.agent.alloc_ip(self.uid, self.pod)
        self.report()
        while True:  # kubelet retries config errors
            if self._stopping():
                return None
            if self._deadline_passed():
                return self._deadline()
            try:
                self._prepare()
                break
            except GpuAdmissionError as exc:  # the kubelet refuses the pod, it does not queue it
                self.event("UnexpectedAdmissionError", str(exc), warning=True)
                self.phase, self.reason, self.message = (
                    "Failed",
                    "UnexpectedAdmissionError",
                    f"Pod was rejected: {exc}"[:MAX_MESSAGE],
                )
                self.report()
                return None
            except (ConfigError, sandbox.SandboxError, ApiException) as exc:
                reason = (
                    "CreateContainerError"
                    if isinstance(exc, sandbox.SandboxError)
                    else "CreateContainerConfigError"
                )
                msg = exc.reason if isinstance(exc, ApiException) else str(exc)
                if all(c.waiting.get("message") != msg for c in [*self.inits, *self.mains]):
                    self.event("Failed", f"Error: {msg}", warning=True)
                for c in [*self.inits, *self.mains]:
                    c.waiting = {"reason": reason, "message": msg}
                self.report()
                time.sleep(1.0)
        for c in [*self.inits, *self.mains]:
            c.waiting = {"reason": "PodInitializing" if self.inits else "ContainerCreating"}
        for c in self.inits:  # init containers: in order, to success
            while not (c.final and c.terminated and c.terminated["exitCode"] == 0):
                if self._stopping():
                    return None
                if self._deadline_passed():
                    return self._deadline()
                if c.final:  # failed under restartPolicy Never
                    self.phase = "Failed"
                    self.report()
                    return None
                self._poll_init(c)
                self.report()
                time.sleep(TICK)
        self.initialized = True
        while True:
            for c in self.mains:
                self._poll(c)
            if any(c.proc is not None for c in self.mains):
                self.phase = "Running"
            if all(c.final for c in self.mains):
                self.phase = (
                    "Succeeded"
                    if all(c.terminated["exitCode"] == 0 for c in self.mains)
                    else "Failed"
                )
                self.report()
                return None
            if self._stopping():
                return None
            if self._deadline_passed():
                return self._deadline()
            self.report()
            time.sleep(TICK)

    def _poll_init(self, c: ContainerRun) -> None:
        # Init containers restart on failure unless restartPolicy is Never; success is final.
        if c.proc is not None:
            code = c.proc.poll()
            if code is None:
                return
            saved = self.restart_policy
            self.restart_policy = "Never" if saved == "Never" else "OnFailure"
            try:
                self._on_exit(c, code)
            finally:
                self.restart_policy = saved
            if code == 0:
                c.final = True
        elif not c.final and time.monotonic() >= c.next_start:
            self._start(c)

    def _deadline(self) -> None:
        self.event(
            "DeadlineExceeded",
            "Pod was active on the node longer than the specified deadline",
            warning=True,
        )
        self._kill_all(2.0)
        self.phase, self.reason = "Failed", "DeadlineExceeded"
        self.message = "Pod was active on the node longer than the specified deadline"
        self.report()
