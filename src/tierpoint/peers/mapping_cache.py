"""The file mappings of peer moves: each file mapped once per call, or kept across calls.

Call order: :func:`~tierpoint.peers.transfer.move_files` maps a file it sends or receives
(``map``), and afterwards hands each mapping back: ``done`` (the move succeeded), ``forget`` (the
file is being deleted) or ``abandon`` (a send or receive may still be in flight). Without a
:class:`MappingCache` a call uses :class:`OneShotMappings`.

Invariants: an abandoned mapping is never handed out or unmapped again (a receive left over from a
timed-out call may still write into it); a cached mapping is re-checked against its file's size at
every use; a cached mapping page-locked for CUDA (:meth:`MappingCache.pin`) is unpinned before it
is unmapped, on every path.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..pinning import PinnedRange

_abandoned: list[Any] = []  # mappings a timed-out receive (or device copy) may still write into


def map_file(path: str, nbytes: int, writable: bool) -> tuple[mmap.mmap | None, torch.Tensor]:
    """A shared mapping of ``path`` as a byte tensor, its pages faulted in up front (one populate
    instead of a page fault per 4 KiB while gloo moves the bytes)."""
    if nbytes == 0:
        return None, torch.empty(0, dtype=torch.uint8)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only source: only ever sent from
        return m, torch.frombuffer(m, dtype=torch.uint8)


FileMapping = tuple["mmap.mmap | None", torch.Tensor]


class OneShotMappings:
    """Each file mapped for one call and unmapped after it (no :class:`MappingCache` given)."""

    def map(self, path: str, nbytes: int, writable: bool) -> FileMapping:
        return map_file(path, nbytes, writable)

    def done(self, entry: FileMapping) -> None:
        if entry[0] is not None:
            entry[0].close()

    forget = done

    def abandon(self, entries: Iterable[FileMapping]) -> None:
        _abandoned.extend(entries)


class MappingCache:
    """Mappings kept from one :func:`move_files` call to the next, for files that come back.

    Checkpoint files circulate (an expired replica becomes a spare, the spare receives the next
    replica or is rewritten as the next own part), so mapping and populating 256 MiB anew every save
    is work thrown away. Entries are keyed by the file's (device, inode), always shared and writable
    (so one mapping serves sending and receiving), and re-checked against the file's size on every
    use. A mapping keeps a deleted file's pages alive: the owner calls :meth:`retain` with the files
    that still exist after it removes some, and :meth:`close` when done. Thread-safe.

    :meth:`pin` page-locks a kept mapping for copies from a CUDA device (a snapshot copied straight
    into the file, :mod:`tierpoint.local.saving`), once per mapping: the registration is released
    before the mapping is unmapped on every path (a size change, :meth:`forget`, :meth:`drop`,
    :meth:`retain`, :meth:`close`, and the cache's garbage collection or interpreter exit, through
    a finalizer that holds the mappings); an abandoned mapping stays mapped and pinned.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], FileMapping] = {}
        self._pins: dict[tuple[int, int], PinnedRange] = {}
        self._finalizer = weakref.finalize(self, _unmap_all, self._lock, self._pins, self._maps)

    def map(self, path: str, nbytes: int, writable: bool) -> FileMapping:
        if nbytes == 0:
            return map_file(path, 0, writable)
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            hit = self._maps.pop(key, None)
            if hit is not None and hit[0] is not None and len(hit[0]) == nbytes == st.st_size:
                self._maps[key] = hit
                return hit
            if hit is not None:
                _unmap(self._pins.pop(key, None), hit)
            entry = map_file(path, nbytes, writable=True)
            self._maps[key] = entry
            return entry

    def pin(self, entry: FileMapping, device: int) -> bool:
        """Page-lock a mapping this cache keeps for copies from CUDA ``device`` (at most once per
        mapping; a failure leaves it unpinned with one WARNING, see
        :class:`~tierpoint.pinning.PinnedRange`); True if it is pinned."""
        with self._lock:  # not unmapped meanwhile (a registration may take a second)
            keys = self._keys_of(entry)
            if not keys or entry[0] is None:
                return False
            pinned = self._pins.setdefault(keys[0], PinnedRange())
            return pinned.register(entry[1].data_ptr(), entry[1].numel(), device)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the kept mappings that are page-locked now."""
        with self._lock:
            return sum(
                self._maps[k][1].numel()
                for k, p in self._pins.items()
                if p.pinned and k in self._maps
            )

    def done(self, entry: FileMapping) -> None:
        pass

    def forget(self, entry: FileMapping) -> None:
        """Unmap a file that is being deleted."""
        with self._lock:
            for key in self._keys_of(entry):
                del self._maps[key]
                pinned = self._pins.pop(key, None)
                if pinned is not None:
                    pinned.release()  # before the mapping is closed below
        if entry[0] is not None:
            entry[0].close()

    def abandon(self, entries: Iterable[FileMapping]) -> None:
        """A receive or a device copy into these may still be in flight: never hand them out,
        unpin or unmap them again (they stay as they are until the process ends)."""
        with self._lock:
            for key in dict.fromkeys(k for e in entries for k in self._keys_of(e)):
                _abandoned.append((self._maps.pop(key), self._pins.pop(key, None)))

    def drop(self, path: str | os.PathLike) -> None:
        """Unpin and unmap ``path``'s mapping, if kept: before the file is resized by a writer that
        does not map it through this cache (a mapping kept over a shrunk and regrown file would
        still be registered over its old pages)."""
        key = _file_key(path)
        with self._lock:
            entry = self._maps.pop(key, None) if key is not None else None
            if entry is not None:
                _unmap(self._pins.pop(key, None), entry)

    def retain(self, paths: Iterable[str | os.PathLike]) -> None:
        """Unmap every file that is not one of ``paths``."""
        keep = {_file_key(path) for path in paths}
        with self._lock:
            for key in [k for k in self._maps if k not in keep]:
                _unmap(self._pins.pop(key, None), self._maps.pop(key))

    def close(self) -> None:
        self.retain(())

    def _keys_of(self, entry: FileMapping) -> list[tuple[int, int]]:
        """The keys under which ``entry``'s mapping is kept (call under the lock)."""
        return [k for k, v in self._maps.items() if v[0] is entry[0]]

    def __len__(self) -> int:
        return len(self._maps)


def _file_key(path: str | os.PathLike) -> tuple[int, int] | None:
    """The key a file's mapping is kept under (its device and inode); None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _unmap(pinned: PinnedRange | None, entry: FileMapping) -> None:
    """Release a mapping's registration (if any), then unmap it: in this order, always."""
    if pinned is not None:
        pinned.release()
    if entry[0] is not None:
        entry[0].close()


def _unmap_all(
    lock: threading.Lock,
    pins: dict[tuple[int, int], PinnedRange],
    maps: dict[tuple[int, int], FileMapping],
) -> None:
    """A dropped cache's finalizer: every registration released, then every mapping unmapped (at
    interpreter exit a daemon thread may still be pinning one: waited for, briefly)."""
    locked = lock.acquire(timeout=10)
    try:
        for key in list(maps):
            _unmap(pins.pop(key, None), maps.pop(key))
    finally:
        if locked:
            lock.release()


Mapper = OneShotMappings | MappingCache
"""Where a call gets its mappings and hands them back."""
