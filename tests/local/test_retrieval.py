"""Retrieval planning (a pure function of what every rank reports): sources are spread, failed sources
are not chosen again, parts with no copy are reported lost."""

from __future__ import annotations

from tierpoint.local.retrieval import HolderStatus, plan_retrieval


def test_retrieval_plan_spreads_sources_and_reports_losses() -> None:
    # 4 ranks, every rank holds every part except rank 3, which lost everything.
    statuses = [HolderStatus(True, [0, 1, 2, 3]) for _ in range(3)] + [HolderStatus(False, [])]
    plan = plan_retrieval(statuses, lambda o: [r for r in range(4) if r != o])
    fetched_by_3 = sorted(src for src, dst, _ in plan.moves if dst == 3)
    assert len(fetched_by_3) == 4 and len(set(fetched_by_3)) == 3  # own part + 3 replicas, spread
    assert not plan.lost
    # Nobody else holds rank 3's part: lost.
    statuses = [HolderStatus(True, [r]) for r in range(3)] + [HolderStatus(False, [])]
    assert plan_retrieval(statuses, None).lost == [3]
    # A source that failed before is not chosen again.
    statuses = [HolderStatus(True, [0, 1]), HolderStatus(False, [0, 1], [[0, 1]])]
    assert plan_retrieval(statuses, None).lost == [1]
    # A replica comes from the origin, whose part the load verified, rather than from another
    # holder's copy (only its header was checked), when both are as busy.
    statuses = [HolderStatus(True, [0, 1]), HolderStatus(True, [0, 1]), HolderStatus(True, [2])]
    plan = plan_retrieval(statuses, lambda o: [r for r in range(3) if r != o])
    assert (0, 2, 0) in plan.moves and (1, 2, 1) in plan.moves


def test_retrieval_takes_the_copies_of_the_newest_complete_save() -> None:
    # Rank 0 is back with an earlier save ("a") of every part; rank 1's own part is damaged; the
    # newer save ("b", tokens sort by time) is complete on ranks 1 and 2.
    statuses = [
        HolderStatus(True, [0, 1, 2], [], ["a", "a", "a"]),
        HolderStatus(False, [0, 1, 2], [], ["b", "b", "b"]),
        HolderStatus(True, [0, 1, 2], [], ["b", "b", "b"]),
    ]
    plan = plan_retrieval(statuses, None)
    assert sorted(plan.moves) == [(1, 0, 0), (2, 1, 1)] and plan.mixed and not plan.lost
    # Restoring replicas, rank 0's copies of save "a" are replaced too, from holders of "b".
    plan = plan_retrieval(statuses, lambda o: [r for r in range(3) if r != o])
    assert {(d, o) for _, d, o in plan.moves} == {(0, 0), (1, 1), (0, 1), (0, 2)}
    assert all(s != 0 for s, _, _ in plan.moves)
    # The newest save has no copy of rank 0's part: the older, complete one is taken.
    statuses = [HolderStatus(True, [0, 1], [], ["a", "a"]), HolderStatus(True, [1], [], ["b"])]
    plan = plan_retrieval(statuses, None)
    assert plan.moves == [(0, 1, 1)] and not plan.lost
    # No save is complete: the newest is taken, and rank 0 has no copy of it.
    statuses = [HolderStatus(True, [0], [], ["a"]), HolderStatus(True, [1], [], ["b"])]
    assert plan_retrieval(statuses, None).lost == [0]
