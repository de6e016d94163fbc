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

Copies of one iteration may come from different saves of it (a node that was away while the
iteration was saved again comes back with the earlier save's parts). The plan takes one save: the
newest (save tokens order saves by time, see :mod:`tierpoint.local.agreement`) of those with a
good copy of every part, else the newest; only its copies are sources, and an own part or a replica
of another save counts as missing (it is replaced). Reports without saves (``saves`` empty) match
any save.
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
    saves: list[str] = field(default_factory=list)  # the save of each copy in holds, in its order

    @classmethod
    def from_json(cls, obj: dict) -> HolderStatus:
        bad = [list(p) for p in obj["bad_sources"]]
        return cls(bool(obj["own_ok"]), list(obj["holds"]), bad, list(obj.get("saves") or []))


@dataclass
class RetrievalPlan:
    moves: list[tuple[int, int, int]]  # (source, destination, origin)
    lost: list[int]  # ranks whose own part no rank can supply
    unreplicated: list[tuple[int, int]]  # (holder, origin) replicas that cannot be restored now
    mixed: bool = False  # good copies of more than one save were reported


def plan_retrieval(
    statuses: Sequence[HolderStatus], holders_of: Callable[[int], list[int]] | None
) -> RetrievalPlan:
    """Moves that repair what ``statuses`` report; see the module docstring.

    ``holders_of(origin)`` names the ranks that should hold a replica of ``origin`` (``None``: no
    replication, only own parts are fetched, from wherever a copy exists).
    """
    world = len(statuses)
    bad = {(s, o) for st in statuses for s, o in st.bad_sources}
    save_of = [dict(zip(st.holds, st.saves)) for st in statuses]

    def intact(rank: int, origin: int) -> bool:
        st = statuses[rank]
        if (rank, origin) in bad or origin not in st.holds:
            return False
        return st.own_ok if rank == origin else True

    copies: dict[str, set[int]] = {}  # save -> the origins it has an intact copy of
    for rank, saves in enumerate(save_of):
        for origin, save in saves.items():
            if intact(rank, origin):
                copies.setdefault(save, set()).add(origin)
    chosen = max(copies, key=lambda s: (len(copies[s]) == world, s), default=None)

    def of_chosen(rank: int, origin: int) -> bool:
        return save_of[rank].get(origin, chosen) == chosen

    def has_good_copy(rank: int, origin: int) -> bool:
        return intact(rank, origin) and of_chosen(rank, origin)

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
        if not (st.own_ok and of_chosen(rank, rank)) and not assign(rank, rank):
            lost.append(rank)
    if holders_of is not None:
        for origin in range(world):
            for holder in holders_of(origin):
                if has_good_copy(holder, origin):
                    continue
                if not assign(holder, origin):
                    unreplicated.append((holder, origin))
    return RetrievalPlan(moves, lost, unreplicated, len(copies) > 1)
