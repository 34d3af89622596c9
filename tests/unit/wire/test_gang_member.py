"""The gang's members as allGather carries them (sparkdl._internal.wire.gang_member): every
task's records come back typed, in rank order; anything else is refused by name."""

from __future__ import annotations

import json

import pytest

from sparkdl._internal.wire.gang_member import Member


def test_every_tasks_members_come_back_in_rank_order() -> None:
    task0 = [Member("10.0.0.1", 41000, 7, True, hub=42000), Member("10.0.0.1", None, 7, True, backend={"mpi": 5})]
    task1 = [Member("10.0.0.2", None, 9, False, unshared="no marker", backend={"port": 6})]
    gathered = [Member.encode(task0), Member.encode(task1)]
    assert Member.decode_all(gathered) == [*task0, *task1]


@pytest.mark.parametrize("raw", [{"host": "h"}, {"host": 1, "port": None, "tid": 1, "direct": True, "hub": None,
                                                  "unshared": None, "backend": {}}, "h:1"])
def test_a_record_that_is_not_a_members_is_refused(raw: object) -> None:
    with pytest.raises(ValueError, match="not a gang member's record"):
        Member.decode_all([json.dumps([raw])])
