"""Retrieval planning: which rank sends which part to whom when parts are missing or corrupt.

Call order (inside a collective load): every rank reports a :class:`HolderStatus` for the iteration
being loaded; every rank calls :func:`plan_retrieval` on all reports (the same result everywhere); every
rank carries out the moves (:func:`tierpoint.peers.transfer.move_files`) and reports again, until nothing
is needed or nothing more can be fetched.

The plan is a pure function of the reports, so it is easy to test and identical wherever it is
computed. It fetches (1) each rank's own part when it is missing or failed verification, from a rank
that holds a copy, and (2) each replica a rank should hold by the replication strategy but lacks
(a replaced node), from the origin or another holder. Sources are spread: each transfer goes to the
candidate with the fewest transfers assigned so far, so recovery reads from every holder, not one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class HolderStatus:
    """What one rank has of the iteration being loaded (JSON-able via ``vars``)."""

    own_ok: bool
    holds: list[int] = field(default_factory=list)  # origin ranks whose part this rank has on disk
    bad_sources: list[list[int]] = field(default_factory=list)  # [source, origin] that failed

    @classmethod
    def from_json(cls, obj: dict) -> HolderStatus:
        return cls(bool(obj["own_ok"]), list(obj["holds"]), [list(p) for p in obj["bad_sources"]])


@dataclass
class RetrievalPlan:
    moves: list[tuple[int, int, int]]  # (source, destination, origin)
    lost: list[int]  # ranks whose own part no rank can supply
    unreplicated: list[tuple[int, int]]  # (holder, origin) replicas that cannot be restored now


def plan_retrieval(
    statuses: Sequence[HolderStatus], holders_of: Callable[[int], list[int]] | None
) -> RetrievalPlan:
    """Moves that repair what ``statuses`` report; see the module docstring.

    ``holders_of(origin)`` names the ranks that should hold a replica of ``origin`` (``None``: no
    replication, only own parts are fetched, from wherever a copy exists).
    """
    world = len(statuses)
    bad = {(s, o) for st in statuses for s, o in st.bad_sources}

    def has_good_copy(rank: int, origin: int) -> bool:
        st = statuses[rank]
        if (rank, origin) in bad or origin not in st.holds:
            return False
        return st.own_ok if rank == origin else True

    load = [0] * world
    moves: list[tuple[int, int, int]] = []
    lost: list[int] = []
    unreplicated: list[tuple[int, int]] = []

    def assign(dst: int, origin: int) -> bool:
        candidates = [s for s in range(world) if s != dst and has_good_copy(s, origin)]
        if not candidates:
            return False
        # The least busy; then the origin, whose own part the load just verified (a replica was
        # only checked for a valid header); then the lowest rank.
        src = min(candidates, key=lambda s: (load[s], s != origin, s))
        load[src] += 1
        moves.append((src, dst, origin))
        return True

    for rank, st in enumerate(statuses):
        if not st.own_ok and not assign(rank, rank):
            lost.append(rank)
    if holders_of is not None:
        for origin in range(world):
            for holder in holders_of(origin):
                if origin in statuses[holder].holds and (holder, origin) not in bad:
                    continue
                if not assign(holder, origin):
                    unreplicated.append((holder, origin))
    return RetrievalPlan(moves, lost, unreplicated)
