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
