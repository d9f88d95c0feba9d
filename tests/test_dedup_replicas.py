"""Replicated experts in the dedup dispatcher (#33): 4 gloo processes (2 groups x 2 ranks, fp32),
outputs and gradients with copies equal a one-process single-copy AutoEP reference within 1e-5
(tests/dedup_worker.py); the dispatch counters equal `moe_contracts.dispatch.tier_bytes` with the
serve table, and the weight-sync counters equal the copies' weight bytes."""

import numpy as np
import pytest

from moe_contracts.dispatch import tier_bytes
from test_dedup_ep import TOL, run_world

pytestmark = pytest.mark.slow
H, FFN = 32, 48  # dedup_worker's tiny Mixtral
EVERY_GROUP = [[e, r] for e in range(4) for r in (0, 2)]  # a copy in every group
ONE_GROUP = [[e, r] for e in (0, 5) for r in range(4)]  # copies on both ranks of each group
REMOTE = [[0, 1], [1, 1], [2, 3], [3, 0], [4, 2]]  # some groups served by a non-home copy
CASES = [
    dict(
        name="top-2 copy in every group", experts=8, topk=2, scoreApply="post", copies=EVERY_GROUP
    ),
    dict(
        name="top-8 copy in every group", experts=16, topk=8, scoreApply="post", copies=EVERY_GROUP
    ),
    dict(
        name="top-2 two ranks of one group, pre, checkpointed",
        experts=8,
        topk=2,
        scoreApply="pre",
        copies=ONE_GROUP,
        checkpoint=True,
    ),
    dict(
        name="top-8 two ranks of one group, pre",
        experts=16,
        topk=8,
        scoreApply="pre",
        copies=ONE_GROUP,
    ),
    dict(name="top-2 remote copies", experts=8, topk=2, scoreApply="post", copies=REMOTE),
    dict(
        name="top-8 flat 4x1, empty rank",
        experts=16,
        topk=8,
        scoreApply="post",
        copies=EVERY_GROUP,
        groups=[0, 1, 2, 3],
        deadRanks=[3],
    ),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    cases = [dict({"groups": [0, 0, 1, 1]}, **c) for c in CASES]
    return run_world(4, tmp_path_factory.mktemp("replicas"), cases)


def test_outputs_and_gradients_with_copies_match_the_single_copy_reference(ranks):
    for i, case in enumerate(CASES):
        assert any(len(h) > 1 for h in ranks[0][i]["holders"]), case["name"]  # it has copies
        for r in range(4):
            res = ranks[r][i]
            for key, err in res["maxErr"].items():
                assert err <= TOL * max(1.0, res["scale"][key]), (case["name"], r, key, err)
            assert res["scale"]["output"] > 1e-3, case["name"]


def test_dispatch_counters_equal_the_byte_model_with_the_serve_table(ranks):
    for i, case in enumerate(CASES):
        per = [ranks[r][i] for r in range(4)]
        serve = np.array(per[0]["serve"])[None]  # [1, P, E]
        te = np.concatenate([np.array(p["selected"]) for p in per])[None]  # [1, T, K]
        src = np.concatenate([np.full(len(p["selected"]), r) for r, p in enumerate(per)])
        groups = case.get("groups", [0, 0, 1, 1])
        passes = 2 if case.get("checkpoint") else 1
        want = tier_bytes(
            serve, te, src, groups, groups, 4, hidden_bytes=H * 4, forward_passes=passes
        )
        got = {t: sum(p["bytes"][t] for p in per) for t in want["dedup"]}
        assert got == {t: round(v) for t, v in want["dedup"].items()}, case["name"]
        # and the copies change what is sent: the single-copy table predicts other bytes
        home = np.array(per[0]["home"])[None]
        single = tier_bytes(
            home, te, src, groups, groups, 4, hidden_bytes=H * 4, forward_passes=passes
        )
        assert single["dedup"] != want["dedup"], case["name"]


def test_weight_sync_counters_count_each_copy_forward_and_backward(ranks):
    row = 3 * H * FFN * 4  # w1 + w2 + w3 of one expert, fp32
    for i, case in enumerate(CASES):
        per = [ranks[r][i] for r in range(4)]
        groups = case.get("groups", [0, 0, 1, 1])
        passes = 2 if case.get("checkpoint") else 1
        want = {"intraGroup": 0, "crossGroup": 0, "crossNode": 0}
        for hs in per[0]["holders"]:
            for h in hs[1:]:
                tier = "intraGroup" if groups[h] == groups[hs[0]] else "crossGroup"
                want[tier] += (passes + 1) * row
        want["crossNode"] = want["crossGroup"]
        got = {t: sum(p["syncBytes"][t] for p in per) for t in want}
        assert got == want, case["name"]
