"""DedupEP exactness: real gloo processes (fp32, CPU), each case against a one-process AutoEP
reference at EP = 1 (tests/dedup_worker.py does the work; one launch runs all cases of a world
size because each start costs the machine ~30 s of DeepSpeed import)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_trainer.launch import local_world_envs

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "dedup_worker.py"
TOL = 1e-5

CASES = {
    4: [
        dict(name="2x2 top-2 post", experts=8, topk=2, scoreApply="post", groups=[0, 0, 1, 1]),
        dict(name="2x2 top-8 post", experts=16, topk=8, scoreApply="post", groups=[0, 0, 1, 1]),
        dict(name="2x2 top-2 pre", experts=8, topk=2, scoreApply="pre", groups=[0, 0, 1, 1]),
        dict(
            name="2x2 top-8 pre, empty group",
            experts=16,
            topk=8,
            scoreApply="pre",
            groups=[0, 0, 1, 1],
            deadRanks=[2, 3],
        ),
        dict(
            name="2x2 top-2 post, empty rank, checkpointed",
            experts=8,
            topk=2,
            scoreApply="post",
            groups=[0, 0, 1, 1],
            deadRanks=[1],
            checkpoint=True,
        ),
        dict(
            name="groups not in rank order",
            experts=8,
            topk=2,
            scoreApply="post",
            groups=[0, 1, 0, 1],
        ),
        dict(name="4x1 flat top-8", experts=16, topk=8, scoreApply="post", groups=[0, 1, 2, 3]),
        dict(name="1x4 one group top-2", experts=8, topk=2, scoreApply="post", groups=[0, 0, 0, 0]),
    ],
    2: [
        dict(name="2x1 top-2 post", experts=4, topk=2, scoreApply="post", groups=[0, 1]),
        dict(name="2x1 top-8 pre", experts=16, topk=8, scoreApply="pre", groups=[0, 1]),
        dict(
            name="2x1 top-2 post, empty group",
            experts=8,
            topk=2,
            scoreApply="post",
            groups=[0, 1],
            deadRanks=[0],
        ),
        dict(name="1x2 top-2", experts=4, topk=2, scoreApply="post", groups=[0, 0]),
    ],
}


def run_world(nproc: int, out: Path, cases: list[dict] | None = None) -> list[list[dict]]:
    cases = [
        dict({"deadRanks": [], "tokens": 10, "seed": 7 + i}, **c)
        for i, c in enumerate(CASES[nproc] if cases is None else cases)
    ]
    envs = local_world_envs(nproc, dict(os.environ, CASES=json.dumps(cases), OUT=str(out)))
    procs = []
    for r in range(nproc):
        with open(out / f"log{r}.txt", "w") as log:  # the child keeps its own copy
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=envs[r],
                )
            )
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * nproc, (out / "log0.txt").read_text()[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module", params=[4, 2], ids=["4 ranks", "2 ranks"])
def world(request, tmp_path_factory):
    return request.param, run_world(request.param, tmp_path_factory.mktemp(f"dedup{request.param}"))


def test_outputs_and_gradients_match_single_process_reference(world):
    nproc, ranks = world
    for i, case in enumerate(CASES[nproc]):
        for r in range(nproc):
            res = ranks[r][i]
            for key, err in res["maxErr"].items():
                assert err <= TOL * max(1.0, res["scale"][key]), (
                    case["name"],
                    r,
                    key,
                    err,
                    res["scale"][key],
                )
            assert res["scale"]["output"] > 1e-3, case["name"]  # the check compared something


def test_empty_ranks_get_nothing_and_tiers_follow_the_groups(world):
    nproc, ranks = world
    for i, case in enumerate(CASES[nproc]):
        groups = case["groups"]
        for r in range(nproc):
            res = ranks[r][i]
            assert res["expertsUsed"] == (0 if r in case.get("deadRanks", []) else 1), (
                case["name"],
                r,
            )
            if len(set(groups)) == 1:  # one NVSwitch node: nothing on the slow tier
                assert res["bytes"]["crossGroup"] == 0 and res["bytes"]["intraGroup"] > 0, case[
                    "name"
                ]
            if len(set(groups)) == nproc:  # every rank its own group: all of it crosses
                assert res["bytes"]["intraGroup"] == 0 and res["bytes"]["crossGroup"] > 0, case[
                    "name"
                ]
