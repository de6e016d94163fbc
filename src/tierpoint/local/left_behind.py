"""Directories that ranks left behind on this node: their files retired as the ranks' own are.

A node's local root holds one directory per global rank that saved there. When the ranks of a node
change between runs (torchrun numbers nodes anew at a rendezvous, a job shrinks or grows), the
directories of ranks that now run elsewhere stay: no rank retires files but its own. Their parts,
replicas, spares and unfinished files would hold the node's RAM disk for good, and each change of
layout would add more. (Their newest parts may complete a checkpoint: :mod:`.misplaced` adopts
those first.)

Call order: :meth:`~tierpoint.local.store.PartStore.ensure_dir` writes the marker of this rank's
directory (:func:`mark_node`, once a process: ``<session>/<rank>.node``, beside the directory);
after each commit, :meth:`LeftBehind.retire` on every rank (it acts on each node's leader only,
and only once the node layout is known: it starts no collective).

Invariants: a directory (not a link) is left behind when its rank is not on this node and its
marker names a node other than the one its rank runs on now, or its rank is not in the job now. A
rank writes its marker before its first save agrees, so every rank's marker is current before any
commit, on a root every node shares too; a directory without a readable marker is never touched. In one left behind, what its rank's own
retirement would remove goes: unfinished files, spares, and parts of iterations older than the
newest kept and not kept (a newer part stays, of any world size: headers are not read); the
directory goes once empty. Nothing here raises: a failure is a DEBUG line and the next commit
tries again. Once a retirement finds no directory left behind, or finds the root shared (a
directory of a rank on another node, current), this process stops looking; on a shared root rank
0 goes on with the directories of ranks not in the job now (whatever the order it lists them in).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from .. import dist as tpdist
from ..files import open_own, unlink_quietly
from . import naming

logger = logging.getLogger("tierpoint")

MARKER_SUFFIX = ".node"
"""Beside each rank's directory, ``<rank>.node`` names the node whose rank last saved there (one
line)."""


def _marker(directory: Path) -> Path:
    return directory.with_name(directory.name + MARKER_SUFFIX)


def mark_node(directory: Path) -> Path | None:
    """Write this node's id into ``directory``'s marker; ``directory`` when done. Where that fails
    the marker is removed (a stale one would disown the directory of a rank that saves there)."""
    path = _marker(directory)
    try:
        fd = open_own(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(tpdist.node_id() + "\n")
    except OSError:
        unlink_quietly(path)
        return None
    return directory


def marked_node(directory: Path) -> str | None:
    """The node ``directory``'s marker names, or ``None`` (no marker, unreadable, unfinished)."""
    try:
        fd = os.open(_marker(directory), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            text = f.read(4097)
    except OSError:
        return None
    if len(text) > 4096 or not text.endswith(b"\n"):
        return None
    return text[:-1].decode("utf-8", "replace")


class LeftBehind:
    """Retires the files of the directories ranks left behind on this node (see the module
    docstring); one per :class:`~tierpoint.local.store.PartStore`."""

    def __init__(self, session_dir: Path) -> None:
        self.session_dir = session_dir
        self.done = False

    def retire(self, keep: Iterable[int]) -> None:
        """Remove from each directory left behind what no iteration of ``keep`` (the committed ones
        kept) needs. Not collective; never raises."""
        if self.done:
            return
        layout = tpdist.known_node_layout()
        if layout is None:
            return
        here = set(layout.local_ranks)
        if layout.rank != min(here):
            self.done = True  # (the node's leader looks after its node)
            return
        try:
            self.done = not self._retire_all(here, layout.node_of_rank, set(keep))
        except OSError as e:
            logger.debug("directories left behind in %s not retired: %s", self.session_dir, e)

    def _retire_all(self, here: set[int], node_of_rank: tuple[str, ...], keep: set[int]) -> bool:
        """Whether a directory left behind still holds files (look again at the next commit)."""
        remaining = shared = False
        for entry in os.scandir(self.session_dir):
            name = entry.name
            if not (name.isascii() and name.isdigit()) or int(name) in here:
                continue
            if shared and int(name) < len(node_of_rank) or not entry.is_dir(follow_symlinks=False):
                continue
            rank, directory = int(name), Path(entry.path)
            marked = marked_node(directory)
            if marked is None:
                continue
            if rank < len(node_of_rank) and marked == node_of_rank[rank]:
                if 0 not in here:  # a live directory of a rank on another node: a shared root
                    return False
                shared = True  # (rank 0 goes on with the ranks not in the job now)
                continue
            remaining |= _retire_directory(directory, keep)
        return remaining


def _retire_directory(directory: Path, keep: set[int]) -> bool:
    """Remove what ``keep`` does not need from one directory left behind (the directory itself
    once empty); whether files remain."""
    newest = max(keep, default=naming.NO_CHECKPOINT)
    left = False
    for name in os.listdir(directory):
        parsed = naming.parse_part_name(name)
        stale = (
            naming.is_dirty_name(name)
            or naming.is_spare_name(name)
            or (parsed is not None and parsed[0] not in keep and parsed[0] < newest)
        )
        if stale:
            unlink_quietly(directory / name)
        else:
            left = True
    if left:
        return True
    try:
        directory.rmdir()
    except OSError:
        return True
    unlink_quietly(_marker(directory))
    logger.info("removed %s, left behind by a rank that runs on another node now", directory)
    return False
