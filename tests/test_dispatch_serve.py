"""The byte model with a serve table (replicated experts): ``expert2rank[L, P, E]``."""

from __future__ import annotations

import numpy as np

from moe_contracts.dispatch import tier_bytes

# 2 NVLink groups x 2 ranks, one node per group; 4 experts, one per rank (home = expert id)
GROUP, NODE = [0, 0, 1, 1], [0, 0, 1, 1]
HOME = np.array([[0, 1, 2, 3]])


def _bytes(table, token_experts, src):
    return tier_bytes(table, token_experts, src, GROUP, NODE, 4, hidden_bytes=8, backward=False)


def test_a_serve_table_that_repeats_the_home_ranks_counts_what_the_single_copy_table_counts():
    rng = np.random.default_rng(0)
    te = np.stack([rng.permutation(4)[:2] for _ in range(64)])[None]  # [1, 64, 2]
    src = np.arange(64) % 4
    serve = np.broadcast_to(HOME[:, None, :], (1, 4, 4)).copy()
    assert _bytes(serve, te, src) == _bytes(HOME, te, src)


def test_a_copy_in_the_tokens_own_group_removes_its_stage_a_row():
    # one token on rank 0 (group 0) choosing experts 0 and 2: expert 2 lives on rank 2 (group 1)
    te, src = np.array([[[0, 2]]]), np.array([0])
    single = _bytes(HOME, te, src)["dedup"]
    row = 2 * 8 + 2 * (4 + 4)  # dispatch + combine of one row: 2 H + K (id + weight)
    # stage A: rank 0 -> rank 2 (rail peer in group 1); stage B: none (rank 2 holds expert 2)
    assert single == {"intraGroup": 0.0, "crossGroup": row, "crossNode": row}
    serve = np.broadcast_to(HOME[:, None, :], (1, 4, 4)).copy()
    serve[0, 0, 2] = 1  # a copy of expert 2 on rank 1 serves rank 0's tokens
    replicated = _bytes(serve, te, src)["dedup"]
    # no stage A row leaves group 0; stage B sends one row 0 -> 1 inside the group
    assert replicated == {"intraGroup": row, "crossGroup": 0.0, "crossNode": 0.0}
