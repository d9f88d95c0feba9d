"""Replicated experts' tables (`moe_trainer.dispatch.dedup_replicas`, #33), without processes: the
plan's copies in original ids become router-id layouts, a bad layout is refused naming the entry,
and every rank's virtual ids, local copy order and weight-sync splits agree with each other."""

import pytest
import torch

from moe_contracts.plan import LayerReplicas
from moe_trainer.dispatch import dedup_ep
from moe_trainer.dispatch.dedup_replicas import copies_of, plan_layouts, sync_bytes

E, P = 8, 4
BASE = dedup_ep.contiguous_layout(E, P, [0, 0, 1, 1], [0, 0, 1, 1])


def layer(perm: list[int], extra: dict[int, list[int]]) -> LayerReplicas:
    home = {e: s // 2 for s, e in enumerate(perm)}
    holders = tuple((home[e], *extra.get(e, [])) for e in range(E))
    serve = tuple(
        tuple(p if p in holders[e] else holders[e][0] for e in range(E)) for p in range(P)
    )
    return LayerReplicas(holders=holders, serve=serve)


PERM = [7, 6, 5, 4, 3, 2, 1, 0]


def test_plan_copies_in_original_ids_become_router_id_layouts():
    (lay,) = plan_layouts(BASE, [layer(PERM, {7: [3], 0: [0, 1]})], [PERM])
    lay.check(P, E, E // P)
    # original expert 7 sits in slot 0 (rank 0) and gets a copy on rank 3
    assert lay.holders[0] == (0, 3) and lay.serve[3][0] == 3 and lay.serve[2][0] == 0
    # original expert 0 sits in slot 7 (rank 3), copies on ranks 0 and 1
    assert lay.holders[7] == (3, 0, 1) and [lay.serve[p][7] for p in range(P)] == [0, 1, 3, 3]


@pytest.mark.parametrize(
    ("holders", "serve", "says"),
    [
        ({0: (1, 0)}, {}, "must start with the home rank 0"),
        ({0: (0, 0)}, {}, "are not distinct EP ranks"),
        ({0: (0, 4)}, {}, "are not distinct EP ranks < 4"),
        ({}, {(2, 0): 3}, "serve[2][0]: rank 3 holds no copy of expert 0"),
    ],
)
def test_a_bad_layout_is_refused_naming_the_entry(holders, serve, says):
    import dataclasses

    hs = [holders.get(e, (e // 2,)) for e in range(E)]
    sv = [[serve.get((p, e), hs[e][0]) for e in range(E)] for p in range(P)]
    bad = dataclasses.replace(BASE, holders=tuple(hs), serve=tuple(map(tuple, sv)))
    with pytest.raises(dedup_ep.DispatchError, match=r".*" + says.replace("[", r"\[")):
        bad.check(P, E, E // P)


def test_every_ranks_tables_agree():
    extra = {0: [2, 3], 5: [3], 6: [0, 1]}  # 5: inside group 1, the rest across
    (lay,) = plan_layouts(BASE, [layer(list(range(E)), extra)], [list(range(E))])
    plans = [dedup_ep.Plan(lay, r, None, None, None, torch.device("cpu")) for r in range(P)]
    reps = [p.replicas for p in plans]
    assert all(r is not None for r in reps)
    # every rank names the same virtual ids; a rank's copies follow its E / P home slots
    for r in reps:
        assert torch.equal(r.v2r, reps[0].v2r) and torch.equal(r.v2l, reps[0].v2l)
    assert [r.num_copies for r in reps] == [1, 1, 1, 2]
    # what each home sends is what each holder receives
    for s in range(P):
        for d in range(P):
            assert reps[s].send[d] == reps[d].recv[s], (s, d)
    # tokens of rank p reach the rank the serve table names
    for p in range(P):
        assert [int(reps[p].v2r[v]) for v in reps[p].vid] == list(lay.serve[p])
    # the weight sync moves one expert row per copy, there and back
    assert len(copies_of(lay)) == 5
    got = sync_bytes(lay, 10)
    assert got == {"intraGroup": 1 * 2 * 10, "crossGroup": 4 * 2 * 10, "crossNode": 4 * 2 * 10}


def test_a_layer_without_copies_runs_the_single_copy_path():
    (lay,) = plan_layouts(BASE, [layer(PERM, {})], [PERM])
    assert dedup_ep.Plan(lay, 0, None, None, None, torch.device("cpu")).replicas is None


def test_the_trainer_refuses_copies_its_dispatcher_cannot_serve(tmp_path, caplog):
    import json
    from pathlib import Path

    from moe_trainer.train import run

    doc = json.loads(
        (Path(__file__).parent / "fixtures" / "plans" / "tiny_mixtral_autoep.json").read_text()
    )
    perm = doc["placement"]["permutation"]
    reps = []
    for row in perm:
        home = [row.index(e) // 2 for e in range(4)]
        holders = [[h, 1 - h] for h in home]  # every expert on both EP ranks
        reps.append({"holders": holders, "serve": [[p] * 4 for p in range(2)]})
    doc["placement"].update(replicas=reps, dispatcher="autoep")
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(doc))
    assert run(["--plan", str(p)]) == 78
    assert "copies are served by the 'dedup' dispatcher only" in caplog.text
    reps[0]["serve"][1][2] = 5  # rank 5 holds nothing
    doc["placement"].update(replicas=reps, dispatcher="dedup")
    p.write_text(json.dumps(doc))
    assert run(["--plan", str(p)]) == 78
    assert "serve[1][2]: rank 5 holds no copy of expert 2" in caplog.text


def test_the_smoke_check_predicts_with_the_serve_table_of_the_installed_layers():
    from types import SimpleNamespace

    from moe_trainer.dispatch.dedup_replicas import serve_table
    from moe_trainer.gate.dispatch import predict

    (lay,) = plan_layouts(BASE, [layer(PERM, {7: [3], 0: [0, 1]})], [PERM])
    single = dedup_ep.Plan(BASE, 0, None, None, None, torch.device("cpu"))
    copies = dedup_ep.Plan(lay, 0, None, None, None, torch.device("cpu"))
    assert serve_table([SimpleNamespace(dedup_plan=single)]) is None
    table = serve_table([SimpleNamespace(dedup_plan=copies), SimpleNamespace(dedup_plan=single)])
    assert table == [[list(r) for r in lay.serve], [list(BASE.expert2rank)] * P]
    # a token of rank 3 choosing slot 0 (rank 0, with a copy on rank 3) and slot 4 (rank 2): with
    # the copy nothing leaves group 1 in layer 0 (layer 1 has no copies)
    tokens = [[[torch.zeros(0, 2, dtype=torch.long)] * 2] for _ in range(3)]
    tokens.append([[torch.tensor([[0, 4]])] * 2])
    kw = dict(num_experts=E, ep_size=P, rank_group=[0, 0, 1, 1], rank_node=[0, 0, 1, 1])
    kw.update(row_bytes=8, forward_passes=1)
    with_copies = predict(tokens, serve=table, **kw)["dedup"]
    without = predict(tokens, **kw)["dedup"]
    assert with_copies["crossGroup"] == without["crossGroup"] / 2 > 0
    assert with_copies["intraGroup"] < without["intraGroup"]  # no relay from rank 1 to rank 0
