"""Verified reads: one ``read_data`` of :class:`~tierpoint.dcp.reader.Reader`, checked first, then
written into place.

Call order: :meth:`Reader.start_read <tierpoint.dcp.reader.Reader.start_read>` builds a
:class:`ReadRun` and calls :meth:`ReadRun.prepare` (locate every record, check it against the
metadata and the destination, read small items and non-tensor values, verify their checksums);
the :class:`PreparedRead` it returns then either :meth:`~PreparedRead.finish` es (large tensors
read into place by the threads, their checksums verified there, values handed to the planner) or is
:meth:`~PreparedRead.close` d without writing.

Invariants:
- Nothing is written into the caller's state before every item was located and checked: a damaged
  or hostile item leaves the state as it was (only an I/O error, a file changing under the reader,
  or a checksum mismatch of a large tensor read straight into its destination fails later).
- Every item with a recorded checksum is verified: small ones and values before anything is
  written, partly read ones (resharding) by streaming the whole item once more, large in-place
  ones over head, destination and tail once their bytes arrived.
- The ``torch.load`` fallback runs only on archives whose entries unpack to about the chunk's
  size (:data:`UNPACK_SLACK`), and must produce a dense CPU tensor of the stored dtype and shape.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner

from ..snapshot_copy import plain_bytes
from .checksums import mismatch
from .read_files import DataFiles, Item, Piece, cut, fill, read_piece
from .safe_pickle import CorruptDCPError
from .saved_tensor import WHOLE_ITEM, BadRecord, NeedsTorchLoad, SavedTensor, locate

UNPACK_SLACK = 1 << 20
"""What the ``torch.load`` fallback may unpack beyond the chunk's tensor bytes (its small entries)."""


class ItemFacts(Protocol):
    """What the metadata says of the items a read may meet (a set-up
    :class:`~tierpoint.dcp.reader.Reader`)."""

    dtypes: Mapping[str, torch.dtype]
    chunk_sizes: Mapping[MetadataIndex, torch.Size]

    def expected_checksum(self, item: Item) -> str | None: ...


@dataclass
class _Copy:
    """A tensor item that could not be read in place: read ``pieces`` (into scratch memory), then
    ``finish()`` copies into the destination (for an archive only ``torch.load`` can decode,
    ``finish()`` decodes and checks it and returns the copy, to run later)."""

    item: Item
    target: torch.Tensor
    finish: Callable[[], Any]
    pieces: list[Piece] = field(default_factory=list)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, writable, no copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _contiguous_strides(size: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(size):
        strides.append(acc)
        acc *= max(d, 1)
    return strides[::-1]


def _region_is_contiguous(size: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether the box ``lengths`` (at any offsets) of a row-major ``size`` array is one run."""
    partial = [i for i, (n, d) in enumerate(zip(lengths, size)) if n != d]
    if not partial:
        return True
    return all(lengths[i] == 1 for i in range(partial[-1]))


class PreparedRead:
    """A ``read_data`` whose every item was located and checked (:meth:`Reader.start_read`):
    :meth:`finish` reads the tensor bytes into place and hands the values to the planner;
    :meth:`close` gives up without writing. Either releases the files and threads."""

    def __init__(self, run: ReadRun, files: DataFiles) -> None:
        self.run = run
        self._files = files

    def finish(self) -> None:
        try:
            self.run.write()
        finally:
            self.close()

    def close(self) -> None:
        self.run.pool.shutdown(wait=True)
        self._files.close()


@dataclass
class _Job:
    """One tensor item after :meth:`ReadRun.prepare`: the pieces to read (into the destination,
    or into scratch memory that ``finish`` copies from), or, for a small item, its bytes already
    read (``whole``)."""

    pieces: list[Piece]
    finish: Callable[[], None] | None
    whole: bytes | None
    offset: int  # where ``whole`` starts in the file


class ReadRun:
    """One ``read_data`` call. :meth:`prepare`: locate every record and check it against the
    metadata and the destination, read small items and non-tensor values into memory (and check the
    values, if the planner can); nothing is written into the caller's state, so a damaged or
    hostile item leaves it as it was. :meth:`write`: read the pieces of large items (shared by all
    threads) into place, copy what went through scratch memory, commit."""

    def __init__(
        self,
        facts: ItemFacts,
        planner: LoadPlanner,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.facts = facts
        self.planner = planner
        self.pool = pool
        self.failed = threading.Event()
        self.targets: list[tuple[Item, torch.Tensor]] = []
        self.jobs: list[_Job] = []
        self.blobs: list[tuple[Item, memoryview]] = []
        self.checks: list[tuple[Item, str, list[Any]]] = []
        """Checksums verified once the bytes are in place: (item, expected, its bytes in order)."""

    def _map(self, fn: Callable[[Any], Any], values: Iterable[Any]) -> list[Any]:
        def guarded(value: Any) -> Any:
            if self.failed.is_set():
                return None
            try:
                return fn(value)
            except BaseException:
                self.failed.set()
                raise

        return list(self.pool.map(guarded, values))

    def prepare(self, items: list[Item]) -> None:
        tensors = [it for it in items if it.req.type != LoadItemType.BYTE_IO]
        self.blobs = [
            (it, memoryview(bytearray(it.info.length)))
            for it in items
            if it.req.type == LoadItemType.BYTE_IO
        ]
        self.targets = [(it, self.planner.resolve_tensor(it.req).detach()) for it in tensors]
        # Header reads of some items overlap the value reads of others.
        self.jobs = self._map(self._locate, self.targets)
        self._map(
            lambda blob: self._read_pieces(cut(blob[0].file, blob[0].info.offset, blob[1])),
            self.blobs,
        )
        for item, view in self.blobs:
            expected = self.facts.expected_checksum(item)
            if expected is not None:
                verify(item, expected, [view])
        check_bytes = getattr(self.planner, "check_bytes", None)
        if check_bytes is not None:
            for item, view in self.blobs:
                check_bytes(item.req, io.BytesIO(view.obj))  # type: ignore[arg-type]

    def write(self) -> None:
        for job in self.jobs:
            if job.whole is not None:
                fill(job.pieces, job.whole, job.offset)
        large = [job for job in self.jobs if job.whole is None]
        pieces = sorted(
            (p for job in large for p in job.pieces), key=lambda p: (p.file.path, p.offset)
        )
        self._map(read_piece, pieces)
        self._map(lambda check: verify(*check), self.checks)
        self._map(lambda job: job.finish(), [job for job in self.jobs if job.finish is not None])
        for item, target in self.targets:
            self.planner.commit_tensor(item.req, target)
        for item, view in self.blobs:
            self.planner.load_bytes(item.req, io.BytesIO(view.obj))  # type: ignore[arg-type]

    def _locate(self, job: tuple[Item, torch.Tensor]) -> _Job:
        item, target = job
        expected = self.facts.expected_checksum(item)
        whole = None
        if item.info.length <= WHOLE_ITEM:
            # Small item: one read serves its header and its data (one request on object stores).
            whole = item.read_at(0, item.info.length)
            if expected is not None:
                verify(item, expected, [whole])
        record = self._record(item, whole)
        pieces = None
        finish: Callable[[], None] | None = None
        if isinstance(record, SavedTensor):
            pieces = self._in_place(item, record, target)
        if pieces is None:
            copy = self._copy(item, record, target)
            pieces, finish = copy.pieces, copy.finish
        if expected is not None and whole is None:
            if finish is None and _reads_whole_storage(item, record, target):
                # The storage bytes go straight into place: hashed there, with head and tail.
                assert isinstance(record, SavedTensor)
                end = record.data_offset + record.storage_nbytes
                head = item.read_at(0, record.data_offset)
                tail = item.read_at(end, item.info.length - end)
                self.checks.append((item, expected, [head, _bytes_of(target), tail]))
            else:  # only part of the record is read (resharding), or through scratch memory
                _verify_stream(item, expected)
        if isinstance(record, NeedsTorchLoad):
            # The archive is decoded (and refused) now, before anything is written.
            if whole is None:
                self._read_pieces(pieces)
            else:
                fill(pieces, whole, item.info.offset)
            assert finish is not None
            finish = finish()
            pieces, whole = [], None
        return _Job(pieces, finish, whole, item.info.offset)

    def _read_pieces(self, pieces: list[Piece]) -> None:
        for p in pieces:
            read_piece(p)

    def _record(self, item: Item, whole: bytes | None) -> SavedTensor | NeedsTorchLoad:
        read_at = item.read_at if whole is None else (lambda offset, n: whole[offset : offset + n])
        try:
            record = locate(read_at, item.info.length)
        except NeedsTorchLoad as e:
            self._check_unpacked(item, e.unpacked)
            return e
        except BadRecord as e:
            raise CorruptDCPError(item.file.path, f"{item.what}: {e}") from None
        expected = self.facts.dtypes.get(item.req.storage_index.fqn)
        if record.dtype != expected:
            raise CorruptDCPError(
                item.file.path, f"{item.what} holds {record.dtype}, the metadata says {expected}"
            )
        self._check_stored_size(item, record.size)
        self._check_region(item, record.size)
        return record

    def _check_stored_size(self, item: Item, size: Sequence[int]) -> None:
        sizes = self.facts.chunk_sizes.get(item.req.storage_index)
        if sizes is not None and tuple(size) != tuple(sizes):
            raise CorruptDCPError(
                item.file.path,
                f"{item.what} holds a tensor of size {list(size)}, the metadata's chunk is"
                f" {list(sizes)}",
            )

    def _check_unpacked(self, item: Item, unpacked: int) -> None:
        """The fallback's ``torch.load`` allocates what the archive's entries declare: that must be
        about the chunk's size (a few KiB of deflated zeros can claim gigabytes)."""
        sizes = self.facts.chunk_sizes.get(item.req.storage_index)
        dtype = self.facts.dtypes.get(item.req.storage_index.fqn)
        nbytes = 0 if sizes is None or dtype is None else math.prod(sizes) * dtype.itemsize
        limit = max(nbytes, item.info.length) + UNPACK_SLACK
        if unpacked > limit:
            raise CorruptDCPError(
                item.file.path,
                f"{item.what}: archive entries unpack to {unpacked} bytes, over the {limit} its"
                " chunk can need",
            )

    def _check_region(self, item: Item, size: Sequence[int]) -> None:
        req = item.req
        if len(req.storage_offsets) != len(size) or any(
            o + n > d for o, n, d in zip(req.storage_offsets, req.lengths, size)
        ):
            raise CorruptDCPError(
                item.file.path,
                f"{item.what}: the plan reads {list(req.lengths)} at {list(req.storage_offsets)}"
                f" of a stored tensor of size {list(size)}",
            )

    def _check_target(self, item: Item, target: torch.Tensor) -> None:
        if tuple(target.shape) != tuple(item.req.lengths):
            raise CorruptDCPError(
                item.file.path,
                f"{item.what}: destination of shape {list(target.shape)} for a stored region of"
                f" {list(item.req.lengths)}",
            )

    def _in_place(
        self, item: Item, record: SavedTensor, target: torch.Tensor
    ) -> list[Piece] | None:
        """Pieces reading the region straight into ``target``, or None if it cannot be."""
        self._check_target(item, target)
        req = item.req
        if not (
            plain_bytes(target)  # (a lazy conjugate or negation is filled through copy_)
            and target.dtype == record.dtype
            and record.is_contiguous()
            and _region_is_contiguous(record.size, req.lengths)
        ):
            return None
        if target.numel() == 0:
            return []
        strides = _contiguous_strides(record.size)
        first = record.storage_offset + sum(o * s for o, s in zip(req.storage_offsets, strides))
        start = item.info.offset + record.data_offset + first * record.dtype.itemsize
        return cut(item.file, start, _bytes_of(target))

    def _copy(
        self, item: Item, record: SavedTensor | NeedsTorchLoad, target: torch.Tensor
    ) -> _Copy:
        self._check_target(item, target)
        req = item.req
        if isinstance(record, NeedsTorchLoad):
            raw = memoryview(bytearray(item.info.length))

            def decode_with_torch_load() -> Callable[[], None]:
                """Decode and check the archive; returns the copy into the destination."""
                try:
                    full = torch.load(io.BytesIO(raw.obj), map_location="cpu", weights_only=True)  # type: ignore[arg-type]
                except Exception as e:  # noqa: BLE001 - any failure means a bad archive
                    raise CorruptDCPError(item.file.path, f"{item.what}: {e!r:.200}") from None
                expected = self.facts.dtypes.get(req.storage_index.fqn)
                if not isinstance(full, torch.Tensor) or full.dtype != expected:
                    raise CorruptDCPError(item.file.path, f"{item.what} is not a {expected} tensor")
                if full.layout != torch.strided or full.device.type != "cpu":
                    raise CorruptDCPError(
                        item.file.path,
                        f"{item.what} is a {full.layout} tensor on {full.device}, not a dense one",
                    )
                self._check_stored_size(item, full.shape)
                self._check_region(item, full.shape)
                return lambda: target.copy_(_narrow(full, req.storage_offsets, req.lengths))

            return _Copy(
                item, target, decode_with_torch_load, cut(item.file, item.info.offset, raw)
            )
        itemsize = record.dtype.itemsize
        if record.is_contiguous():
            # Read only the span from the region's first to its last element.
            strides = _contiguous_strides(record.size)
            first = sum(o * s for o, s in zip(req.storage_offsets, strides))
            last = sum(
                (o + max(n, 1) - 1) * s
                for o, n, s in zip(req.storage_offsets, req.lengths, strides)
            )
            span_begin, span = record.storage_offset + first, last - first + 1
            size, stride, offset = list(req.lengths), strides, 0
        else:
            span_begin, span = 0, record.storage_nbytes // itemsize
            size, stride, offset = list(record.size), list(record.stride), record.storage_offset
        scratch = torch.empty(span * itemsize if target.numel() else 0, dtype=torch.uint8)

        def finish_from_scratch() -> None:
            if target.numel() == 0:
                return
            view = scratch.view(record.dtype).as_strided(size, stride, offset)
            if not record.is_contiguous():
                view = _narrow(view, req.storage_offsets, req.lengths)
            target.copy_(view)

        start = item.info.offset + record.data_offset + span_begin * itemsize
        return _Copy(item, target, finish_from_scratch, cut(item.file, start, _bytes_of(scratch)))


def _reads_whole_storage(item: Item, record: Any, target: torch.Tensor) -> bool:
    """Whether reading ``item`` in place fills ``target`` with exactly the record's storage bytes."""
    return (
        isinstance(record, SavedTensor)
        and record.storage_offset == 0
        and not any(item.req.storage_offsets)
        and target.numel() * record.dtype.itemsize == record.storage_nbytes
    )


def verify(item: Item, expected: str, pieces: Iterable[Any]) -> None:
    """Raise unless ``pieces`` (the item's bytes, in order) have the checksum ``expected``."""
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    if hasher.hexdigest() != expected:
        raise mismatch(item.file.path, item.what, expected, hasher.hexdigest())


def _verify_stream(item: Item, expected: str) -> None:
    """:func:`verify` reading the whole item from its file, a piece at a time."""
    verify(item, expected, item.chunks())


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t
