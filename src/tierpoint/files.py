"""The ground floor: what every durable local file write needs, written once.

tierpoint writes a file under a dirty name (:func:`dirty_name`), fills it (:func:`write_views`, or
through a mapping after :func:`reserve`), fsyncs it (:func:`fsync_file` or by its descriptor),
renames it to its final name and fsyncs the directory (:func:`fsync_dir`); a failure removes the
dirty file (:func:`unlink_quietly`). :func:`write_whole` does all of it around a writer that takes
a path (``torch.save``, safetensors). :func:`in_memory_filesystem` tells a RAM file system, where a
file's pages are plain shared memory, from a disk.

Invariants:
- Only local paths and descriptors; nothing here knows URLs, part files or ranks, and the module
  imports nothing of tierpoint (it sits below :mod:`tierpoint.storage` and
  :mod:`tierpoint.fileformat`).
- :func:`write_views` writes every byte it is given, in order, or raises.
- Clean-up (:func:`unlink_quietly`) never raises: a leftover is logged, and the next save's clean-up
  removes it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger("tierpoint")

Views = Sequence["bytes | bytearray | memoryview"]

DIRTY_SUFFIX = ".dirty"
"""The suffix of a file being written: it is complete only once renamed without it."""

IO_CHUNK = 1 << 30
"""The most bytes handed to one ``write`` call."""
SMALL = 1 << 20
"""Views smaller than this are gathered into one ``writev``."""
WRITEV_BATCH = 512
"""The most views in one ``writev`` (below the kernel's ``IOV_MAX``)."""

_RAM_FILESYSTEMS = {0x01021994, 0x858458F6}  # tmpfs, ramfs (statfs f_type)


def dirty_name(path: str | os.PathLike) -> Path:
    """The name ``path`` is written under until it is complete."""
    path = Path(path)
    return path.with_name(path.name + DIRTY_SUFFIX)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (created, renamed, removed names) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Make a file's content durable (writes through a mapping included)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reserve(fd: int, nbytes: int) -> None:
    """Make the open file ``nbytes`` long with its space allocated, so that filling it through a
    mapping cannot fail later (ENOSPC now instead of SIGBUS then). A longer file is cut; one of the
    right size is taken as allocated already (a recycled spare was a complete file): reserving
    256 MiB that exist again costs 15-90 ms on tmpfs here."""
    size = os.fstat(fd).st_size
    if size > nbytes:
        os.ftruncate(fd, nbytes)
    elif size < nbytes:
        os.posix_fallocate(fd, 0, nbytes)


def write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` at the file position (in pieces of at most :data:`IO_CHUNK`)."""
    while len(view):
        n = os.write(fd, view[:IO_CHUNK])
        view = view[n:]


def write_views(fd: int, views: Iterable[bytes | bytearray | memoryview]) -> int:
    """Write ``views`` back to back at the file position: small ones gathered into one ``writev``,
    large ones straight. Returns the bytes written."""
    batch: list[memoryview] = []
    batch_bytes = 0
    total = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            written = os.writev(fd, batch)
            if written != batch_bytes:  # partial writev: finish the rest piece by piece
                rest = written
                for v in batch:
                    if rest >= len(v):
                        rest -= len(v)
                        continue
                    write_all(fd, v[rest:])
                    rest = 0
            batch, batch_bytes = [], 0

    for raw in views:
        v = memoryview(raw) if isinstance(raw, bytes) else memoryview(raw).cast("B")
        total += len(v)
        if len(v) >= SMALL:
            flush()
            write_all(fd, v)
        elif len(v):
            batch.append(v)
            batch_bytes += len(v)
            if len(batch) >= WRITEV_BATCH or batch_bytes >= SMALL:
                flush()
    flush()
    return total


def open_own(path: str | os.PathLike, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags, mode)`` of a file to write (a dirty name): a link or other entry
    that is neither a regular file nor a directory under that name is removed first, and the open
    never follows a link: writing through a link would change a file outside the directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            os.unlink(path)
    return os.open(path, flags | os.O_NOFOLLOW, mode)


def write_whole(
    path: str | os.PathLike, write: Callable[[str], T], dirty: str | os.PathLike | None = None
) -> T:
    """``write(dirty)`` (by default :func:`dirty_name`), then fsync it, rename it over ``path`` and
    fsync the directory: ``path`` holds the old content or the new, never part of it. What
    ``write`` returns; anything raised removes the dirty file first."""
    dirty = os.fspath(dirty if dirty is not None else dirty_name(path))
    try:
        result = write(dirty)
        fsync_file(dirty)
        os.replace(dirty, path)
    except BaseException:  # (a full disk: what was written would hold its pages)
        unlink_quietly(dirty)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return result


def unlink_quietly(path: str | os.PathLike) -> None:
    """Remove a file if it is there; clean-up never raises (a failure is logged)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("could not remove %s: %s", path, e)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def in_memory_filesystem(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on tmpfs or ramfs (where a file's pages are plain shared memory: filling
    them through a mapping costs no more than filling a memfd). False when it cannot tell."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field
    try:
        if _libc().statfs(os.fsencode(path), buf) != 0:
            return False
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return f_type in _RAM_FILESYSTEMS
