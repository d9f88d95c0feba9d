"""Reading back the node agent's container logs: a pod run by ``podworker`` keeps its
``pod.json`` (``podfiles.save_meta``) and one log file per container attempt
(``logs/<container>.<attempt>.log``) under ``<run dir>/pods/<namespace>/<pod>/<uid>/``.
``read_log`` is what ``NodeAgent.read_log`` and the tests use; ``log_file`` also finds the file
``kubectl logs`` streams (the agent's lookup for ``kubeletapi``)."""

from __future__ import annotations

import json
from pathlib import Path


def log_file(
    run_dir: Path | str,
    namespace: str,
    pod: str,
    container: str | None = None,
    previous: bool = False,
) -> tuple[Path | None, str]:
    """(log file, pod uid) of a container of the newest pod ``namespace/pod`` under ``run_dir``;
    the file is None when that attempt has no log (``previous`` before any restart)."""
    base = Path(run_dir) / "pods" / namespace / pod
    metas = sorted(base.glob("*/pod.json"), key=lambda p: p.stat().st_mtime)
    if not metas:
        raise FileNotFoundError(f"no pod {namespace}/{pod} ran under {run_dir}")
    meta = json.loads(metas[-1].read_text())
    names = meta["initContainers"] + meta["containers"]
    if container is None:
        if len(meta["containers"]) != 1:
            raise ValueError(f"pod {namespace}/{pod} has containers {meta['containers']}: name one")
        container = meta["containers"][0]
    if container not in names:
        raise ValueError(f"pod {namespace}/{pod} has no container {container!r} (has {names})")
    logs = sorted(
        metas[-1].parent.glob(f"logs/{container}.*.log"), key=lambda p: int(p.name.split(".")[-2])
    )
    want = -2 if previous else -1
    return (logs[want] if len(logs) >= abs(want) else None), meta["uid"]


def read_log(
    run_dir: Path | str,
    namespace: str,
    pod: str,
    container: str | None = None,
    previous: bool = False,
) -> str:
    """Output of a container of the newest pod ``namespace/pod`` run under ``run_dir``
    (``previous``: the attempt before the last restart; "" when there is none)."""
    path, _ = log_file(run_dir, namespace, pod, container, previous)
    return path.read_text(errors="replace") if path else ""
