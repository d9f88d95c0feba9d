"""The worker pod's entry point: `moe-train` as node launcher (moe_trainer.launch) and the process
gang under it (moe_trainer.gang): rank arithmetic against real plans, exit codes, log prefixes,
signal forwarding with a bounded grace period, and a real 2-rank CPU run through `moe-train`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from moe_contracts.plan import parse_plan
from moe_trainer import gang, launch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "plans"


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _envs(n: int) -> list[dict[str, str]]:
    return [dict(os.environ, RANK=str(r)) for r in range(n)]


# ---- rank arithmetic against the plans the operator makes ------------------------------------
class _Stats:
    """The one client call planning makes for routingStatsFrom: the warm-up job's ConfigMap."""

    def __init__(self, doc):
        self.doc = doc

    def get_configmap(self, namespace, name):
        return {"data": {"routing_stats.json": json.dumps(self.doc)}}


def _h200_plan_and_pods():
    from moe_contracts.topology import parse_topology, report_to_json
    from moejob_operator.builders import common, workers
    from moejob_operator.core import routing
    from moejob_operator.core.topology import load_topology
    from moejob_operator.reconcile import planning
    from moejob_operator.spec import parse_spec

    spec = parse_spec(yaml.safe_load((ROOT / "examples" / "gpu-h200.yaml").read_text())["spec"])
    job = common.JobRef("team-a", "mixtral-small-h200", "0b6f6c2e-6f1d-4f43-9d0e-3f5a1f1a9b11")
    reports = {
        n: parse_topology({**report_to_json(load_topology("nvswitch-h200-8")), "node": n})
        for n in ("h200-a", "h200-b")
    }
    stats = routing.synthetic_trace(4, 8, 2, 4096, num_clusters=2, seed=3).to_json()
    plan = planning.make_plan(_Stats(stats), job, spec, reports)
    pods = workers.worker_pods(job, spec, plan.node_names, attempt=0, spec_hash="h")
    return spec, plan.raw, pods


def _pod_env(pod) -> dict[str, str]:
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    env["NODE_NAME"] = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
    return env


def test_gpu_h200_example_every_pods_ranks_match_the_plan():
    """examples/gpu-h200.yaml (2 nodes x 8 GPUs): planned as the operator plans it, rendered as the
    operator renders it; every pod's launcher derives exactly the plan's ranks for its node."""
    _spec, plan, pods = _h200_plan_and_pods()
    trainer_plan = parse_plan(plan)
    assert plan["worldSize"] == 16 and len(pods) == 2
    seen = []
    for pod in pods:
        env = _pod_env(pod)
        res = pod["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "8"
        node_rank = int(env["NODE_RANK"])
        ranks = launch.node_ranks(env, trainer_plan.ranks, trainer_plan.world_size)
        assert [r.rank for r in ranks] == [node_rank * 8 + lr for lr in range(8)]
        assert [r.local_rank for r in ranks] == list(range(8))
        assert sorted(r.gpu for r in ranks) == list(range(8))  # each visible GPU once
        for r in ranks:
            doc = plan["ranks"][r.rank]
            assert (doc["nodeRank"], doc["localRank"], doc["gpu"]) == (
                node_rank,
                r.local_rank,
                r.gpu,
            )
            assert doc["node"] == env["NODE_NAME"]
            child = launch.rank_env(
                env,
                rank=r.rank,
                local_rank=r.local_rank,
                local_world=8,
                world=trainer_plan.world_size,
            )
            assert (
                child["RANK"],
                child["LOCAL_RANK"],
                child["LOCAL_WORLD_SIZE"],
                child["WORLD_SIZE"],
            ) == (str(node_rank * 8 + r.local_rank), str(r.local_rank), "8", "16")
        seen += [r.rank for r in ranks]
    assert sorted(seen) == list(range(16))


@pytest.mark.parametrize(
    ("env", "plan_world", "match"),
    [
        (
            {"NPROC_PER_NODE": "2", "NODE_RANK": "0", "NNODES": "2", "WORLD_SIZE": "3"},
            3,
            "WORLD_SIZE=3 is not NNODES x NPROC_PER_NODE = 2 x 2",
        ),
        (
            {"NPROC_PER_NODE": "2", "NODE_RANK": "2", "NNODES": "2", "WORLD_SIZE": "4"},
            4,
            r"NODE_RANK=2 is outside 0..1",
        ),
        (
            {"NPROC_PER_NODE": "2", "NODE_RANK": "0", "NNODES": "2", "WORLD_SIZE": "4"},
            2,
            "WORLD_SIZE=4 differs from the plan's worldSize=2",
        ),
        (
            {"NPROC_PER_NODE": "x", "NODE_RANK": "0", "NNODES": "1", "WORLD_SIZE": "1"},
            1,
            "NPROC_PER_NODE='x' is not an integer",
        ),
        ({"NODE_RANK": "0", "NNODES": "1", "WORLD_SIZE": "1"}, 1, "NPROC_PER_NODE is not set"),
    ],
)
def test_launcher_refuses_env_that_disagrees(env, plan_world, match):
    from moe_contracts.plan import RankSpec

    ranks = [
        RankSpec(rank=r, node="n", node_rank=r // 2, local_rank=r % 2, gpu=r % 2)
        for r in range(plan_world)
    ]
    with pytest.raises(launch.LaunchError, match=match):
        launch.node_ranks(env, ranks, plan_world)


def test_launcher_refuses_a_plan_with_another_rank_layout():
    from moe_contracts.plan import RankSpec

    env = {"NPROC_PER_NODE": "2", "NODE_RANK": "1", "NNODES": "2", "WORLD_SIZE": "4"}
    ranks = [
        RankSpec(rank=r, node="n", node_rank=r % 2, local_rank=r // 2, gpu=0) for r in range(4)
    ]
    with pytest.raises(launch.LaunchError, match=r"expected rank 2 = 1 x 2 \+ 0"):
        launch.node_ranks(env, ranks, 4)
    same_gpu = [
        RankSpec(rank=r, node="n", node_rank=r // 2, local_rank=r % 2, gpu=3) for r in range(4)
    ]
    with pytest.raises(launch.LaunchError, match="one rank per GPU"):
        launch.node_ranks(env, same_gpu, 4)


def test_pod_termination_message_is_the_first_failing_ranks_document(tmp_path):
    """Two ranks: rank 1 writes a TrainerExit document and exits 78, rank 0 is stopped. The pod's
    message is rank 1's document with the gang's summary; a rank killed without a document gets
    cause Signalled."""
    ranks = [
        launch.NodeRank(rank=2, local_rank=0, gpu=0),
        launch.NodeRank(rank=3, local_rank=1, gpu=1),
    ]
    files = [tmp_path / "r0", tmp_path / "r1"]
    writer = _py("""
        import json, os, sys
        doc = {"kind": "TrainerExit", "version": 1, "cause": "DataNotFound", "exitCode": 78,
               "rank": int(os.environ["RANK"]), "message": "data.path /data does not exist"}
        open(os.environ["MOE_TERMINATION_LOG"], "w").write(json.dumps(doc))
        sys.exit(78)""")
    envs = [
        dict(os.environ, RANK=str(r.rank), MOE_TERMINATION_LOG=str(f))
        for r, f in zip(ranks, files, strict=True)
    ]
    for f in files:
        f.touch()
    with open(tmp_path / "out", "w") as out:
        res = gang.Gang(
            [_py("import time; time.sleep(600)"), writer],
            envs,
            labels=["rank2", "rank3"],
            stop_seconds=2,
            out=out,
        ).run()
    doc = launch.failure_document(res, ["rank2", "rank3"], ranks, 1, [f.read_text() for f in files])
    assert (doc["cause"], doc["exitCode"], doc["rank"], doc["nodeRank"]) == (
        "DataNotFound",
        78,
        3,
        1,
    )
    assert doc["message"].startswith("node rank 1: rank3 exited with code 78 first")
    assert doc["message"].endswith("data.path /data does not exist")

    with open(tmp_path / "out2", "w") as out:
        killed = gang.Gang(
            [_py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")], envs[:1], out=out
        ).run()
    doc = launch.failure_document(killed, ["rank2"], ranks[:1], 1, [""])
    assert (doc["cause"], doc["exitCode"], doc["rank"]) == ("Signalled", 137, 2)
    term = tmp_path / "termination-log"
    launch.write_termination_message(doc, str(term))
    assert not term.exists()  # only where the kubelet made one
    term.touch()
    launch.write_termination_message(dict(doc, message="x" * 10000), str(term))
    assert len(term.read_bytes()) <= 4096 and json.loads(term.read_text())["cause"] == "Signalled"


# ---- the gang: exit codes, prefixes, signals ---------------------------------------------------
@pytest.mark.parametrize("code", [65, 75, 78, 3])
def test_first_failure_stops_the_others_and_is_the_exit_code(code, tmp_path):
    """Rank 1 fails, ranks 0 and 2 would run for 10 minutes (one ignores SIGTERM): all stopped
    within STOP_SECONDS (+ margin), the gang's code is rank 1's."""
    slow = _py("import time; print('working', flush=True); time.sleep(600)")
    stubborn = _py(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('working', flush=True); time.sleep(600)"
    )
    fail = _py(f"import sys, time; time.sleep(0.5); print('failing', flush=True); sys.exit({code})")
    t0 = time.monotonic()
    with open(tmp_path / "out", "w") as out:
        res = gang.Gang([slow, fail, stubborn], _envs(3), stop_seconds=2.0, out=out).run()
    took = time.monotonic() - t0
    assert res.first_failure == 1 and res.exit_code == code
    assert res.codes == [128 + signal.SIGTERM, code, 128 + signal.SIGKILL]
    assert took < 2.0 + 10, took
    assert f"rank1 exited with code {code} first" in res.describe()


def test_a_killed_rank_counts_first_over_the_peer_that_lost_it(tmp_path):
    """Rank 1 is killed (SIGKILL) while connected to rank 0, which exits 75 the moment the
    connection drops (as a gloo/NCCL rank does on a lost peer). Both usually die within one
    poll of the gang; the killed rank is the cause and must be reported first, in either order of
    the gang seeing them."""
    port_file = tmp_path / "port"
    peer = _py(
        "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1); "
        f"open({str(port_file)!r} + '.tmp', 'w').write(str(s.getsockname()[1])); "
        f"import os; os.rename({str(port_file)!r} + '.tmp', {str(port_file)!r}); "
        "c, _ = s.accept(); c.recv(1); sys.exit(75)"
    )
    victim = _py(
        "import os, signal, socket, time\n"
        f"while not os.path.exists({str(port_file)!r}): time.sleep(0.01)\n"
        f"c = socket.create_connection(('127.0.0.1', int(open({str(port_file)!r}).read())))\n"
        "time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)"
    )
    with open(tmp_path / "out", "w") as out:
        res = gang.Gang([peer, victim], _envs(2), stop_seconds=2.0, out=out).run()
    # the peer either saw the drop (75) or the gang stopped it first (SIGTERM, 143) when the poll
    # found the killed rank before the peer's exit: on a loaded machine either can happen
    assert res.codes[1] == 128 + signal.SIGKILL and res.codes[0] in (75, 128 + signal.SIGTERM)
    assert res.first_failure == 1 and res.exit_code == 128 + signal.SIGKILL
    assert "rank1 exited with code 137 first" in res.describe()


def test_output_is_prefixed_per_rank(tmp_path):
    out = tmp_path / "out"
    with open(out, "w") as f:
        res = gang.Gang(
            [_py("import os; print('hello from', os.environ['RANK'])")] * 2,
            _envs(2),
            labels=["rank4", "rank5"],
            out=f,
        ).run()
    assert res.exit_code == 0 and res.codes == [0, 0]
    lines = set(out.read_text().splitlines())
    assert {"[rank4] hello from 0", "[rank5] hello from 1"} <= lines


DRIVER = """
import sys
from moe_trainer import gang
child = sys.argv[1]
envs = [dict(__import__("os").environ, RANK=str(r)) for r in range(2)]
res = gang.Gang([[sys.executable, "-c", child]] * 2, envs, grace_seconds=float(sys.argv[2])).run()
print("codes", res.codes, flush=True)
sys.exit(res.exit_code)
"""


def _driver(tmp_path, child: str, grace: float):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    return subprocess.Popen(
        [sys.executable, str(script), textwrap.dedent(child), str(grace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, TMP=str(tmp_path)),
    )


def _wait_lines(proc, want: str, count: int) -> list[str]:
    seen = []
    while sum(want in x for x in seen) < count:
        line = proc.stdout.readline()
        assert line, f"driver ended before {count} x {want!r}: {seen}"
        seen.append(line)
    return seen


def test_sigterm_is_forwarded_and_ranks_may_finish_within_the_grace(tmp_path):
    """A rank that finishes its work on SIGTERM (a checkpoint write) gets to do so."""
    child = """
    import os, signal, sys, time
    def on_term(*_):
        time.sleep(1.0)                                  # "finishing the checkpoint"
        open(os.path.join(os.environ["TMP"], "done-" + os.environ["RANK"]), "w").close()
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    time.sleep(600)
    """
    p = _driver(tmp_path, child, grace=20)
    _wait_lines(p, "ready", 2)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=30)[0]
    assert p.returncode == 143, out
    assert (tmp_path / "done-0").exists() and (tmp_path / "done-1").exists()
    assert "codes [143, 143]" in out


def test_sigterm_grace_is_bounded(tmp_path):
    child = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(600)
    """
    p = _driver(tmp_path, child, grace=1.5)
    _wait_lines(p, "ready", 2)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=30)[0]
    assert time.monotonic() - t0 < 1.5 + 8
    assert "codes [137, 137]" in out and p.returncode == 137


def test_ranks_die_with_a_killed_launcher(tmp_path):
    child = """
    import os, time
    print("pid", os.getpid(), flush=True)
    time.sleep(600)
    """
    p = _driver(tmp_path, child, grace=5)
    lines = _wait_lines(p, "pid", 2)
    pids = [int(x.split()[-1]) for x in lines if " pid " in x]
    p.kill()
    p.wait()

    def gone(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return (
            Path(f"/proc/{pid}/stat").exists()
            and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        )

    deadline = time.monotonic() + 10
    while not all(gone(x) for x in pids):
        assert time.monotonic() < deadline, f"ranks {pids} outlived their launcher"
        time.sleep(0.05)


# ---- moe-train as the pod's entry point, for real ----------------------------------------------
@pytest.mark.slow
def test_moe_train_as_pod_entry_runs_two_gloo_ranks(tmp_path):
    """The command a CPU worker pod runs (`moe-train --cpu` with the pod's env, no RANK): two ranks
    of the real trainer, prefixed logs, one termination message; a bad env exits 78."""
    plan = json.loads((FIXTURES / "tiny_mixtral_autoep.json").read_text())
    plan["training"]["steps"] = 2
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    (tmp_path / "term").touch()  # the kubelet creates it in a pod
    env.update(
        NPROC_PER_NODE="2",
        NODE_RANK="0",
        NNODES="1",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(launch.free_port()),
        MOE_PLAN=str(tmp_path / "plan.json"),
        MOE_CHECKPOINT_DIR=str(tmp_path / "ck"),
        MOE_TERMINATION_LOG=str(tmp_path / "term"),
        NODE_NAME=plan["ranks"][0]["node"],
    )
    out = subprocess.run(
        [sys.executable, "-m", "moe_trainer.train", "--cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "node rank 0: starting rank 0 (local 0, CPU), rank 1 (local 1, CPU)" in log
    assert any(x.startswith("[rank0] ") and "step 2/2 loss" in x for x in log.splitlines()), log[
        -3000:
    ]
    for rank in (0, 1):
        assert any(
            x.startswith(f"[rank{rank}] ") and f"rank {rank} trained steps 1..2 of 2" in x
            for x in log.splitlines()
        ), log[-3000:]
    prog = json.loads((tmp_path / "ck" / "progress.json").read_text())
    assert prog["phase"] == "Finished" and len(prog["moe"]["allToAllBytesPerStepByRank"]) == 2
    assert (tmp_path / "term").read_text() == ""  # success: no failure document

    env["WORLD_SIZE"] = "4"
    bad = subprocess.run(
        [sys.executable, "-m", "moe_trainer.train", "--cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 78, bad.stderr[-2000:]
    doc = json.loads((tmp_path / "term").read_text())
    assert (doc["kind"], doc["cause"], doc["exitCode"]) == ("TrainerExit", "BadConfig", 78)
    assert "WORLD_SIZE=4 is not NNODES x NPROC_PER_NODE = 1 x 2" in doc["message"]
