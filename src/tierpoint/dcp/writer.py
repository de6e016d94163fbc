"""``Writer``: a torch DCP ``StorageWriter`` that writes standard checkpoints fast and crash-safely.

Two ways to drive it:

- torch's own ``torch.distributed.checkpoint.save(state, storage_writer=Writer(path))``: torch calls
  ``set_up_storage_writer`` → ``prepare_local_plan`` → ``prepare_global_plan`` (coordinator) →
  ``write_data`` → ``finish`` (coordinator);
- tierpoint's :func:`tierpoint.dcp.save` / :func:`tierpoint.dcp.async_save`, through
  :func:`~tierpoint.dcp.state_dict_saver.save_state_dict_async_plan`, which calls
  ``prepare_write_data`` after planning, then either :meth:`Writer.write_now` or, for async saves,
  the ``(async_fn, preload_fn, args)`` of :meth:`Writer.get_save_function_and_args` (the snapshot
  into a reused staging buffer runs in the trainer, the writing in tierpoint's background worker;
  with a ``source_file`` the snapshot copies nothing and the worker writes from the file's pages),
  and finally ``save_state_dict_async_finalize``.

What it writes (:mod:`tierpoint.dcp.step_dirs`, :mod:`tierpoint.dcp.file_plan`): per rank
``thread_count`` files ``__<rank>_<k>.<token>.distcp`` (``token``: new for every save of this rank,
:attr:`Writer.file_token`) written by as many threads, fsynced with their directory (async saves of
CPU states to a RAM file system: one file, the staging memory itself, named by the snapshot), and
the rank's checksum manifest ``.checksums-<rank>.<token>.json`` (:mod:`tierpoint.dcp.checksums`);
then ``.metadata`` written by the coordinator (:mod:`tierpoint.dcp.metadata_file`): the commit.

Invariants:
- Every rank creates its unfinished marker (``.unfinished-<rank>``) before any of its data is
  written (local paths: at set-up; object stores: first in the writing job, off the training
  thread); markers are removed only after ``.metadata`` is written.
- A rank's write succeeds only once its data files and its checksum manifest are written (and
  fsynced), so every committed step has every rank's manifest.
- A complete directory is written into only with ``overwrite=True`` (see
  :mod:`~tierpoint.dcp.metadata_file`); its ``.metadata`` goes at set-up, before any rank can
  write (the directory is uncommitted while the new save runs).
- No data file of this save has the name of a file an earlier save wrote (the token differs), so
  ``.metadata`` never refers to an earlier save's bytes, wherever they were left.
- Saving into a directory again leaves none of the earlier save's files, and at most one async
  save of this process writes into a directory at a time (and its writer is not reused until it is
  finalized or discarded): :mod:`tierpoint.dcp.directory`.
- A failed save leaves no ``.metadata``; :meth:`Writer.discard` removes what this rank wrote. (On
  an object store a ``.metadata`` upload whose reply never came may still land: then the
  coordinator's marker stays, so the step never counts as complete.)
- Every failure is a :class:`~tierpoint.errors.CheckpointingError` naming the file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import dist as tpdist
from .. import storage
from ..errors import CheckpointingError, error_text
from ..snapshot_copy import Streams, training_streams
from ..staging import SourceFile, StagingBuffer
from . import directory
from .file_plan import RankFiles
from .jobs import write_staged, write_with_manifest
from .metadata_bytes import Rows
from .metadata_file import publish_results, publish_rows, refuse_complete
from .names import METADATA_NAME, checkpoint_id_or_path, marker_name
from .plan_data import byte_sizes, file_contents, files_for, planned_tensors, resolve_bytes
from .snapshot import copy_pairs, fill, name_in_place, source_pieces, stages_in_place
from .staging_pool import StagingPool
from .write_results import Results, decode, results_for

logger = logging.getLogger("tierpoint")

DEFAULT_POOL = StagingPool()
"""Staging buffers shared by every :class:`Writer` of this process that is given no pool."""


class Writer(StorageWriter):
    """Writes a torch DCP checkpoint to ``path_or_url`` (a directory or an fsspec URL prefix).

    Args:
        path_or_url: the checkpoint directory, e.g. ``step_dirs.step_path(base, step)`` (or
            ``checkpoint_id=``, torch's keyword; giving both is a ``TypeError``).
        thread_count: files per rank, written in parallel by as many threads (an async save to
            a RAM file system fills one file per rank during the snapshot, see
            :mod:`tierpoint.dcp.staging_pool`).
        sync_files: fsync files and directories (turn off only for throw-away checkpoints).
        storage_options: fsspec options for URLs (e.g. ``{"endpoint_url": ...}`` for s3fs).
        upload: multipart/retry settings for object stores.
        staging_pool: where async saves keep their reused staging buffers (default: the process's).
        timeout: seconds a synchronous write may take (default ``TIERPOINT_TIMEOUT``).
        overwrite: allow saving into a directory that holds a committed checkpoint (it is
            uncommitted first). By default that is refused (with torch's words, "Checkpoint
            already exists"): the old checkpoint stays intact.
        source_file: a file whose pages the state's tensors view and whose bytes stay unchanged
            until the save is finalized or aborted: an async save then copies nothing in its
            snapshot, the worker writes the tensors' bytes from the file (see
            :class:`~tierpoint.staging.SourceFile`; a tensor outside it: copied as usual).
    """

    def __init__(
        self,
        path_or_url: str | os.PathLike | None = None,
        *,
        checkpoint_id: str | os.PathLike | None = None,
        thread_count: int = 2,
        sync_files: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        upload: storage.UploadOptions = storage.DEFAULT_UPLOAD,
        staging_pool: StagingPool | None = None,
        timeout: float | None = None,
        overwrite: bool = False,
        source_file: SourceFile | None = None,
    ) -> None:
        super().__init__()
        path_or_url = checkpoint_id_or_path(path_or_url, checkpoint_id, "Writer")
        if type(thread_count) is not int or thread_count < 1:
            raise CheckpointingError(f"thread_count must be an int >= 1, got {thread_count!r}")
        self.path = directory.absolute(storage.checkpoint_path(path_or_url, "path_or_url"))
        self.thread_count = int(thread_count)
        self.sync_files = sync_files
        self.storage_options = storage.options_dict(storage_options)
        self.upload = upload
        self.overwrite = overwrite
        self.source_file = source_file
        self.pool = staging_pool if staging_pool is not None else DEFAULT_POOL
        self.timeout = timeout if timeout is not None else tpdist.default_timeout().total_seconds()
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self._marker_made = self._clears = False  # see set_up_storage_writer
        self._world_size: int | None = None
        self._markers_seen: list[str] | None = None  # by the coordinator's commit (its listing)
        self._plan: SavePlan | None = None
        self._planner: SavePlanner | None = None
        self._files: RankFiles | None = None
        self._results: Results | None = None
        self.write_error: str | None = None
        self._buffer: StagingBuffer | None = None
        self._prefix = ""
        self._in_place = False  # the async save's staging memory is the checkpoint file itself
        self._training_streams: Streams = {}  # taken in the trainer, for an overlapped snapshot
        self._tensors: list[torch.Tensor | None] = []  # the async save's, by plan item
        self._busy_key: str | None = None  # this writer's claim (see directory.claim)
        self.earlier_files: list[str] = []
        """Data files and ``.metadata`` of an earlier save this rank saw at set-up (local paths)."""
        self.flashpoint_markers: list[str] = []  # ML Flashpoint's, next to it (see set-up)
        self.file_token = ""
        """Part of this save's data file names, new at every ``set_up_storage_writer``."""
        self.results_token = ""
        """The ``file_token`` of the files :meth:`retrieve_write_results` names."""

    # ---------------------------------------------------------------------- StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.refuse_if_in_flight()
        if checkpoint_id:
            self.path = directory.absolute(os.fspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex
        self._marker_made = self._clears = False
        self.earlier_files, self.flashpoint_markers = [], []
        self._forget_plan()
        self._results = None
        self.write_error = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Create the directory and this rank's unfinished marker (before any data is written)."""
        self.refuse_if_in_flight()
        self.is_coordinator = is_coordinator
        self.earlier_files, self.flashpoint_markers, self._markers_seen = [], [], None
        self.file_token = _new_file_token()
        self._forget_plan()  # a refused save must not discard the files of this writer's last one
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else tpdist.get_rank()
        committed = self.overwrite or refuse_complete(
            self.path, is_coordinator, self.storage_options, self.upload
        )
        self._claim(check_only=True)
        if storage.is_local(self.path):  # on object stores the job that writes makes it first
            directory.make_marker(self.path, self.rank, self.storage_options, self.upload)
        self._marker_made = True  # (or soon: removing a marker that is not there is fine)
        # Object stores, tierpoint's planning (it gives world_size, agrees one file token): the
        # coordinator's job clears what an earlier save left, so that the commit lists nothing.
        self._world_size = kwargs.get("world_size")
        self._clears = is_coordinator and not storage.is_local(self.path) and bool(self._world_size)
        if is_coordinator and committed:  # saving again un-commits, before any rank can write
            self._remove(METADATA_NAME)
        if storage.is_local(self.path):
            self.earlier_files = directory.earlier_save_files(storage.local_path(self.path))
            self.flashpoint_markers = directory.flashpoint_markers(storage.local_path(self.path))

    def refuse_if_in_flight(self) -> None:
        """Raise if this writer's async save is written or being written but not yet finalized."""
        if self._busy_key is not None:
            raise CheckpointingError(
                f"{self.path}: this Writer's async save is still in flight; finalize it first "
                "(AsyncCallsQueue.maybe_finalize_async_calls(blocking=True), or the result of "
                "async_save), or save through another Writer"
            )

    def remove_earlier_save(self) -> None:
        """Remove what an earlier save left in this rank's view (listed at set-up: data files,
        ``.metadata``, ML Flashpoint's markers), only before any rank of this save writes."""
        old, fp = self.earlier_files, self.flashpoint_markers
        self.earlier_files, self.flashpoint_markers = [], []
        directory.remove_earlier_files(self.path, old, self.storage_options, self.upload, fp)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=f"__{i}_") if p.storage_data is None else p
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Synchronous write (torch's flow): all files of this rank, then the results."""
        self.prepare_write_data(plan, planner)
        self.write_now(raise_errors=True)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(self.retrieve_write_results())
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: commit (``.metadata``), then remove every marker it can see."""
        where = (self.storage_meta(), self.storage_options, self.upload)
        self._markers_seen = publish_results(self.path, metadata, results, *where)
        self.remove_markers(every_visible=True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # ---------------------------------------------------------------------- tierpoint's flow

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Remember the final local plan (this rank's files are laid out from it, cached per plan)."""
        prefix = plan.storage_data if isinstance(plan.storage_data, str) else f"__{self.rank}_"
        self._plan, self._planner, self._prefix = plan, planner, prefix
        self._files = None  # laid out when first needed: an async save in place makes one file
        self._results = None
        self.write_error = None

    def write_now(self, raise_errors: bool = False) -> None:
        """Write this rank's files from the live state (synchronous save). A failure is kept in
        :attr:`write_error` (agreed at finalize) unless ``raise_errors``."""
        try:
            plan, files = self._require_plan()
            byte_records, results = self._serialize()
            contents = file_contents(plan, self._require_planner()[1], files, byte_records)
            write_with_manifest(self.path, contents, results.ranges(self.file_token), *self._io())
            self._results, self.results_token = results, self.file_token
        except Exception as e:  # noqa: BLE001 - agreed by the caller, or raised below
            self.write_error = error_text(e)
            if raise_errors:
                raise

    def get_save_function_and_args(self) -> tuple[Any, Any, tuple]:
        """``(async_fn, preload_fn, async_fn_args)`` for an :class:`~tierpoint.asyncsave.AsyncRequest`.

        ``preload_fn`` snapshots the state into a staging buffer (blocking, in the trainer) and
        returns the keyword arguments that complete ``async_fn``'s call in the worker.
        """
        plan, planner = self._require_planner()
        self._claim()
        self._tensors = planned_tensors(plan, planner)  # once a save: the snapshot's too
        self._training_streams = training_streams([t for t in self._tensors if t is not None])
        # A state with CUDA tensors stages in the pool's reused pinned memory, not in place: every
        # in-place file would be pinned anew, which costs the trainer more than the worker's writing.
        # In place, one file per rank: there is no writing left to share among threads.
        on_device = bool(self._training_streams)
        self._in_place = stages_in_place(self.path) and not on_device and not self.source_file
        self._files = files = self._named_files(1 if self._in_place else self.thread_count)
        layout = [(f.name, f.staging_base, f.tensor_bytes) for f in files.files]
        return write_staged, self.snapshot, (self.path, layout, *self._io())

    def snapshot(self) -> dict[str, Any]:
        """Copy the state's tensors into a (reused) staging buffer, or, when they all lie in the
        source file, only say where (the worker reads them there); serialize non-tensor values.
        When staging in place, also name the filled file: the worker then only makes it durable."""
        plan, files = self._require_plan()
        tensors, self._tensors = self._tensors, []  # not held once copied
        assert len(tensors) == len(plan.items), "get_save_function_and_args() runs first"
        source = self.source_file
        pieces = source_pieces(plan, files, source, tensors) if source else None
        step_dir = storage.local_path(self.path) if self._in_place else None
        buf = self._buffer = self.pool.acquire(files, step_dir) if pieces is None else None
        if buf is not None:
            sources, targets = copy_pairs(plan, files, buf, tensors)
            fill(buf, sources, targets, self._training_streams)
        byte_records, results = self._serialize()
        self._results, self.results_token = results, self.file_token
        items = results.ranges(self.file_token)  # what the worker hashes, per file
        kwargs = {"buffer": buf, "byte_records": byte_records, "items": items}
        if buf is None:  # the worker reads the tensors' bytes from the source file
            return {**kwargs, "source": source, "pieces": pieces}
        if step_dir is None or not buf.file_backed:
            return kwargs
        self._buffer = None
        try:
            name_in_place(buf, files, byte_records, step_dir)
        finally:
            self.pool.consumed(buf, files, step_dir)
        return {"buffer": None, "byte_records": [], "items": items}

    def release_staging(self) -> None:
        """Give the staging buffer back to the pool (the save is finalized or aborted)."""
        self._leave()
        if self._buffer is not None:
            self.pool.release(self._buffer)
            self._buffer = None

    def retrieve_write_results(self) -> list[WriteResult]:
        return decode(self.kept_results().rows, self.results_token)

    def kept_results(self) -> Results:
        """This rank's last write results, as the commit sends them (for :attr:`results_token`)."""
        if self.write_error is not None:
            raise CheckpointingError(self.write_error)
        if self._results is None:
            raise CheckpointingError(f"{self.path}: no data was written by this rank yet")
        return self._results

    def commit(self, metadata: Metadata, rows: Rows) -> None:
        """Write ``.metadata`` (atomically) for every rank's write results ``rows`` (see
        :mod:`tierpoint.dcp.write_results`) under this save's token: the checkpoint becomes
        complete once the markers go."""
        where = (self.storage_meta(), self.storage_options, self.upload)
        tidy = not self._clears  # else the writing job cleared the directory: no listing
        seen = publish_rows(self.path, metadata, rows, self.results_token, *where, tidy=tidy)
        self._markers_seen = seen if tidy else []

    def remove_markers(self, every_visible: bool = False) -> None:
        """Remove this rank's marker (and, with ``every_visible``, every marker in the directory:
        those the commit's listing saw, else listed now), in one request to an object store."""
        seen, self._markers_seen = self._markers_seen, None
        names = {marker_name(self.rank)}
        if every_visible:
            where = (self.path, self.storage_options, self.upload)
            names.update(seen if seen is not None else directory.visible_markers(*where))
        self._remove_all(sorted(names))

    def discard(self, keep_marker: bool = False) -> None:
        """Remove what this rank wrote for a failed save: data files, then its marker (kept with
        ``keep_marker``: a commit of unknown outcome may still land; the marker keeps it unfinished)."""
        self._leave()
        if self._files is not None:
            self._remove_all(directory.with_manifest(self._files.names))
        if self._marker_made and not keep_marker:
            self._remove(marker_name(self.rank))
            storage.remove_dir_if_empty(self.path, self.storage_options)

    # ---------------------------------------------------------------------- helpers

    def _named_files(self, thread_count: int) -> RankFiles:
        assert self._plan is not None
        return files_for(self._plan, self._prefix, thread_count).with_token(self.file_token)

    def _forget_plan(self) -> None:
        self._plan, self._planner, self._files, self._tensors = None, None, None, []

    def _claim(self, check_only: bool = False) -> None:
        """Refuse if another writer's async save is in flight into this directory in this process;
        else (unless ``check_only``) mark this writer's save as in flight there."""
        self._leave()  # one save per writer: its previous one is over
        self._busy_key = directory.claim(self.path, check_only=check_only)

    def _leave(self) -> None:
        directory.release(self._busy_key)
        self._busy_key = None

    def _remove(self, name: str) -> None:
        url = storage.join(self.path, name)
        storage.remove(url, storage_options=self.storage_options, upload=self.upload)

    def _remove_all(self, names: list[str]) -> None:
        storage.remove_files(
            self.path, names, storage_options=self.storage_options, upload=self.upload
        )

    def _io(self) -> tuple:
        """The arguments every writing job takes after its files, ``marker`` and ``clear`` last
        (:func:`~tierpoint.dcp.jobs.write_with_manifest`; object stores only, ``clear`` for the
        coordinator's: the commit then lists nothing)."""
        marker = None if storage.is_local(self.path) else self.rank
        clear = (self.file_token, self._world_size) if self._clears else None
        options, threads, sync = self.storage_options, self.thread_count, self.sync_files
        return (options, threads, sync, self.upload, self.timeout, marker, clear)

    def _require_planner(self) -> tuple[SavePlan, SavePlanner]:
        if self._plan is None or self._planner is None:
            raise CheckpointingError("Writer: prepare_write_data() must run before writing")
        return self._plan, self._planner

    def _require_plan(self) -> tuple[SavePlan, RankFiles]:
        """The plan and this rank's files (laid out when first asked for)."""
        plan, _ = self._require_planner()
        if self._files is None:
            self._files = self._named_files(self.thread_count)
        return plan, self._files

    def _serialize(self) -> tuple[list[list[bytes]], Results]:
        """The serialized non-tensor values (per file), and the write results they make."""
        plan, files = self._require_plan()
        records = resolve_bytes(plan, self._require_planner()[1], files)
        return records, results_for(plan, files, byte_sizes(files, records), self.file_token)


def _new_file_token() -> str:
    return secrets.token_hex(6)


__all__ = ["DEFAULT_POOL", "Writer", "stages_in_place", "write_staged"]
