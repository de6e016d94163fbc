"""Parts left in the directories of ranks that now run on other nodes, adopted as replicas.

A node's local root holds one directory per global rank that ran there. When the ranks of a node
change between runs (a job that lost a node went on with all its ranks on the nodes left and is
then back on as many nodes as before, or nodes numbered anew at a rendezvous), the newest complete
checkpoint may lie partly in directories whose ranks now run elsewhere. No rank lists those
(parts are found by global rank), so discovery took that iteration for incomplete and fell back
to an older one (a stale one, say, still on the node that came back) and the next save removed
the newer parts: a checkpoint complete in the cluster was lost.

Call order: :meth:`tierpoint.local.discovery.Discovery.find_latest`'s fast path folds
:func:`misplaced_newest` (not collective) into its all-reduce, and takes the gathered path when a
node's leader sees a part newer than every rank's own in those directories; on its gathered path
it calls :func:`adopt_misplaced` (collective, every rank alike) with the listings gathered and the
newest iteration they complete; when it returns ``True`` the caller gathers the listings again.

Invariants: only each node's leader (its lowest rank) looks at the other ranks' directories, and
only at parts of this world size newer than the newest complete iteration; files there are read,
never changed or removed here (:mod:`.left_behind` retires them, as the job's saves retire their
steps); parts are copied (dirty name, fsync, rename) into the leader's own
directory, where they are replicas it holds like any other (their checksums are verified when they
are sent or loaded), and only when they complete an iteration newer than every complete one (on a
root every node shares, each rank lists its own directory: nothing is copied). A copy that fails
(a full disk) is a WARNING on every rank and the discovery goes on as before.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .. import dist as tpdist
from ..errors import CheckpointingError
from ..files import open_own, write_whole
from . import naming
from .store import Listing, PartStore, complete_iterations

logger = logging.getLogger("tierpoint")

_COPY_CHUNK = 1 << 24


def adopt_misplaced(store: PartStore, listings: list[Listing], latest: int) -> bool:
    """Copy into this node's leader's directory the parts, left in the directories of ranks now on
    other nodes, that complete the newest iteration newer than ``latest``; whether any were
    copied on some rank (then gather the listings again). Collective."""
    here = _ranks_here()
    found: dict[tuple[int, int], Path] = {}
    if store.rank == min(here):
        found = _misplaced_parts(store, here, latest)
    what = "find_latest: gathering parts left in the directories of ranks on other nodes"
    gathered = tpdist.all_gather_json(sorted(found), what)
    extra = [[i, o, store.world_size] for parts in gathered for i, o in parts]
    if not extra:
        return False
    listed = {(p[0], p[1]) for listing in listings for p in listing}
    complete = complete_iterations([*listings, extra])
    newer = [i for i, w in complete.items() if w == store.world_size and i > latest]
    if not newer:
        return False
    iteration = max(newer)
    copies = [(o, path) for (i, o), path in sorted(found.items()) if i == iteration]
    error = ""
    for origin, path in copies:
        if (iteration, origin) in listed:
            continue  # listed by a rank already
        try:
            store.ensure_dir()
            _copy(path, store.part_path(iteration, origin))
        except OSError as e:
            error = f"rank {store.rank}: cannot copy {path}: {e}"
            break
        listed.add((iteration, origin))
    (ok,) = tpdist.reduce_ints([not error], "min", what)
    if error:
        logger.warning("local iteration %d: %s", iteration, error)
    if not ok:
        logger.warning(
            "local iteration %d is complete only with parts in the directories of ranks that now "
            "run on other nodes, and they could not all be copied (see the warnings)",
            iteration,
        )
        return False
    if store.rank == 0:
        logger.warning(
            "local iteration %d is complete with parts left in the directories of ranks that now "
            "run on other nodes (the ranks of a node changed since the save): copied to their "
            "node's lowest rank, which serves them",
            iteration,
        )
    store.forget_scans()
    return True


def misplaced_newest(store: PartStore) -> int:
    """On this node's leader, the newest iteration a part's name gives in the directories of ranks
    that do not run on this node (headers unread); -1 on other ranks or when there is none. Every
    rank calls it (the node layout is gathered at its first use, so no rank skips that)."""
    here = _ranks_here()
    if store.rank != min(here):
        return naming.NO_CHECKPOINT
    return max(
        (parsed[0] for parsed, _ in _misplaced_names(store, here) if parsed[1] < store.world_size),
        default=naming.NO_CHECKPOINT,
    )


def _ranks_here() -> set[int]:
    """The global ranks that run on this node."""
    layout = tpdist.node_layout("find_latest: gathering node ids")
    mine = layout.node_of_rank[tpdist.get_rank()]
    return {r for r, node in enumerate(layout.node_of_rank) if node == mine}


def _misplaced_names(store: PartStore, here: set[int]) -> Iterator[tuple[tuple[int, int], Path]]:
    """``(iteration, origin)`` and path of each file named as a part in the directories of this
    session whose ranks do not run on this node (an unreadable directory is passed over)."""
    try:
        entries = list(os.scandir(store.session_dir))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not (name.isascii() and name.isdigit()) or int(name) in here:
            continue
        try:
            names = sorted(os.listdir(entry.path))
        except OSError:
            continue
        for part in names:
            parsed = naming.parse_part_name(part)
            if parsed is not None:
                yield parsed, Path(entry.path) / part


def _misplaced_parts(store: PartStore, here: set[int], latest: int) -> dict[tuple[int, int], Path]:
    """``(iteration, origin) -> path`` of the valid parts of this world size newer than
    ``latest`` in the directories of this session whose ranks do not run on this node."""
    found: dict[tuple[int, int], Path] = {}
    for parsed, path in _misplaced_names(store, here):
        if parsed[0] <= latest or parsed in found:
            continue
        try:
            world = naming.part_world_size(path, *parsed)
        except (OSError, CheckpointingError):
            continue
        if world == store.world_size and parsed[1] < world:
            found[parsed] = path
    return found


def _copy(source: Path, target: Path) -> None:
    """``source``'s bytes under ``target`` (written under a dirty name, fsynced, renamed)."""

    def write(dirty: str) -> None:
        with open(source, "rb") as src:
            fd = open_own(dirty, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, _COPY_CHUNK)

    write_whole(target, write)
