"""The persistent tier's job for the background worker: write a rank's staged files and its checksum
manifest, make the files the snapshot staged in place durable, or write the files straight from a
source file's pages (nothing staged).

Call order: :meth:`~tierpoint.dcp.writer.Writer.get_save_function_and_args` gives
:func:`write_staged` as an async save's ``async_fn``; its snapshot adds the ``buffer``,
``byte_records`` and ``items`` keywords (and ``source`` and ``pieces`` when the tensors' bytes are
read from a :class:`~tierpoint.staging.SourceFile` instead of a staging buffer); the worker
imports this module by name and runs it. A synchronous save
(:meth:`~tierpoint.dcp.writer.Writer.write_now`) calls :func:`write_with_manifest` in the trainer.

Invariants: every item is hashed from the bytes being written (xxh3-64, see
:mod:`tierpoint.dcp.checksums`; a source file's pages are read for both, and its owner keeps them
unchanged until the save is finalized or aborted); the job returns only once the rank's data files
and its manifest are written (and fsynced, with ``sync_files``), so a rank that reports success has
both; a failure is a :class:`~tierpoint.errors.CheckpointingError` naming the file.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from typing import Any

from .. import storage
from ..asyncsave.worker import resolve_buffer
from . import directory
from .checksums import manifest_bytes, manifest_name, range_checksums


def write_staged(
    path: str,
    files: list[tuple[str, int, int]],
    storage_options: Mapping[str, Any],
    thread_count: int,
    sync_files: bool,
    upload: storage.UploadOptions,
    timeout: float,
    marker: int | None = None,
    clear: tuple[str, int] | None = None,
    *,
    buffer: Any,
    byte_records: list[list[bytes]],
    items: dict[str, list[tuple[int, int]]],
    source: Any = None,
    pieces: list[list[Any]] | None = None,
) -> int:
    """Write staged files and their checksum manifest (runs in the background worker): file ``k``
    is the staging range ``[base, base + length)`` followed by its serialized non-tensor values;
    ``items``: the ``(offset, length)`` of every item in each file, hashed from these bytes. With
    no ``buffer`` the snapshot staged the files in place: they are hashed and made durable; or,
    given a ``source`` file, it staged nothing: file ``k``'s tensor section is ``pieces[k]``, record
    bytes and ``(offset, length)`` ranges of the source (see :func:`~tierpoint.dcp.snapshot.
    source_pieces`), read from the source's pages as they are written. ``marker``, ``clear``: see
    :func:`write_with_manifest`."""
    if source is not None and pieces is not None:
        data = resolve_buffer(source)
        sections = [[_piece(data, p) for p in file_pieces] for file_pieces in pieces]
    elif buffer is None:
        return _sync_in_place(path, [name for name, _, _ in files], items, sync_files)
    else:
        data = resolve_buffer(buffer)
        sections = [[data[base : base + length]] for _, base, length in files]
    contents = [
        (name, [*section, *records])
        for (name, _, _), section, records in zip(files, sections, byte_records)
    ]
    return write_with_manifest(
        path, contents, items, storage_options, thread_count, sync_files, upload, timeout, marker,
        clear,
    )  # fmt: skip


def write_with_manifest(
    path: str,
    contents: list[tuple[str, list[Any]]],
    items: dict[str, list[tuple[int, int]]],
    storage_options: Mapping[str, Any],
    thread_count: int,
    sync_files: bool,
    upload: storage.UploadOptions,
    timeout: float,
    marker: int | None = None,
    clear: tuple[str, int] | None = None,
) -> int:
    """Hash every item of each ``(name, views)`` file (:mod:`tierpoint.dcp.checksums`), then write
    the files and the rank's manifest together; returns the data bytes written. ``marker``: make
    that rank's unfinished marker first (on object stores, where the set-up leaves it to the job
    that writes); ``clear``: the save's agreed file token and number of ranks, given to the
    coordinator's job on an object store: then clear what other saves left in the directory
    (:func:`~tierpoint.dcp.directory.clear_for_new_save`)."""
    if marker is not None:
        directory.make_marker(path, marker, storage_options, upload)
        if clear is not None:
            directory.clear_for_new_save(path, *clear, storage_options, upload)
    sums = {name: _entries(items.get(name, []), views) for name, views in contents}
    jobs = [(storage.join(path, name), views) for name, views in contents]
    manifest = manifest_name(contents[0][0])
    if manifest is not None:
        jobs.append((storage.join(path, manifest), [manifest_bytes(sums)]))
    written = storage.write_files_parallel(
        jobs,
        threads=thread_count,
        storage_options=storage_options,
        fsync=sync_files,
        upload=upload,
        timeout=timeout,
    )
    return sum(written[: len(contents)])


def _piece(data: memoryview, piece: Any) -> Any:
    """A piece of a file's tensor section: its bytes, or the view of a source range."""
    if isinstance(piece, tuple):
        offset, length = piece
        return data[offset : offset + length]
    return piece


def _sync_in_place(
    path: str, names: list[str], items: dict[str, list[tuple[int, int]]], sync_files: bool
) -> int:
    """Hash the items of the files the snapshot named in ``path``, make the files durable and
    write the manifest; returns the files' total size."""
    total = 0
    sums: dict[str, list[tuple[int, int, str]]] = {}
    for name in names:
        file = os.path.join(storage.local_path(path), name)
        try:
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                total += size
                sums[name] = _file_checksums(fd, size, items.get(name, []))
                if sync_files:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise storage.failure("syncing", file, e) from e
    manifest = manifest_name(names[0]) if names else None
    if manifest is not None:
        storage.write_file(storage.join(path, manifest), [manifest_bytes(sums)], fsync=sync_files)
    if sync_files:
        storage.fsync_dir(path)
    return total


def _file_checksums(
    fd: int, size: int, ranges: list[tuple[int, int]]
) -> list[tuple[int, int, str]]:
    """The manifest entries of a file staged in place, hashed through a read-only mapping."""
    if not size:
        return _entries(ranges, [b""])
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapping:
        return _entries(ranges, [mapping])


def _entries(ranges: list[tuple[int, int]], views: list[Any]) -> list[tuple[int, int, str]]:
    """``(offset, length, checksum)`` of each item range of a file whose content is ``views``."""
    hashes = range_checksums(views, ranges)
    return [(offset, length, h) for (offset, length), h in zip(ranges, hashes)]
