"""The demo's closed loop (``moe_localkube.demo_loop``): job 2 planned from job 1's routing
statistics, and the bytes it saves as the demo prints them.

Unit part: the printed figures are the plan's and the progress documents' numbers, whatever
they are. Cluster part (slow): the demo's two jobs on the local cluster; job 1
(``baseline_manifest``: contiguous, AutoEP) trains and records routing statistics, job 2
(``planned_manifest``) plans from them and trains to Succeeded with the de-duplicating
dispatcher; the figures the demo prints are the ones job 2's plan and both jobs' progress hold,
and job 2's trainers counted fewer bytes across NVLink groups over the run than job 1's.
"""

from __future__ import annotations

import json

import pytest

from moe_localkube import demo_loop
from moejob_operator import constants as C
from operator_harness import module_operator


def plan_doc(cross, contiguous, *, stats_from=None, dedup=None, autoep=None, fell_back=False):
    q = {
        "crossGroupBytesPerStep": cross,
        "contiguousCrossGroupBytesPerStep": contiguous,
        "maxMeanLoad": 1.25,
        "contiguousMaxMeanLoad": 1.5,
        "basis": "routingStats" if stats_from else "uniform",
    }
    if dedup is not None:
        q["dispatch"] = {
            "dedup": {"crossGroupBytesPerStep": dedup},
            "autoep": {"crossGroupBytesPerStep": autoep},
        }
    pl = {"strategy": "topology_aware", "dispatcher": "dedup", "quality": q}
    if fell_back:
        pl["fellBackTo"] = "contiguous"
    if stats_from:
        pl["routingStatsFrom"] = {"job": stats_from, "tokens": 640}
    return {"placement": pl}


def test_planned_manifest_reads_the_first_jobs_statistics():
    doc = {
        "apiVersion": "x/v1",
        "kind": "MoETrainingJob",
        "metadata": {"name": "tiny", "uid": "u", "resourceVersion": "7"},
        "spec": {"placement": {"strategy": "Contiguous", "expertParallelSize": 2}},
    }
    out = demo_loop.planned_manifest(doc, "tiny")
    assert out["metadata"] == {"name": "tiny-planned"}
    assert out["spec"]["placement"] == {
        "strategy": "TopologyAware",
        "dispatcher": "Dedup",
        "expertParallelSize": 2,
        "routingStatsFrom": {"jobName": "tiny"},
    }
    assert doc["spec"]["placement"]["strategy"] == "Contiguous"  # the input is not changed
    base = demo_loop.baseline_manifest({"metadata": {"name": "tiny"}, "spec": {}})
    assert base["spec"]["placement"] == {"strategy": "Contiguous", "dispatcher": "AutoEP"}


@pytest.mark.parametrize(("cross", "contiguous"), [(61_440, 81_920), (84_992, 81_920)])
def test_printed_saving_is_the_plans(cross, contiguous, tmp_path):
    a = demo_loop.PlanBytes.from_plan("one", plan_doc(90_000, 90_000, fell_back=True), {"moe": {}})
    since = {"steps": 4, "byTier": {"intraGroup": 0, "crossGroup": 17_284, "crossNode": 9}}
    b = demo_loop.PlanBytes.from_plan(
        "two",
        plan_doc(cross, contiguous, stats_from="one", dedup=5_000, autoep=9_000),
        {"moe": {"allToAllBytesSinceStart": since}},
    )
    assert a.strategy == "contiguous" and a.dedup_cross_group_bytes is None
    assert b.saved_bytes == contiguous - cross and b.counted_cross_group_bytes == 17_284
    assert b.counted_steps == 4 and b.counted_per_step == 4_321
    assert b.predicted_cross_group_bytes == 5_000  # its dispatcher is dedup
    lines = demo_loop.comparison(a, b)
    assert not any(ln.startswith("counted:") for ln in lines)  # job 1 counted nothing here
    saved = next(ln for ln in lines if ln.startswith(("saved:", "no saving:")))
    dispatcher = next(ln for ln in lines if ln.startswith("dispatcher:"))
    assert "de-duplicating 5,000 bytes" in dispatcher and "AutoEP 9,000" in dispatcher
    assert "(0.556x)" in dispatcher
    if cross < contiguous:
        assert saved.startswith(f"saved: {contiguous - cross:,} bytes per step"), saved
    else:  # a plan worse than contiguous is said so, not printed as a negative saving
        assert saved.startswith(f"no saving: {cross - contiguous:,} bytes per step more"), saved
    assert f"{cross:,} instead of {contiguous:,}" in saved and "from one's routing" in saved
    assert f"{cross / contiguous:.3f}x contiguous" in saved
    assert "load max/mean 1.250, contiguous 1.500" in saved  # what the layout bought instead
    table = "\n".join(lines)
    assert "4.2 KiB" in table and "8.8 KiB" in table  # counted, AutoEP: as read
    load_row = next(ln for ln in lines if "load max/mean per GPU" in ln)
    assert load_row.split()[-2:] == ["1.500", "1.250"]  # job 1 ran contiguous on those tokens
    plot = demo_loop.write_plot(tmp_path, a, b)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = demo_loop.result(a, b)
    assert doc["savedCrossGroupBytesPerStep"] == contiguous - cross
    assert doc["jobs"][1]["counted_cross_group_bytes"] == 17_284
    assert doc["countedCrossGroupJob2VsJob1"] is None  # job 1 counted nothing


def test_counted_line_is_both_progress_sums():
    def progress(total, steps):
        return {
            "moe": {"allToAllBytesSinceStart": {"steps": steps, "byTier": {"crossGroup": total}}}
        }

    a = demo_loop.PlanBytes.from_plan(
        "one", plan_doc(90_000, 90_000, fell_back=True), progress(40_000, 4)
    )
    b = demo_loop.PlanBytes.from_plan(
        "two", plan_doc(80_000, 90_000, stats_from="one"), progress(30_000, 4)
    )
    counted = next(ln for ln in demo_loop.comparison(a, b) if ln.startswith("counted:"))
    assert counted.startswith("counted: 30,000 bytes across NVLink groups in 4 steps of two, ")
    assert "40,000 in 4 steps of one (0.750x;" in counted
    assert demo_loop.result(a, b)["countedCrossGroupJob2VsJob1"] == 0.75


# ---- cluster: the demo's second job on the local cluster -------------------------------------
operator_proc = module_operator()


@pytest.mark.cluster
@pytest.mark.slow
def test_second_job_plans_from_the_first_and_saves_cross_group_bytes(
    kube, kubectl, namespace, operator_proc, wait_for, tmp_path
):
    from operator_harness import apply_job, example, get_job

    ckpt = {"everySteps": 4, "volume": {"hostPath": {"path": str(tmp_path)}}}
    first = example("tiny-cpu.yaml", checkpoint=ckpt)
    first["metadata"]["name"] = "loop-a"
    first["spec"]["training"]["steps"] = 4
    first["spec"]["data"] = demo_loop.text_data(tmp_path / "data")  # as the demo does
    first = demo_loop.baseline_manifest(first)
    second = demo_loop.planned_manifest(first, "loop-a")
    assert second["metadata"]["name"] == "loop-a-planned"

    def succeeded(name):
        out = kubectl.run(
            "wait",
            "--for=condition=Succeeded",
            f"moejob/{name}",
            "-n",
            namespace,
            "--timeout=600s",
            check=False,
            timeout=620,
        )
        assert out.returncode == 0, (
            f"{out.stderr}\n{get_job(kube, namespace, name).get('status')}\n{operator_proc.logs()}"
        )

    apply_job(kube, namespace, first)
    succeeded("loop-a")
    apply_job(kube, namespace, second)
    succeeded("loop-a-planned")

    a, b = demo_loop.report(kube, namespace, "loop-a", "loop-a-planned")
    plan = json.loads(
        kube.core.read_namespaced_config_map("loop-a-planned-plan", namespace).data[C.PLAN_KEY]
    )
    q = plan["placement"]["quality"]
    assert plan["placement"]["routingStatsFrom"]["job"] == "loop-a"
    assert q["basis"] == "routingStats" and b.basis == "routingStats"
    assert get_job(kube, namespace, "loop-a-planned")["status"]["plan"]["routingStatsFrom"] == (
        "loop-a"
    )
    # the saving printed is the plan's own (on the recorded tokens; it can be negative on this
    # tiny model's near-uniform routing, and then the demo says "no saving")
    assert b.cross_group_bytes == q["crossGroupBytesPerStep"] > 0
    assert b.contiguous_cross_group_bytes == q["contiguousCrossGroupBytesPerStep"] > 0
    assert b.saved_bytes == q["contiguousCrossGroupBytesPerStep"] - q["crossGroupBytesPerStep"]
    assert (b.max_mean_load, b.contiguous_max_mean_load) == (
        q["maxMeanLoad"],
        q["contiguousMaxMeanLoad"],
    )
    lines = demo_loop.comparison(a, b)
    saved = next(ln for ln in lines if ln.startswith(("saved:", "no saving:")))
    assert f"{abs(b.saved_bytes):,} bytes per step" in saved, saved
    assert saved.startswith("saved:" if b.saved_bytes > 0 else "no saving:"), saved
    assert (
        f"{q['crossGroupBytesPerStep']:,} instead of {q['contiguousCrossGroupBytesPerStep']:,}"
        in saved
    )
    # what the trainers counted over each run, as each job's progress ConfigMap has it
    for pb in (a, b):
        progress = json.loads(
            kube.core.read_namespaced_config_map(f"{pb.job}-progress", namespace).data[
                C.PROGRESS_KEY
            ]
        )
        since = progress["moe"]["allToAllBytesSinceStart"]
        assert since["steps"] == pb.counted_steps == 4, (pb, progress["moe"])
        assert pb.counted_cross_group_bytes == since["byTier"]["crossGroup"] > 0
        assert progress["moe"]["dispatcher"] == pb.dispatcher
    assert (a.strategy, a.dispatcher, b.dispatcher) == ("contiguous", "autoep", "dedup")
    # the product's job sent fewer bytes across NVLink groups over the same tokens
    assert b.counted_cross_group_bytes < a.counted_cross_group_bytes, (a, b)
    counted_line = next(ln for ln in lines if ln.startswith("counted:"))
    assert f"{b.counted_cross_group_bytes:,} bytes" in counted_line, counted_line
    assert f"{a.counted_cross_group_bytes:,} in 4 steps of loop-a " in counted_line, counted_line
    assert demo_loop.write_result(tmp_path, a, b).is_file()
