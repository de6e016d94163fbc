"""Discovery: which iteration is the newest complete on every rank (``find_latest``'s collective).

Call order: the manager calls :meth:`Discovery.find_latest` (collective, every rank at once) when
the latest iteration is not known; the fast path is one all-reduce of a few integers (every rank
holds its own part of the newest iteration, none holds a newer one, and no node's leader sees a
newer one in the directories of ranks now on other nodes); otherwise every node's listing
is gathered (:func:`tierpoint.dist.gather_by_node`, merged per node by
:mod:`tierpoint.local.node_reports`) and :func:`~tierpoint.local.store.complete_iterations` decides,
after :func:`~tierpoint.local.misplaced.adopt_misplaced` copied in the parts that complete a newer
iteration from the directories of ranks that now run on other nodes (then gathered again).
A load that must fall back asks :meth:`Discovery.older_than` for the older candidates.

Invariants: every rank finds the same iteration (or raises alike, when a rank cannot list its
directory); the result is recorded in the store (``store.latest``); why a newer iteration is not
used is logged (another world size, or parts missing everywhere). Nothing is written but those
copies (see :mod:`tierpoint.local.misplaced`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import dist as tpdist
from .. import rank_ranges
from ..errors import CheckpointingError
from . import naming, node_reports
from .misplaced import adopt_misplaced, misplaced_newest
from .store import Listing, PartStore, complete_iterations

logger = logging.getLogger("tierpoint")


class Discovery:
    """Finds the latest complete iteration over ``store`` and keeps what was seen doing so."""

    def __init__(self, store: PartStore) -> None:
        self.store = store
        # Every node's listing as of the last find_latest; None when it decided without them.
        self.listings: list[Listing] | None = []
        # The newest part seen by the last find_latest: (iteration, origin rank, world size).
        self.newest_seen: tuple[int, int, int] | None = None
        # (iteration, why) of each iteration of this world size newer than the latest complete one
        # (some ranks' parts exist nowhere), newest first, as of the last find_latest.
        self.incomplete: list[tuple[int, str]] = []

    def find_latest(self) -> int:
        """The newest iteration complete on every rank, or -1 (also recorded as ``store.latest``).
        Collective."""
        store = self.store
        start = time.perf_counter()
        intact = self._latest_if_intact()
        if intact is not None:
            store.latest, self.listings, self.incomplete = intact, None, []
            self.newest_seen = (intact, store.rank, store.world_size)
            logger.debug("find_latest: %d (%.3f s)", intact, time.perf_counter() - start)
            return intact
        self.listings = listings = self.gather_listings()
        self.incomplete = []
        latest = _latest_usable(listings, store.world_size)
        if adopt_misplaced(store, listings, latest):  # a node's ranks changed since the save
            self.listings = listings = self.gather_listings()
            latest = _latest_usable(listings, store.world_size)
        store.latest = latest
        newest = max((tuple(p) for listing in listings for p in listing), default=None)
        self.newest_seen = newest  # type: ignore[assignment]
        if newest is not None and newest[0] > latest:
            self._note_unusable(listings, latest)
        if latest == naming.NO_CHECKPOINT and not store.holds_parts():
            self._warn_other_ranks_parts()
        logger.debug("find_latest: %d (%.3f s)", latest, time.perf_counter() - start)
        return latest

    def older_than(self, iteration: int) -> list[int]:
        """The complete iterations of this world size older than ``iteration``, newest first, from
        the listings the last :meth:`find_latest` saw (gathered now, collectively, if it decided
        without them)."""
        if self.listings is None:
            self.listings = self.gather_listings()
        older = complete_iterations(self.listings)
        world_size = self.store.world_size
        return sorted(
            (i for i, w in older.items() if w == world_size and i < iteration), reverse=True
        )

    def other_world_parts(self) -> list[tuple[int, int]]:
        """``(iteration, world size)`` of the committed parts the last :meth:`find_latest` saw that
        were saved with another world size than this job's, newest first (the same on every rank:
        the listings are gathered whenever such parts exist). Not collective."""
        world_size = self.store.world_size
        seen = {(p[0], p[2]) for listing in self.listings or () for p in listing}
        return sorted(((i, w) for i, w in seen if w != world_size), reverse=True)

    def unusable(self) -> list[str]:
        """After a :meth:`find_latest` that found nothing complete: why the parts there are cannot
        be loaded, where they show that a checkpoint existed (none: nothing did, as far as can be
        told). Collective (one all-reduce; a gather too where some rank sees parts in other ranks'
        directories); the same on every rank.

        - Parts of two or more incomplete iterations of this world size: a save first removes
          every incomplete iteration, so an older one was complete once (a whole replication
          clique lost since); one alone may be a first save that never finished.
        - No parts in this rank's directory but some in the directory of a rank that sees none of
          its own (it runs on another node now): the ranks of a node changed since the save (parts
          are found by global rank). Parts in the directory of a rank that holds them are not
          (a first save interrupted before every rank's part was in place).
        - Parts in the directories of ranks this job lacks (and none of the above): a job with
          more ranks saved them, not a node whose ranks changed."""
        store = self.store
        partial = sorted(i for i, _ in self.incomplete)  # (every incomplete one: none is complete)
        reasons = []
        if len(partial) >= 2:
            reasons.append(
                f"local steps {', '.join(map(str, partial))}: the parts of some ranks exist "
                "nowhere (more members of a replication clique lost than replicas exist)"
            )
        holds = store.holds_parts()
        try:
            seen = [] if holds else store.other_ranks_with_parts()
        except OSError:
            seen = []
        what = "find_latest: looking for parts in other ranks' directories"
        (found,) = tpdist.reduce_ints([bool(seen)], "max", what)
        beyond: list[int] = []
        if found:  # (every rank: the gather below only where some rank saw any)
            # Only a directory whose rank sees no parts of its own is left behind (that rank runs
            # elsewhere now); a rank that holds parts beside one that holds none is an interrupted
            # first save, or a shared root, where the job starts over. A directory of a rank this
            # job lacks holds the parts of a job with more ranks.
            gathered = tpdist.all_gather_json([holds, seen], what)
            others = {r for _, ranks in gathered for r in ranks}
            beyond = sorted(r for r in others if r >= len(gathered))
            found = any(not gathered[r][0] for r in others if r < len(gathered))
        if found:
            reasons.append(
                "local parts are in the directories of other ranks on some node: the ranks of a "
                "node changed since the save (torchrun numbers nodes anew at each rendezvous "
                "unless --node-rank is fixed); restart with each node's ranks as they were"
            )
        elif beyond:
            reasons.append(
                f"local parts are in the directories of rank(s) {rank_ranges.text(beyond)}, which "
                f"this job of {store.world_size} ranks lacks: they were saved by a job with more "
                "ranks (the local tier does not reshard; restart with as many ranks, or restore "
                "from a persistent checkpoint)"
            )
        return reasons

    def nothing_complete(self) -> CheckpointingError:
        """The error of a load that found no complete iteration (naming the newest parts' world
        size when that is why)."""
        where = self.store.session_dir
        seen = self.newest_seen
        world_size = self.store.world_size
        if seen is not None and seen[2] != world_size:
            return CheckpointingError(
                f"no complete local checkpoint for world size {world_size} under {where}: the newest "
                f"parts (iteration {seen[0]}) were saved with world size {seen[2]}"
            )
        return CheckpointingError(f"no complete local checkpoint under {where}")

    def gather_listings(self) -> list[Listing]:
        """Every node's committed parts, one listing per node (collective; origins travel as
        ranges merged by each node's leader: O(nodes) bytes per rank, see
        :mod:`tierpoint.local.node_reports`). A rank that cannot list its directory makes every
        rank raise."""
        what = "find_latest: gathering local checkpoint listings"
        error = None
        try:
            parts = self.store.scan()
        except (OSError, CheckpointingError) as e:
            parts, error = [], e
        report = {"rank": self.store.rank, "parts": parts, "error": tpdist.failure_status(error)}
        records = tpdist.gather_by_node(report, node_reports.merge_listings, what)
        statuses: list[Any] = [None] * self.store.world_size
        for record in records:
            for rank, status in record["errors"].items():
                statuses[int(rank)] = status
        tpdist.raise_failures(what, statuses, error)
        return [node_reports.listing_parts(record) for record in records]

    def _latest_if_intact(self) -> int | None:
        """The newest iteration, when every rank holds its own part of it and no rank holds a newer
        part, nor do the directories of ranks now on other nodes (a newer part there may complete
        a newer iteration: :mod:`~tierpoint.local.misplaced`), by one all-reduce of a few integers
        (O(1) bytes per rank): it is then complete, and the newest that is. ``None`` on every rank
        otherwise: the listings must be gathered."""
        rank, world_size = self.store.rank, self.store.world_size
        try:
            parts = self.store.scan()
            readable = True
        except (OSError, CheckpointingError):
            parts, readable = [], False  # the gathered path reports it
        newest = max((p[0] for p in parts), default=naming.NO_CHECKPOINT)
        own = max(
            (i for i, origin, world in parts if origin == rank and world == world_size),
            default=naming.NO_CHECKPOINT,
        )
        # A part of another world size at the newest iteration makes it ambiguous: gathered.
        one_world = all(world == world_size for i, _, world in parts if i == newest)
        elsewhere = misplaced_newest(self.store)
        low = tpdist.reduce_ints(
            [readable and one_world, own, -own, -newest, -elsewhere],
            "min",
            "find_latest: comparing the newest local parts",
        )
        if low[0] == 1 and low[1] >= 0 and low[1] == -low[2] == -low[3] >= -low[4]:
            return low[1]
        return None

    def _warn_other_ranks_parts(self) -> None:
        """Nothing is complete and this rank holds no parts, yet directories of other ranks under
        the same root hold some: typically this node's ranks changed since the save (an elastic
        rendezvous numbers nodes anew), and parts are found by global rank. Said, not acted on: on a
        shared root those directories belong to other nodes' ranks."""
        try:
            others = self.store.other_ranks_with_parts()
        except OSError:
            return
        if others:
            logger.warning(
                "rank %d holds no local parts under %s, but the directories of rank(s) %s there "
                "do: parts are found by global rank, so if this node's ranks changed since they "
                "were saved (torchrun numbers nodes anew at each rendezvous unless --node-rank is "
                "fixed), those parts are not used",
                self.store.rank,
                self.store.session_dir,
                ", ".join(map(str, others[:8])) + (", ..." if len(others) > 8 else ""),
            )

    def _note_unusable(self, listings: list[Listing], latest: int) -> None:
        """Say why each iteration newer than ``latest`` (the latest usable one) is not used: saved
        with another world size (the local tier does not reshard), or parts missing everywhere
        (kept in ``incomplete`` too)."""
        world_size = self.store.world_size
        fallback = (
            f"falling back to iteration {latest}"
            if latest != naming.NO_CHECKPOINT
            else "no older complete iteration exists"
        )
        for iteration in sorted({p[0] for listing in listings for p in listing}, reverse=True):
            if iteration <= latest:
                break
            parts = [p for listing in listings for p in listing if p[0] == iteration]
            worlds = {p[2] for p in parts}
            if worlds != {world_size}:
                logger.warning(
                    "local iteration %d was saved with world size %s, this job has %d ranks: the "
                    "local tier does not reshard (a persistent DCP checkpoint does); %s",
                    iteration,
                    "/".join(map(str, sorted(worlds))),
                    world_size,
                    fallback,
                )
                continue
            missing = sorted(set(range(world_size)) - {p[1] for p in parts})
            why = f"incomplete (no copy of the parts of ranks {rank_ranges.text(missing)} anywhere)"
            self.incomplete.append((iteration, f"local step {iteration}: {why}"))
            logger.warning(
                "local iteration %d is incomplete: no copy of the part%s of rank%s %s anywhere "
                "(an interrupted save, or more members of a replication clique lost than replicas "
                "exist); %s",
                iteration,
                "s" if len(missing) > 1 else "",
                "s" if len(missing) > 1 else "",
                ", ".join(map(str, missing)),
                fallback,
            )


def _latest_usable(listings: list[Listing], world_size: int) -> int:
    """The newest iteration ``listings`` complete with parts of ``world_size``, or -1."""
    complete = complete_iterations(listings)
    usable = [i for i, world in complete.items() if world == world_size]
    return max(usable, default=naming.NO_CHECKPOINT)
