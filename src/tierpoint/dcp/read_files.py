"""Opening and reading a DCP checkpoint's files, local or remote, as the reader needs them.

Call order: :func:`open_file` (or :class:`DataFiles`, which opens each data file of one read once)
gives a :class:`File`; :func:`read_exact` reads a range of it; large ranges are cut into
:class:`Piece` s of at most :data:`PIECE_BYTES` (:func:`cut`) that threads read with
:func:`read_piece`; :class:`Item` is one planned item's range of a file; :meth:`File.close` (or
:meth:`DataFiles.close`) releases the descriptor.

Invariants:
- A local file is opened only if it is a regular file inside the checkpoint directory (a symbolic
  link may point elsewhere in it, never outside), without blocking (a planted FIFO cannot hang the
  reader); a remote one is read with ranged GETs through :mod:`tierpoint.storage`.
- A read returns every byte asked for or raises: a short file is a
  :class:`~tierpoint.dcp.safe_pickle.CorruptDCPError` ("truncated"), an I/O failure a
  :class:`~tierpoint.errors.CheckpointingError`, both naming the file (a store that did not answer:
  :class:`~tierpoint.errors.StorageUnavailableError`, see :func:`tierpoint.storage.failure`).
- A missing ``.metadata`` means no committed checkpoint (a :class:`CheckpointingError`); a missing
  data file the metadata names is damage (:class:`CorruptDCPError`).

This is not :mod:`tierpoint.storage`'s whole-file access: the reader needs ranged reads into
caller memory and the hostile-input checks above, which no storage function does.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from .. import storage
from ..errors import CheckpointingError
from .names import METADATA_NAME
from .safe_pickle import CorruptDCPError, file_name_problem

PIECE_BYTES = 16 << 20
"""Reads larger than this are cut into pieces of this size so that threads can share them."""


@dataclass
class File:
    """An open data or metadata file: a local descriptor, or an fsspec filesystem and key."""

    path: str
    size: int
    fd: int = -1
    fs: Any = None
    key: str = ""
    data: bytes | None = None
    """The contents, for an item decoded into memory (see ``Reader._decoded``)."""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _missing(location: str, what: str) -> CheckpointingError:
    """A file that is not there: a data file the metadata names is damage; no metadata at all means
    the directory holds no committed checkpoint (its save never finished, or it is not one)."""
    if what == "DCP metadata":
        return CheckpointingError(
            f"no committed DCP checkpoint: {location} is missing (its save never finished, or this "
            "is not a DCP checkpoint directory)"
        )
    if not storage.is_local(location):  # (an object store: every rank sees every object)
        return CorruptDCPError(location, f"missing {what} file")
    return CorruptDCPError(
        location,
        f"missing {what} file (on node-local disks: get_latest_complete_checkpoint(..., "
        "node_local=True) fetches the files the layout of the save needs; a load in another "
        "layout at the same world size needs all_files=True)",
    )


def open_file(
    location: str, what: str, storage_options: Mapping[str, Any], missing_ok: bool = False
) -> Any:
    """Open ``location`` (a path or URL) for reading; it must be a regular file and, when local,
    lie in the checkpoint directory (a symbolic link may point elsewhere in it, not outside).
    ``missing_ok``: None when there is no such file (but the directory exists)."""
    if storage.is_local(location):
        path = storage.local_path(location)
        home = os.path.realpath(os.path.dirname(path) or ".")
        real = os.path.realpath(path)
        if os.path.commonpath([real, home]) != home:
            raise CorruptDCPError(
                location, f"{what} file links outside the checkpoint directory, to {real}"
            )
        try:
            # O_NONBLOCK: a FIFO planted in the directory must not block the open.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            if not os.path.isdir(os.path.dirname(path) or "."):  # nothing there, nothing corrupt
                raise CheckpointingError(
                    f"{os.path.dirname(path)}: no such checkpoint directory"
                ) from None
            if missing_ok:
                return None
            raise _missing(location, what) from None
        except OSError as e:
            raise CheckpointingError(f"cannot open {what} file {location}: {e}") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CorruptDCPError(location, f"{what} is not a regular file")
        return File(location, st.st_size, fd=fd)
    fs, key = storage.filesystem(location, storage_options)
    try:
        info = storage.request(f"inspecting {location}", fs, "info", key)
    except FileNotFoundError:
        storage.check_bucket(fs, key, location)
        if missing_ok:
            return None
        raise _missing(location, what) from None
    except Exception as e:  # noqa: BLE001 - any client failure, reported with the URL
        raise storage.failure(f"opening {what} file", location, e) from e
    if info.get("type") != "file" or not isinstance(info.get("size"), int):
        raise CorruptDCPError(location, f"{what} is not a file")
    return File(location, info["size"], fs=fs, key=key)


def read_exact(file: File, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(file, offset, memoryview(buf))
    return bytes(buf)


def _read_into(file: File, offset: int, view: memoryview) -> None:
    """Fill ``view`` with the file's bytes from ``offset``; a short file is a truncation."""
    end = offset + len(view)
    if file.data is not None:
        if end > len(file.data):
            raise CorruptDCPError(
                file.path, f"truncated: needed bytes up to {end}, it has {len(file.data)}"
            )
        view[:] = file.data[offset:end]
        return
    if file.fs is not None:
        try:
            data = storage.request(
                f"reading {file.path}", file.fs, "cat_file", file.key, start=offset, end=end
            )
        except Exception as e:  # noqa: BLE001 - any client failure, reported with the URL
            raise storage.failure(f"reading from offset {offset} of", file.path, e) from e
        if len(data) != len(view):
            raise CorruptDCPError(
                file.path, f"truncated: needed bytes up to {end}, got {len(data)} from {offset}"
            )
        view[:] = data
        return
    while len(view):
        try:
            n = os.preadv(file.fd, [view], offset)
        except OSError as e:
            raise CheckpointingError(f"reading {file.path} at offset {offset}: {e}") from e
        if n == 0:
            raise CorruptDCPError(
                file.path, f"truncated: needed bytes up to {end}, the file ends at {offset}"
            )
        view = view[n:]
        offset += n


class DataFiles:
    """The data files of one read of the checkpoint at ``path``, each opened once, all closed by
    :meth:`close`."""

    def __init__(self, path: str, storage_options: Mapping[str, Any]) -> None:
        self.path = path
        self.storage_options = storage_options
        self.files: dict[str, File] = {}

    def open(self, name: str) -> File:
        """The data file ``name`` (a plain name the metadata gives) of the checkpoint, opened."""
        file = self.files.get(name)
        if file is None:
            problem = file_name_problem(name)
            if problem:
                raise CorruptDCPError(storage.join(self.path, METADATA_NAME), problem)
            location = storage.join(self.path, name)
            file = open_file(location, "DCP data", self.storage_options)
            self.files[name] = file
        return file

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files.clear()


@dataclass
class Item:
    """One planned item: ``req`` reads ``info``'s range of ``file``."""

    req: ReadItem
    info: _StorageInfo
    file: File

    @property
    def what(self) -> str:
        return f"item {self.req.storage_index.fqn!r}"

    def read_at(self, offset: int, n: int) -> bytes:
        """``n`` bytes of the item from ``offset`` (relative to the item)."""
        return read_exact(self.file, self.info.offset + offset, n)

    def chunks(self) -> Iterator[bytes]:
        """The item's bytes, read a piece (:data:`PIECE_BYTES`) at a time."""
        length = self.info.length
        for at in range(0, length, PIECE_BYTES):
            yield self.read_at(at, min(PIECE_BYTES, length - at))


@dataclass
class Piece:
    """Bytes ``[offset, offset + len(view))`` of ``file``, to be read into ``view``."""

    file: File
    offset: int
    view: memoryview


def read_piece(piece: Piece) -> None:
    """Read ``piece``'s bytes into its view."""
    _read_into(piece.file, piece.offset, piece.view)


def fill(pieces: list[Piece], whole: bytes, offset: int) -> None:
    """Copy each piece's bytes from ``whole``, the bytes of the file from ``offset`` on."""
    for p in pieces:
        start = p.offset - offset
        p.view[:] = whole[start : start + len(p.view)]


def cut(file: File, offset: int, view: memoryview) -> list[Piece]:
    return [
        Piece(file, offset + start, view[start : start + PIECE_BYTES])
        for start in range(0, len(view), PIECE_BYTES)
    ]
