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
- ``read_data`` (:meth:`Reader.start_read`, then :meth:`PreparedRead.finish`) first opens every
  data file the plan needs (once each, :mod:`tierpoint.dcp.read_files`) and checks each item's range
  against the file's real size; then every item is located and checked, and verified against its
  checksum, before anything is written into the caller's state (:mod:`tierpoint.dcp.verified_read`).
  Tensor items are ``torch.save`` archives whose headers are parsed without unpickling
  (:mod:`tierpoint.dcp.saved_tensor`); their bytes go straight into the destination tensor where
  its memory allows, else through scratch memory, cut into pieces that ``thread_count`` threads
  share. Non-tensor (bytes) items are read whole and handed to ``planner.load_bytes``.

Checksums: where the rank that wrote a data file left its manifest (:mod:`tierpoint.dcp.checksums`,
read once per reader, parsed defensively; :meth:`Reader.manifest`), every item read is checked
against its recorded xxh3-64. A data file without a manifest (plain torch wrote it) is read
unverified.

Items torch wrote through stream transforms (``FileSystemWriter(_extensions=[ZStandard()])``) are
decoded into memory first (:mod:`tierpoint.dcp.transforms`, bounded by the size the item can have),
then read like the others; a transform this process cannot decode is refused by name
(:class:`~tierpoint.errors.UnsupportedStateError`).

Invariants: every problem with the files is a :class:`CorruptDCPError` (a
:class:`CorruptCheckpointError`) naming the file and the reason: missing file, item beyond the end
of its file (truncated), malformed archive or transformed stream, dtype or shape that contradicts
the metadata, a checksum mismatch (naming the item), a damaged manifest; a damaged or hostile item
leaves the caller's state as it was.

Peer retrieval (checkpoints on node-local disks) happens before a load, outside this class: whoever
makes the files local can ask :meth:`Reader.files_needed` which data files a rank's plan reads.
"""

from __future__ import annotations

import math
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
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
from .checksums import MAX_MANIFEST_BYTES, Manifest, manifest_name, parse_manifest
from .names import METADATA_NAME, checkpoint_id_or_path
from .read_files import DataFiles, File, Item, open_file, read_exact
from .safe_pickle import CorruptDCPError, file_name_problem, safe_loads
from .transforms import decode
from .verified_read import UNPACK_SLACK, PreparedRead, ReadRun, verify

DEFAULT_THREAD_COUNT = 4
MAX_METADATA_BYTES = 1 << 30
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
        self.storage_options = storage.options_dict(storage_options)
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        """The stored dtype of each tensor (by fully qualified name), from the metadata."""
        self.chunk_sizes: dict[MetadataIndex, torch.Size] = {}
        """The size of each stored chunk, from the metadata."""
        self._metadata: Metadata | None = None
        self._manifests: dict[str, Manifest | None] = {}
        self._manifests_lock = threading.Lock()

    # ------------------------------------------------------------------ torch's StorageReader API

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self.storage_data = {}
        self.dtypes = {}
        self.chunk_sizes = {}
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
        file = open_file(self._location(name), "DCP metadata", self.storage_options)
        try:
            if file.size > MAX_METADATA_BYTES:
                raise CorruptDCPError(
                    file.path, f"{file.size} bytes of DCP metadata, over {MAX_METADATA_BYTES}"
                )
            data = read_exact(file, 0, file.size)
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
        self.dtypes = {
            fqn: md.properties.dtype
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        self.chunk_sizes = {
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
        files = DataFiles(self.path, self.storage_options)
        pool = ThreadPoolExecutor(self.thread_count, thread_name_prefix="tierpoint-read")
        read = PreparedRead(ReadRun(self, planner, pool), files)
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
        """The checksum manifest of ``data_file`` (read once per reader); None for a file torch's
        own writer wrote (no save token in its name: no checksums). A tierpoint data file's
        manifest that is missing is damage (see :mod:`tierpoint.dcp.checksums`)."""
        name = manifest_name(data_file)
        if name is None:
            return None
        with self._manifests_lock:
            if name not in self._manifests:
                location = self._location(name)
                file = open_file(
                    location, "checksum manifest", self.storage_options, missing_ok=True
                )
                if file is None:
                    raise CorruptDCPError(
                        location,
                        f"missing: {data_file} was written by tierpoint (a save token in its name) "
                        "with its checksums in this manifest; without it the data cannot be checked",
                    )
                try:
                    if file.size > MAX_MANIFEST_BYTES:
                        raise CorruptDCPError(
                            location, f"{file.size} bytes of checksums, over the limit"
                        )
                    self._manifests[name] = parse_manifest(read_exact(file, 0, file.size), location)
                finally:
                    file.close()
            return self._manifests[name]

    def expected_checksum(self, item: Item) -> str | None:
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

    def _checked(self, req: ReadItem, files: DataFiles) -> Item:
        info = self._storage_info(req)
        file = files.open(info.relative_path)
        what = f"item {req.storage_index.fqn!r}"
        if info.offset + info.length > file.size:
            raise CorruptDCPError(
                file.path,
                f"truncated: {what} needs bytes [{info.offset}, {info.offset + info.length})"
                f" but the file has {file.size}",
            )
        item = Item(req, info, file)
        if info.transform_descriptors:
            return self._decoded(item)
        return item

    def _decoded(self, item: Item) -> Item:
        """``item`` stored through stream transforms, as an item over its decoded bytes."""
        descriptors = item.info.transform_descriptors
        if isinstance(descriptors, str) or not isinstance(descriptors, Sequence):
            raise CorruptDCPError(
                item.file.path, f"{item.what}: transform descriptors {descriptors!r:.80}"
            )
        raw = item.read_at(0, item.info.length)
        expected = self.expected_checksum(item)
        if expected is not None:
            verify(item, expected, [raw])
        fqn = item.req.storage_index.fqn
        limit = MAX_VALUE_BYTES
        if item.req.type != LoadItemType.BYTE_IO:
            sizes = self.chunk_sizes.get(item.req.storage_index)
            dtype = self.dtypes.get(fqn)
            nbytes = 0 if sizes is None or dtype is None else math.prod(sizes) * dtype.itemsize
            limit = nbytes + UNPACK_SLACK
        data = decode(raw, descriptors, limit, item.file.path, fqn, self.extension_registry)
        where = f"{item.file.path} (decoded {', '.join(descriptors)})"
        info = _StorageInfo(item.info.relative_path, 0, len(data))
        return Item(item.req, info, File(where, len(data), data=data))
