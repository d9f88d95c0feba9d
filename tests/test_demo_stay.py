"""``scripts/dev.sh demo --stay`` as a newcomer uses it: the demo's two jobs succeed (the second
planned from the first one's routing statistics, with the saving its plan predicts), the cluster
stays up, the README's "second shell" lines work through the env script the demo wrote, the paths it
printed exist, and ``scripts/dev.sh down`` stops it with nothing left running.

The README block between ``<!-- demo-stay -->`` and the end of its code fence is what runs here,
line by line (``runs/demo`` replaced by this test's folder), so the README cannot drift from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEFAULT = "runs/demo"

pytestmark = pytest.mark.cluster


def readme_lines() -> tuple[list[str], str]:
    """The commands of the README's demo-stay block: (second-shell lines, the stop line)."""
    text = README.read_text()
    m = re.search(r"<!-- demo-stay -->\s*```(?:sh|console)?\n(.*?)```", text, re.DOTALL)
    assert m, "README.md has no <!-- demo-stay --> block"
    cmds = [ln.split("  #")[0].strip() for ln in m.group(1).splitlines()]
    cmds = [c for c in cmds if c and not c.startswith("#")]
    assert cmds[0].startswith("scripts/dev.sh demo --stay"), cmds
    stop = [c for c in cmds if c.startswith("scripts/dev.sh down")]
    assert stop, cmds
    second = [c for c in cmds[1:] if not c.startswith("scripts/dev.sh")]
    assert second and second[0] == f"source {DEFAULT}/env.sh", second
    return second, stop[0]


def _descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every process below ``pid`` (the start time tells a reused pid
    apart)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        starts[int(entry.name)] = fields[19]
    out, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = starts[c]
            todo.append(c)
    return out


def _alive(pid: int, start: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] == start and fields[0] != "Z"


def _mentions(path: Path) -> list[int]:
    """Processes whose command line or environment names ``path``."""
    needle = str(path).encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            blob = (
                Path(f"/proc/{entry.name}/cmdline").read_bytes()
                + Path(f"/proc/{entry.name}/environ").read_bytes()
            )
        except OSError:
            continue
        if needle in blob:
            found.append(int(entry.name))
    return found


def _setup_done() -> bool:
    stamp = ROOT / ".venv" / ".moe-stamp"
    # what scripts/dev.sh hashes: the product's and the dev package's pyproject, the constraints
    want = hashlib.sha256(
        b"".join(
            (ROOT / f).read_bytes()
            for f in ("pyproject.toml", "operator/dev/pyproject.toml", "constraints.txt")
        )
    ).hexdigest()
    return stamp.exists() and stamp.read_text().strip() == want


def test_demo_stay_then_the_readme_kubectl_lines_then_down(tmp_path, wait_for):
    if not _setup_done():
        pytest.skip(
            "scripts/dev.sh setup has not run for this pyproject/constraints (it would install)"
        )
    second, stop = readme_lines()
    work = tmp_path / "demo"
    out = tmp_path / "demo.out"
    with open(out, "w") as f:
        demo = subprocess.Popen(
            ["bash", "scripts/dev.sh", "demo", "--stay", "--dir", str(work)],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    text = lambda: out.read_text(errors="replace")  # noqa: E731
    try:
        wait_for(
            lambda: "the cluster stays up" in text() or demo.poll() is not None,
            timeout=900,
            message=f"demo --stay never said the cluster stays up:\n{text()[-4000:]}",
        )
        assert demo.poll() is None, text()[-4000:]
        assert "jobs Succeeded" in text(), text()[-4000:]
        # the closed loop: job 2 planned from job 1's statistics, its saving as its plan says
        loop = json.loads((work / "closed_loop.json").read_text())
        job1, job2 = loop["jobs"]  # (not `second`: that name holds the README's lines)
        assert job2["routing_stats_from"] == job1["job"] == "tiny-cpu", loop
        saved = job2["contiguous_cross_group_bytes"] - job2["cross_group_bytes"]
        assert loop["savedCrossGroupBytesPerStep"] == saved, loop
        said = f"saved: {saved:,}" if saved > 0 else f"no saving: {-saved:,}"
        assert f"{said} bytes per step" in text(), text()[-4000:]
        # every path it printed exists
        printed = re.findall(
            r"heatmap:\s+(\S+)|statistics:\s+(\S+)|logs: operator (\S+), pods (\S+)", text()
        )
        printed = [p for group in printed for p in group if p]
        assert len(printed) == 4, text()[-3000:]
        for p in printed:
            path = Path(p) if p.startswith("/") else ROOT / p
            assert path.exists(), f"printed {p} does not exist"
        assert (work / "env.sh").is_file()

        # a second shell: nothing of ours on PATH, no KUBECONFIG; the README's lines, as written
        script = "set -e\n" + "\n".join(c.replace(f"{DEFAULT}/", f"{work}/") for c in second) + "\n"
        shell_env = {
            "PATH": "/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
        }
        res = subprocess.run(
            ["bash", "-c", script],
            cwd=ROOT,
            env=shell_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, f"{script}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
        assert re.search(r"tiny-cpu\s+Succeeded", res.stdout), res.stdout
        assert "TrainingFinished" in res.stdout and "condition met" in res.stdout, res.stdout

        # stop it as the README says
        procs_before = _descendants(demo.pid)
        assert procs_before, "the demo started no processes?"
        res = subprocess.run(
            ["bash", "-c", f"{stop} --dir {shlex.quote(str(work))}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert demo.wait(timeout=120) == 0, text()[-3000:]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in procs_before.items()):
            time.sleep(0.5)
        left = [p for p, s in procs_before.items() if _alive(p, s)]
        assert not left, f"still running after down: {left}"
        assert not _mentions(work), "a process still names the demo's folder"
        assert not (work / "demo.pid").exists()
        assert not (work / "env.sh").exists(), "env.sh left behind, pointing at a stopped cluster"
        # down again: nothing to stop, still fine
        res = subprocess.run(
            ["bash", "-c", f"{stop} --dir {shlex.quote(str(work))}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0 and "no demo is running" in res.stdout, res.stdout + res.stderr
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGTERM)
            try:
                demo.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
