"""A torch DCP ``StorageReader`` that validates everything first, then reads in parallel into place.

``Reader(path_or_url, thread_count=4, storage_options=None)`` (or ``Reader(checkpoint_id=...)``, torch's
keyword) reads standard DCP checkpoints
(``.metadata`` + ``*.distcp``, as torch's filesystem writer and tierpoint's writer produce them) from
a local directory or any fsspec URL (``s3://...``: ranged GETs, one per piece). It plugs into
``torch.distributed.checkpoint.load(state_dict, storage_reader=Reader(path))``; see
:func:`tierpoint.dcp.load` for the safer one-call form.

Call order (torch's): ``read_metadata`` -> ``set_up_storage_reader`` -> ``prepare_local_plan`` ->
(coordinator) ``prepare_global_plan`` -> ``read_data``.

- ``read_metadata`` goes through :func:`tierpoint.dcp.safe_pickle.safe_loads`: nothing the file
  names is called, and every field is type- and range-checked.
- ``read_data`` first opens every data file the plan needs (once each) and checks each item's
  range against the file's real size. Then, before anything is written into the caller's state,
  every item's record is located and checked against the metadata and its destination, small items
  and non-tensor values are read into memory (and the values decoded, when the planner has a
  ``check_bytes`` method, as :class:`~tierpoint.dcp.loading.SafeLoadPlanner` has): a damaged or
  hostile item leaves the state as it was (:meth:`Reader.start_read` is this first half; only an
  I/O error or a file changing under the reader can still fail afterwards). Tensor items are
  ``torch.save`` archives: their headers are parsed without unpickling
  (:mod:`tierpoint.dcp.saved_tensor`), then the tensor bytes go with ``os.preadv`` (remote: a ranged read) straight into the destination tensor
  when its memory is
  contiguous, of the stored dtype and the region asked for is contiguous in the file (the usual case,
  resharding along dim 0 included); otherwise into a scratch buffer and ``copy_``. Large reads are cut
  into pieces so ``thread_count`` threads share them. Non-tensor (bytes) items are read whole and
  handed to ``planner.load_bytes``.

Checksums: where the rank that wrote a data file left its manifest (:mod:`tierpoint.dcp.checksums`,
read once per reader, parsed defensively), every item read is checked against its recorded xxh3-64:
small items, non-tensor values and items read only in part (resharding: the whole item is streamed
once more) before anything is written into the state; a large tensor read straight into its
destination is hashed there, with its record's head and tail, once its bytes have arrived, so a
mismatch in it fails the load on every rank with the destination holding the damaged bytes. A data
file without a manifest (plain torch wrote it) is read unverified.

Items torch wrote through stream transforms (``FileSystemWriter(_extensions=[ZStandard()])``) are
decoded into memory first (:mod:`tierpoint.dcp.transforms`, bounded by the size the item can have),
then read like the others; a transform this process cannot decode is refused by name
(:class:`~tierpoint.errors.UnsupportedStateError`).

Every problem with the files is a :class:`CorruptDCPError` (a :class:`CorruptCheckpointError`)
naming the file and the reason: missing file, item beyond the end of its file (truncated), malformed
archive or transformed stream, dtype or shape that contradicts the metadata, a checksum
mismatch (naming the item), a damaged manifest. The
``torch.load`` fallback runs only on archives whose entries unpack to about the size the metadata
gives the chunk, and must produce a dense CPU tensor of that shape.

Peer retrieval (checkpoints on node-local disks) happens before a load, outside this class: whoever
makes the files local can ask :meth:`Reader.files_needed` which data files a rank's plan reads.
"""

from __future__ import annotations

import io
import math
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import storage
from ..errors import CheckpointingError
from .checksums import MAX_MANIFEST_BYTES, Manifest, manifest_name, mismatch, parse_manifest
from .layout import checkpoint_id_or_path
from .safe_pickle import CorruptDCPError, file_name_problem, safe_loads
from .saved_tensor import WHOLE_ITEM, BadRecord, NeedsTorchLoad, SavedTensor, locate
from .transforms import decode

METADATA_NAME = ".metadata"
DEFAULT_THREAD_COUNT = 4
PIECE_BYTES = 16 << 20
"""Reads larger than this are cut into pieces of this size so that threads can share them."""
MAX_METADATA_BYTES = 1 << 30
UNPACK_SLACK = 1 << 20
"""What the ``torch.load`` fallback may unpack beyond the chunk's tensor bytes (its small entries)."""
MAX_VALUE_BYTES = 1 << 30
"""The most a transformed non-tensor value may decode to."""


def read_metadata(
    path: str | os.PathLike | None = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint at ``path`` (directory or URL) as stored, loaded
    without running code from the file (two reads of one file compare equal; a load through
    :class:`Reader` stamps its own ``storage_meta.load_id``, as torch's readers do)."""
    path = checkpoint_id_or_path(path, checkpoint_id, "read_metadata")
    return Reader(path, storage_options=storage_options).stored_metadata()


class Reader(StorageReader):
    """A torch DCP ``StorageReader`` for a checkpoint directory; see the module docstring."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        checkpoint_id: str | os.PathLike | None = None,
        thread_count: int = DEFAULT_THREAD_COUNT,
        storage_options: Mapping[str, Any] | None = None,
        _extension_registry: ExtensionRegistry | None = None,
    ) -> None:
        super().__init__()
        path = checkpoint_id_or_path(path, checkpoint_id, "Reader")
        if thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, not {thread_count}")
        self.path = storage.checkpoint_path(path)
        self.extension_registry = _extension_registry
        self.thread_count = thread_count
        self.storage_options = dict(storage_options or {})
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._chunk_sizes: dict[MetadataIndex, torch.Size] = {}
        self._metadata: Metadata | None = None
        self._manifests: dict[str, Manifest | None] = {}
        self._manifests_lock = threading.Lock()

    # ------------------------------------------------------------------ torch's StorageReader API

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self.storage_data = {}
        self._dtypes = {}
        self._chunk_sizes = {}
        self._metadata = None
        self._manifests = {}

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(os.fspath(checkpoint_id), str)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (cached after the first read), its ``storage_meta.load_id``
        set to this reader's (as torch's ``FileSystemReader`` does: it names the load); ``rank=r``
        reads the rank-local ``__r.metadata`` that torch writes when saving without collectives."""
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            return self._metadata
        metadata = self.stored_metadata(rank)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if rank is None:
            self._metadata = metadata
        return metadata

    def stored_metadata(self, rank: int | None = None, *, name: str | None = None) -> Metadata:
        """The metadata exactly as stored (read afresh, nothing added); ``name``: another metadata
        file of the directory than ``.metadata`` (a plain file name)."""
        if name is not None:
            problem = file_name_problem(name)
            if problem:
                raise CheckpointingError(f"{self.path}: {problem}")
        else:
            name = METADATA_NAME if rank is None else f"__{int(rank)}{METADATA_NAME}"
        file = _open(self._location(name), "DCP metadata", self.storage_options)
        try:
            if file.size > MAX_METADATA_BYTES:
                raise CorruptDCPError(
                    file.path, f"{file.size} bytes of DCP metadata, over {MAX_METADATA_BYTES}"
                )
            data = _read_exact(file, 0, file.size)
        finally:
            file.close()
        return safe_loads(data, file.path, rank_local=name != METADATA_NAME)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CorruptDCPError(
                self._location(METADATA_NAME),
                "no storage_data map: not written by a filesystem storage writer",
            )
        self.storage_data = metadata.storage_data
        self._dtypes = {
            fqn: md.properties.dtype
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        self._chunk_sizes = {
            MetadataIndex(fqn, chunk.offsets): chunk.sizes
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.start_read(plan, planner).finish()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def start_read(self, plan: LoadPlan, planner: LoadPlanner) -> PreparedRead:
        """Everything of ``read_data`` that can fail on what the files hold, with nothing written
        into the destination tensors or values yet; :meth:`PreparedRead.finish` writes. Raises
        :class:`CorruptDCPError` (after releasing what it opened) when an item is unusable."""
        files = _DataFiles(self)
        pool = ThreadPoolExecutor(self.thread_count, thread_name_prefix="tierpoint-read")
        read = PreparedRead(_ReadRun(self, planner, pool), files)
        try:
            read.run.prepare([self._checked(req, files) for req in plan.items])
        except BaseException:
            read.close()
            raise
        return read

    # ------------------------------------------------------------------ helpers

    def _location(self, name: str) -> str:
        return storage.join(self.path, name)

    def files_needed(self, plan: LoadPlan) -> set[str]:
        """Names of the data files ``plan`` reads (after ``set_up_storage_reader``)."""
        return {self._storage_info(req).relative_path for req in plan.items}

    def manifest(self, data_file: str) -> Manifest | None:
        """The checksum manifest of ``data_file`` (read once per reader); None when it was written
        without one (see :mod:`tierpoint.dcp.checksums`)."""
        name = manifest_name(data_file)
        if name is None:
            return None
        with self._manifests_lock:
            if name not in self._manifests:
                location = self._location(name)
                file = _open(location, "checksum manifest", self.storage_options, missing_ok=True)
                manifest = None
                if file is not None:
                    try:
                        if file.size > MAX_MANIFEST_BYTES:
                            raise CorruptDCPError(
                                location, f"{file.size} bytes of checksums, over the limit"
                            )
                        manifest = parse_manifest(_read_exact(file, 0, file.size), location)
                    finally:
                        file.close()
                self._manifests[name] = manifest
            return self._manifests[name]

    def expected_checksum(self, item: _Item) -> str | None:
        """The checksum ``item``'s bytes must have, or None if its file has no manifest (or the
        item holds decoded bytes: their stored form was checked)."""
        manifest = self.manifest(item.info.relative_path)
        if manifest is None or item.file.data is not None:
            return None
        return manifest.checksum(
            item.info.relative_path, item.info.offset, item.info.length, item.file.path, item.what
        )

    def _storage_info(self, req: ReadItem) -> _StorageInfo:
        info = self.storage_data.get(req.storage_index)
        if info is None:
            raise CorruptDCPError(
                self._location(METADATA_NAME),
                f"the load plan reads {req.storage_index.fqn!r} at {list(req.storage_index.offset or [])}"
                ", which the metadata does not store",
            )
        return info

    def _checked(self, req: ReadItem, files: _DataFiles) -> _Item:
        info = self._storage_info(req)
        file = files.open(info.relative_path)
        what = f"item {req.storage_index.fqn!r}"
        if info.offset + info.length > file.size:
            raise CorruptDCPError(
                file.path,
                f"truncated: {what} needs bytes [{info.offset}, {info.offset + info.length})"
                f" but the file has {file.size}",
            )
        item = _Item(req, info, file)
        if info.transform_descriptors:
            return self._decoded(item)
        return item

    def _decoded(self, item: _Item) -> _Item:
        """``item`` stored through stream transforms, as an item over its decoded bytes."""
        descriptors = item.info.transform_descriptors
        if isinstance(descriptors, str) or not isinstance(descriptors, Sequence):
            raise CorruptDCPError(
                item.file.path, f"{item.what}: transform descriptors {descriptors!r:.80}"
            )
        raw = item.read_at(0, item.info.length)
        expected = self.expected_checksum(item)
        if expected is not None:
            _verify(item, expected, [raw])
        fqn = item.req.storage_index.fqn
        limit = MAX_VALUE_BYTES
        if item.req.type != LoadItemType.BYTE_IO:
            sizes = self._chunk_sizes.get(item.req.storage_index)
            dtype = self._dtypes.get(fqn)
            nbytes = 0 if sizes is None or dtype is None else math.prod(sizes) * dtype.itemsize
            limit = nbytes + UNPACK_SLACK
        data = decode(raw, descriptors, limit, item.file.path, fqn, self.extension_registry)
        where = f"{item.file.path} (decoded {', '.join(descriptors)})"
        info = _StorageInfo(item.info.relative_path, 0, len(data))
        return _Item(item.req, info, _File(where, len(data), data=data))


@dataclass
class _File:
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
    return CorruptDCPError(location, f"missing {what} file")


def _open(
    location: str, what: str, storage_options: Mapping[str, Any], missing_ok: bool = False
) -> Any:
    """Open ``location`` (a path or URL) for reading; it must be a regular file and, when local,
    lie in the checkpoint directory (a symbolic link may point elsewhere in it, not outside).
    ``missing_ok``: None when there is no such file (but the directory exists)."""
    if storage.is_local(location):
        path = location[len("file://") :] if location.startswith("file://") else location
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
        return _File(location, st.st_size, fd=fd)
    fs, key = storage.filesystem(location, storage_options)
    try:
        info = storage.request(f"inspecting {location}", fs, "info", key)
    except FileNotFoundError:
        storage.check_bucket(fs, key, location)
        if missing_ok:
            return None
        raise _missing(location, what) from None
    except Exception as e:  # noqa: BLE001 - any client failure, reported with the URL
        raise CheckpointingError(f"cannot open {what} file {location}: {e!r:.300}") from e
    if info.get("type") != "file" or not isinstance(info.get("size"), int):
        raise CorruptDCPError(location, f"{what} is not a file")
    return _File(location, info["size"], fs=fs, key=key)


def _read_exact(file: _File, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(file, offset, memoryview(buf))
    return bytes(buf)


def _read_into(file: _File, offset: int, view: memoryview) -> None:
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
            raise CheckpointingError(f"reading {file.path} at offset {offset}: {e!r:.300}") from e
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


class _DataFiles:
    """The data files of one ``read_data`` call, each opened once, all closed by :meth:`close`."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.files: dict[str, _File] = {}

    def open(self, name: str) -> _File:
        file = self.files.get(name)
        if file is None:
            problem = file_name_problem(name)
            if problem:
                raise CorruptDCPError(self.reader._location(METADATA_NAME), problem)
            location = self.reader._location(name)
            file = _open(location, "DCP data", self.reader.storage_options)
            self.files[name] = file
        return file

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files.clear()


@dataclass
class _Item:
    req: ReadItem
    info: _StorageInfo
    file: _File

    @property
    def what(self) -> str:
        return f"item {self.req.storage_index.fqn!r}"

    def read_at(self, offset: int, n: int) -> bytes:
        return _read_exact(self.file, self.info.offset + offset, n)


@dataclass
class _Piece:
    """Bytes ``[offset, offset + len(view))`` of ``file``, to be read into ``view``."""

    file: _File
    offset: int
    view: memoryview


@dataclass
class _Copy:
    """A tensor item that could not be read in place: read ``pieces`` (into scratch memory), then
    ``finish()`` copies into the destination (for an archive only ``torch.load`` can decode,
    ``finish()`` decodes and checks it and returns the copy, to run later)."""

    item: _Item
    target: torch.Tensor
    finish: Callable[[], Any]
    pieces: list[_Piece] = field(default_factory=list)


def _fill(pieces: list[_Piece], whole: bytes, offset: int) -> None:
    """Copy each piece's bytes from ``whole``, the bytes of the file from ``offset`` on."""
    for p in pieces:
        start = p.offset - offset
        p.view[:] = whole[start : start + len(p.view)]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, writable, no copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _cut(file: _File, offset: int, view: memoryview) -> list[_Piece]:
    return [
        _Piece(file, offset + start, view[start : start + PIECE_BYTES])
        for start in range(0, len(view), PIECE_BYTES)
    ]


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

    def __init__(self, run: _ReadRun, files: _DataFiles) -> None:
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
    """One tensor item after :meth:`_ReadRun.prepare`: the pieces to read (into the destination,
    or into scratch memory that ``finish`` copies from), or, for a small item, its bytes already
    read (``whole``)."""

    pieces: list[_Piece]
    finish: Callable[[], None] | None
    whole: bytes | None
    offset: int  # where ``whole`` starts in the file


class _ReadRun:
    """One ``read_data`` call. :meth:`prepare`: locate every record and check it against the
    metadata and the destination, read small items and non-tensor values into memory (and check the
    values, if the planner can); nothing is written into the caller's state, so a damaged or
    hostile item leaves it as it was. :meth:`write`: read the pieces of large items (shared by all
    threads) into place, copy what went through scratch memory, commit."""

    def __init__(self, reader: Reader, planner: LoadPlanner, pool: ThreadPoolExecutor) -> None:
        self.reader = reader
        self.planner = planner
        self.pool = pool
        self.failed = threading.Event()
        self.targets: list[tuple[_Item, torch.Tensor]] = []
        self.jobs: list[_Job] = []
        self.blobs: list[tuple[_Item, memoryview]] = []
        self.checks: list[tuple[_Item, str, list[Any]]] = []
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

    def prepare(self, items: list[_Item]) -> None:
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
            lambda blob: self._read_pieces(_cut(blob[0].file, blob[0].info.offset, blob[1])),
            self.blobs,
        )
        for item, view in self.blobs:
            expected = self.reader.expected_checksum(item)
            if expected is not None:
                _verify(item, expected, [view])
        check_bytes = getattr(self.planner, "check_bytes", None)
        if check_bytes is not None:
            for item, view in self.blobs:
                check_bytes(item.req, io.BytesIO(view.obj))  # type: ignore[arg-type]

    def write(self) -> None:
        for job in self.jobs:
            if job.whole is not None:
                _fill(job.pieces, job.whole, job.offset)
        large = [job for job in self.jobs if job.whole is None]
        pieces = sorted(
            (p for job in large for p in job.pieces), key=lambda p: (p.file.path, p.offset)
        )
        self._map(lambda p: _read_into(p.file, p.offset, p.view), pieces)
        self._map(lambda check: _verify(*check), self.checks)
        self._map(lambda job: job.finish(), [job for job in self.jobs if job.finish is not None])
        for item, target in self.targets:
            self.planner.commit_tensor(item.req, target)
        for item, view in self.blobs:
            self.planner.load_bytes(item.req, io.BytesIO(view.obj))  # type: ignore[arg-type]

    def _locate(self, job: tuple[_Item, torch.Tensor]) -> _Job:
        item, target = job
        expected = self.reader.expected_checksum(item)
        whole = None
        if item.info.length <= WHOLE_ITEM:
            # Small item: one read serves its header and its data (one request on object stores).
            whole = item.read_at(0, item.info.length)
            if expected is not None:
                _verify(item, expected, [whole])
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
                _fill(pieces, whole, item.info.offset)
            assert finish is not None
            finish = finish()
            pieces, whole = [], None
        return _Job(pieces, finish, whole, item.info.offset)

    def _read_pieces(self, pieces: list[_Piece]) -> None:
        for p in pieces:
            _read_into(p.file, p.offset, p.view)

    def _record(self, item: _Item, whole: bytes | None) -> SavedTensor | NeedsTorchLoad:
        read_at = item.read_at if whole is None else (lambda offset, n: whole[offset : offset + n])
        try:
            record = locate(read_at, item.info.length)
        except NeedsTorchLoad as e:
            self._check_unpacked(item, e.unpacked)
            return e
        except BadRecord as e:
            raise CorruptDCPError(item.file.path, f"{item.what}: {e}") from None
        expected = self.reader._dtypes.get(item.req.storage_index.fqn)
        if record.dtype != expected:
            raise CorruptDCPError(
                item.file.path, f"{item.what} holds {record.dtype}, the metadata says {expected}"
            )
        self._check_stored_size(item, record.size)
        self._check_region(item, record.size)
        return record

    def _check_stored_size(self, item: _Item, size: Sequence[int]) -> None:
        sizes = self.reader._chunk_sizes.get(item.req.storage_index)
        if sizes is not None and tuple(size) != tuple(sizes):
            raise CorruptDCPError(
                item.file.path,
                f"{item.what} holds a tensor of size {list(size)}, the metadata's chunk is"
                f" {list(sizes)}",
            )

    def _check_unpacked(self, item: _Item, unpacked: int) -> None:
        """The fallback's ``torch.load`` allocates what the archive's entries declare: that must be
        about the chunk's size (a few KiB of deflated zeros can claim gigabytes)."""
        sizes = self.reader._chunk_sizes.get(item.req.storage_index)
        dtype = self.reader._dtypes.get(item.req.storage_index.fqn)
        nbytes = 0 if sizes is None or dtype is None else math.prod(sizes) * dtype.itemsize
        limit = max(nbytes, item.info.length) + UNPACK_SLACK
        if unpacked > limit:
            raise CorruptDCPError(
                item.file.path,
                f"{item.what}: archive entries unpack to {unpacked} bytes, over the {limit} its"
                " chunk can need",
            )

    def _check_region(self, item: _Item, size: Sequence[int]) -> None:
        req = item.req
        if len(req.storage_offsets) != len(size) or any(
            o + n > d for o, n, d in zip(req.storage_offsets, req.lengths, size)
        ):
            raise CorruptDCPError(
                item.file.path,
                f"{item.what}: the plan reads {list(req.lengths)} at {list(req.storage_offsets)}"
                f" of a stored tensor of size {list(size)}",
            )

    def _check_target(self, item: _Item, target: torch.Tensor) -> None:
        if tuple(target.shape) != tuple(item.req.lengths):
            raise CorruptDCPError(
                item.file.path,
                f"{item.what}: destination of shape {list(target.shape)} for a stored region of"
                f" {list(item.req.lengths)}",
            )

    def _in_place(
        self, item: _Item, record: SavedTensor, target: torch.Tensor
    ) -> list[_Piece] | None:
        """Pieces reading the region straight into ``target``, or None if it cannot be."""
        self._check_target(item, target)
        req = item.req
        if not (
            target.device.type == "cpu"
            and target.dtype == record.dtype
            and target.is_contiguous()
            and record.is_contiguous()
            and _region_is_contiguous(record.size, req.lengths)
        ):
            return None
        if target.numel() == 0:
            return []
        strides = _contiguous_strides(record.size)
        first = record.storage_offset + sum(o * s for o, s in zip(req.storage_offsets, strides))
        start = item.info.offset + record.data_offset + first * record.dtype.itemsize
        return _cut(item.file, start, _bytes_of(target))

    def _copy(
        self, item: _Item, record: SavedTensor | NeedsTorchLoad, target: torch.Tensor
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
                expected = self.reader._dtypes.get(req.storage_index.fqn)
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
                item, target, decode_with_torch_load, _cut(item.file, item.info.offset, raw)
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
        return _Copy(item, target, finish_from_scratch, _cut(item.file, start, _bytes_of(scratch)))


def _reads_whole_storage(item: _Item, record: Any, target: torch.Tensor) -> bool:
    """Whether reading ``item`` in place fills ``target`` with exactly the record's storage bytes."""
    return (
        isinstance(record, SavedTensor)
        and record.storage_offset == 0
        and not any(item.req.storage_offsets)
        and target.numel() * record.dtype.itemsize == record.storage_nbytes
    )


def _verify(item: _Item, expected: str, pieces: Iterable[Any]) -> None:
    """Raise unless ``pieces`` (the item's bytes, in order) have the checksum ``expected``."""
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    if hasher.hexdigest() != expected:
        raise mismatch(item.file.path, item.what, expected, hasher.hexdigest())


def _verify_stream(item: _Item, expected: str) -> None:
    """:func:`_verify` reading the whole item from its file, a piece at a time."""
    length = item.info.length
    _verify(
        item,
        expected,
        (item.read_at(at, min(PIECE_BYTES, length - at)) for at in range(0, length, PIECE_BYTES)),
    )


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t
