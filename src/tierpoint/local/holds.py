"""Holding this rank's committed part for a reader outside the local tier (the persistent copy the
tiered manager makes from it): its tensors, mapped, and the file itself, whose bytes stay as they
are until the hold is released.

Call order: ``held = manager.hold_own_part(iteration)`` (no collective) opens the part, holds it
in the store and maps its tensors; the reader uses :attr:`HeldPart.tree` (tensors over the file's
pages, nothing copied) and :attr:`HeldPart.source` (the file, for a worker job to read, see
:class:`tierpoint.staging.SourceFile`); :meth:`HeldPart.release` once the reader is done: its save
finalized or aborted, or never started.

Invariants:
- While held, the file (its inode, under whatever name) is never handed out for reuse
  (:meth:`~tierpoint.local.store.PartStore.take_spare`), so nothing rewrites its pages: the
  in-place snapshot of a later local save writes only into a spare that is not held. Retirement
  may rename it to a spare (reused once released) or remove its name meanwhile: the reader reads
  through its own descriptor, and the pages live until it closes it.
- The tree's tensors and the source are the same file, the one opened and held first (a part
  renamed over it in between is refused).
- :meth:`HeldPart.release` is idempotent; it drops the hold, the tensors and the descriptor.
"""

from __future__ import annotations

import os
from typing import Any

from .. import fileformat
from ..errors import CheckpointingError
from ..staging import SourceFile
from .recovery import PartRecovery
from .store import PartStore


class HeldPart:
    """This rank's part of ``iteration``, held (see the module docstring)."""

    def __init__(
        self, store: PartStore, key: tuple[int, int], iteration: int, tree: Any, source: SourceFile
    ) -> None:
        self.iteration = iteration
        self.tree = tree
        """The part's state, as saved (tensors over the file's pages)."""
        self.source = source
        """The file, open read-only, with where each tensor's bytes lie in it."""
        self._store = store
        self._key: tuple[int, int] | None = key

    @property
    def held(self) -> bool:
        return self._key is not None

    def release(self) -> None:
        """The reader is done: the file may be recycled again (idempotent)."""
        if self._key is None:
            return
        self._store.release(self._key)
        self._key = None
        self.tree = None
        self.source.close()


def hold_own_part(store: PartStore, recovery: PartRecovery, iteration: int) -> HeldPart:
    """Open, hold and map this rank's committed part of ``iteration`` (not verified: it was
    written by this process); :class:`CheckpointingError` when it is not here."""
    path = store.part_path(iteration)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointingError(f"{path}: cannot open this rank's part ({e})") from e
    try:
        key = store.hold(os.fstat(fd))
        try:
            loaded, reason, _ = recovery.read_own(iteration, False, verify=False, mmap=True)
            if loaded is None:
                raise CheckpointingError(reason)
            header, tensors = loaded
            now = os.stat(path)
            if (now.st_dev, now.st_ino) != key:
                raise CheckpointingError(f"{path}: replaced while it was being opened")
            regions = [
                (t.data_ptr(), rec.nbytes, header.data_start + rec.begin)
                for rec, t in zip(header.records, tensors)
                if rec.nbytes
            ]
            source = SourceFile(fd, regions, owner=tensors)
            tree = fileformat.unflatten_checked(header, tensors)
        except BaseException:
            store.release(key)
            raise
    finally:
        os.close(fd)
    return HeldPart(store, key, iteration, tree, source)
