"""The PlacementUpdate contract (operator -> trainer, re-placement during a job)."""

from __future__ import annotations

import pytest

from moe_contracts import placement_update as PU
from moe_contracts.errors import DocumentError


def test_round_trip_and_checks():
    u = PU.PlacementUpdate(generation=2, permutation=[[1, 0, 2, 3]], decided_at_step=40)
    back = PU.loads(PU.dumps(u))
    assert back == u and back.check(1, 4, ep_size=2) is back
    assert '"decidedAtStep":40' in PU.dumps(u)


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"kind": "Other", "version": 1}, "kind"),
        ({"kind": "PlacementUpdate", "version": 2}, "version"),
        ({"kind": "PlacementUpdate", "version": 1, "generation": -1, "permutation": []}, "gen"),
        ({"kind": "PlacementUpdate", "version": 1, "generation": "1", "permutation": []}, "gen"),
    ],
)
def test_bad_documents_are_refused(doc, match):
    with pytest.raises(DocumentError, match=match):
        PU.parse(doc)


def test_a_permutation_that_does_not_fit_the_model_is_refused():
    u = PU.PlacementUpdate(generation=1, permutation=[[0, 0, 1, 2]])
    with pytest.raises(DocumentError, match="not a permutation"):
        u.check(1, 4, ep_size=2)
    with pytest.raises(DocumentError, match="layers"):
        u.check(2, 4, ep_size=2)
