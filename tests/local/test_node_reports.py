"""Per-node records of a restore: what the ranks report comes back exactly, and a node whose ranks
report alike sends a record that does not grow with its number of ranks."""

from __future__ import annotations

import json

import pytest

from tierpoint.errors import CheckpointingError
from tierpoint.local.node_reports import (
    expand_statuses,
    listing_parts,
    merge_listings,
    merge_statuses,
)
from tierpoint.rank_ranges import expand, ranges


def test_ranges_round_trip() -> None:
    assert ranges([7, 1, 3, 2, 2]) == [[1, 3], [7, 7]]
    assert list(expand(ranges([7, 1, 3, 2]))) == [1, 2, 3, 7]
    assert ranges([]) == []


def _node_listing(node: int, per_node: int, nodes: int, iterations: list[int]) -> list[dict]:
    """A node's ranks, each holding its own part and the replica of the rank one node on."""
    reports = []
    for rank in range(node * per_node, (node + 1) * per_node):
        partner = (rank + per_node) % (nodes * per_node)
        parts = [[i, o, nodes * per_node] for i in iterations for o in (rank, partner)]
        reports.append({"rank": rank, "parts": parts, "error": None})
    return reports


@pytest.mark.parametrize("per_node", [2, 8, 64])
def test_a_node_listing_is_as_small_at_any_number_of_ranks(per_node: int) -> None:
    nodes = 4
    reports = _node_listing(1, per_node, nodes, [10, 20])
    record = merge_listings(reports)
    expected = sorted(tuple(p) for r in reports for p in r["parts"])
    assert sorted(map(tuple, listing_parts(record))) == expected
    # At most two runs of origins (its own ranks, the next node's) per iteration, whatever the
    # node's size.
    assert [len(spans) <= 2 for _, _, spans in record["parts"]] == [True, True]
    assert len(json.dumps(record)) < 120


def test_listing_errors_are_kept_for_the_ranks_that_had_one() -> None:
    reports = _node_listing(0, 2, 2, [5])
    reports[1] = {"rank": 1, "parts": [], "error": ["OSError", "cannot list /x"]}
    record = merge_listings(reports)
    assert record["errors"] == {"1": ["OSError", "cannot list /x"]}
    assert [p for p in listing_parts(record) if p[1] == 1] == []


def _status(rank: int, own_ok: bool, holds: list[int], **extra: object) -> dict:
    return {"rank": rank, "own_ok": own_ok, "holds": holds, "bad_sources": [], **extra}


def test_statuses_round_trip_with_texts_only_where_a_rank_has_one() -> None:
    world, per_node = 8, 4
    records = []
    for node in range(2):
        reports = []
        for rank in range(node * per_node, (node + 1) * per_node):
            partner = (rank + per_node) % world
            if node == 1:  # a replaced node: nothing on disk
                reports.append(_status(rank, False, [], reason=f"missing part {rank}", kind="E"))
            else:
                reports.append(_status(rank, True, [partner], reason=None, kind=None))
        records.append(merge_statuses(reports))
    assert len(records[0]["groups"]) == 1 and records[0]["texts"] == {}
    assert len(records[1]["groups"]) == 1 and len(records[1]["texts"]) == per_node
    statuses = expand_statuses(json.loads(json.dumps(records)), world)
    assert [s["own_ok"] for s in statuses] == [True] * 4 + [False] * 4
    assert [s["holds"] for s in statuses[:4]] == [[4], [5], [6], [7]]
    assert statuses[5]["reason"] == "missing part 5" and statuses[0]["reason"] is None


def test_a_rank_without_a_status_is_an_error() -> None:
    record = merge_statuses([_status(0, True, [])])
    with pytest.raises(CheckpointingError, match=r"ranks \[\[1, 1\]\]"):
        expand_statuses([record], 2)


def test_statuses_keep_the_save_of_each_copy() -> None:
    reports = [
        _status(0, True, [0, 1], saves=["b", "b"]),
        _status(1, True, [0, 1], saves=["a", "b"]),
    ]
    statuses = expand_statuses(json.loads(json.dumps([merge_statuses(reports)])), 2)
    assert [s["saves"] for s in statuses] == [["b", "b"], ["a", "b"]]
