"""``Checkpointer``: OLMo-core's trainer checkpointer, on tierpoint's DCP writer and reader.

Layout and discovery: :mod:`.discovery`. One save (collective: every rank calls it at the same
point)::

    1. every rank: flatten its trainer state, take ``train_module.state_dict_to_save()``
       (a value that cannot be saved fails here, on every rank, before anything is touched);
    2. rank 0: check the target ``step<N>``: a finished checkpoint there (or files that are not a
       checkpoint's) raises ``FileExistsError`` unless ``save_overwrite``; leftovers of an
       interrupted save (or, with ``save_overwrite``, the old checkpoint: ``.metadata.json``
       first) are removed; then rank 0 draws the save's id and sends it to every rank;
    3. every rank: write ``train/rank<r>.safetensors`` (recording the save's id and its rank);
    4. every rank: ``tierpoint.dcp.save`` (or ``async_save``) of the state into ``model_and_optim/``;
    5. once that is committed on every rank: rank 0 publishes ``.metadata.json`` (the commit
       point, recording the save's id), then removes the ephemeral checkpoints older than this one.

``save_async`` returns after step 4 has taken its snapshot; step 5 runs when the save is finalized
(see :mod:`.future`). ``load`` reads ``.metadata.json``, each rank's trainer state (its own, or
rank 0's when the world size changed: :mod:`.trainer_state`; bound to the save by its id, not to
the directory's name), the DCP metadata (without pickle), then loads ``model_and_optim/`` into
``train_module.state_dict_to_load(...)`` in place.

Invariants: those of :mod:`tierpoint.dcp` (complete or invisible, agreed errors, nothing runs code
from a file), and: a step directory is a checkpoint only once ``.metadata.json`` is there, which
is written last and removed first; every step of a save or load that can fail on one rank raises
the same error on every rank.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .. import dcp, storage
from .. import dist as tpdist
from ..asyncsave import AsyncCallsQueue
from ..errors import CheckpointingError, check_flag
from . import discovery, trainer_state
from .discovery import DCP_METADATA, MODEL_AND_OPTIM, normalize
from .errors import CheckpointExistsError, CheckpointNotFoundError, agreed
from .future import CheckpointFuture
from .metadata import METADATA_FNAME, CheckpointMetadata, metadata_path, read_metadata
from .train_module import TrainModule

logger = logging.getLogger("tierpoint")

_LEFTOVERS = {MODEL_AND_OPTIM, trainer_state.TRAIN_DIR, METADATA_FNAME + ".tmp"}
"""What an interrupted save leaves in a step directory (removed by the next save into it)."""


@dataclass
class Checkpointer:
    """Saves and loads a train module and per-rank trainer state in OLMo-core's layout.

    Fields (OLMo-core's names):

    - ``work_dir``: a local directory for temporary files (trainer state on its way to or from
      an object store); created if missing.
    - ``save_overwrite``: replace a finished checkpoint in the target directory (else
      ``FileExistsError``); also lets :meth:`write_file` replace a file.
    - ``pre_download``: accepted, no effect: the reader reads each rank's byte ranges straight
      from the object store, in parallel.
    - ``process_group``: accepted; tierpoint runs its collectives on its own gloo group over all
      ranks (so async saves need no separate group). A group that does not span every rank is
      refused.
    - ``save_thread_count``: files (and threads) per rank for ``model_and_optim`` (default 2).
    - ``load_thread_count``: reader threads per rank (default: the reader's).
    - ``throttle_uploads``: one part of a multipart upload in flight at a time, instead of 4.

    tierpoint's additions: ``storage_options`` (fsspec options for URLs, such as
    ``{"endpoint_url": ...}``) and ``allow_pickled_trainer_state`` (the default for
    :meth:`load`).
    """

    METADATA_FNAME: ClassVar[str] = METADATA_FNAME
    CHECKPOINT_DIR: ClassVar[str] = discovery.CHECKPOINT_DIR

    work_dir: str | os.PathLike
    save_overwrite: bool = False
    pre_download: bool = False
    process_group: Any = None
    save_thread_count: int | None = None
    load_thread_count: int | None = None
    throttle_uploads: bool = False
    storage_options: Mapping[str, Any] | None = None
    allow_pickled_trainer_state: bool = False
    _queue: AsyncCallsQueue | None = field(default=None, init=False, repr=False)
    _ephemeral: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("save_overwrite", "pre_download", "throttle_uploads"):
            check_flag(name, getattr(self, name))
        check_flag("allow_pickled_trainer_state", self.allow_pickled_trainer_state)
        for name in ("save_thread_count", "load_thread_count"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.process_group is not None and tpdist.is_distributed():
            import torch.distributed as dist

            size = dist.get_world_size(self.process_group)
            if size != dist.get_world_size():
                raise ValueError(
                    f"process_group has {size} ranks; the Checkpointer needs every rank "
                    f"({dist.get_world_size()}): pass a group over all ranks, or None"
                )
        self.work_dir = Path(os.path.expanduser(os.fspath(self.work_dir)))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._upload = (
            storage.UploadOptions(concurrency=1)
            if self.throttle_uploads
            else storage.DEFAULT_UPLOAD
        )

    # ------------------------------------------------------------------------------ saving

    def save(
        self,
        dir: str | os.PathLike,
        train_module: TrainModule,
        train_state: dict[str, Any],
        ephemeral: bool = False,
    ) -> None:
        """Save the train module and this rank's ``train_state`` to ``dir`` (collective); returns
        once the checkpoint is finished on every rank."""
        dir = normalize(dir)
        self._wait_for_pending_saves()
        state, save_id = self._prepare(dir, train_module, train_state)
        dcp.save(state, storage.join(dir, MODEL_AND_OPTIM), **self._save_options())
        self._commit(dir, ephemeral, save_id)

    def save_async(
        self,
        dir: str | os.PathLike,
        train_module: TrainModule,
        train_state: dict[str, Any],
        ephemeral: bool = False,
    ) -> Future[None]:
        """Like :meth:`save`, but returns once the state is copied: the files are written in the
        background, and the checkpoint is finished when the returned future completes (see
        :class:`~tierpoint.checkpointer.future.CheckpointFuture`: its ``done()`` and ``result()``
        are collective). The train module's state may change as soon as this returns."""
        dir = normalize(dir)
        queue = self._async_queue()
        if queue.get_num_unfinalized_calls() >= queue.max_in_flight:
            queue.maybe_finalize_async_calls(blocking=True)  # back-pressure, before touching dir
        state, save_id = self._prepare(dir, train_module, train_state)
        request = dcp.async_save_request(
            state, storage.join(dir, MODEL_AND_OPTIM), **self._save_options()
        )
        future = CheckpointFuture(queue, f"Checkpointer.save_async to {dir}", request)

        def finalize() -> None:
            self._commit(dir, ephemeral, save_id)
            future.finish()

        request.add_finalize_fn(finalize)
        request.abort_fns = [*request.abort_fns, future.mark_failed]
        future.call_id = queue.schedule_async_request(request)
        return future

    def _save_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"storage_options": self.storage_options, "upload": self._upload}
        if self.save_thread_count is not None:
            options["thread_count"] = self.save_thread_count
        return options

    def _async_queue(self) -> AsyncCallsQueue:
        if self._queue is None:
            self._queue = dcp.default_queue()
        return self._queue

    def _wait_for_pending_saves(self) -> None:
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=True)

    def _prepare(
        self, dir: str, train_module: TrainModule, train_state: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        """Steps 1-3 of a save (module docstring); returns the state for ``model_and_optim`` and
        the save's id."""
        flat = state = None
        first = {"id": uuid.uuid4().hex, "dir": dir} if tpdist.get_rank() == 0 else None
        first = tpdist.broadcast_json(first, what=f"naming the save {dir}")
        with agreed(f"preparing the checkpoint {dir}"):
            if dir != first["dir"]:  # (each rank's files would go elsewhere: nothing loads)
                raise CheckpointingError(f"every rank must save into the same step: {dir} here, "
                                         f"{first['dir']} on rank 0")  # fmt: skip
            flat = trainer_state.encode(train_state)
            state = train_module.state_dict_to_save()
            if not isinstance(state, dict):
                raise TypeError(
                    f"state_dict_to_save() returned a {type(state).__name__}, not a dict"
                )
        with agreed(f"preparing the directory {dir}"):
            if tpdist.get_rank() == 0:
                self._clear_target(dir)
        save_id = first["id"]
        with agreed(f"writing the trainer state into {dir}"):
            trainer_state.write(
                dir,
                tpdist.get_rank(),
                flat,
                save_id=save_id,
                work_dir=str(self.work_dir),
                storage_options=self.storage_options,
                upload=self._upload,
            )
        return state, save_id

    def _clear_target(self, dir: str) -> None:
        names = set(storage.listdir(dir, self.storage_options))
        finished = METADATA_FNAME in names or DCP_METADATA in names
        foreign = sorted(names - _LEFTOVERS - {METADATA_FNAME, DCP_METADATA})
        if (finished or foreign) and not self.save_overwrite:
            what = (
                "a finished checkpoint"
                if finished
                else f"files that are not a checkpoint's ({', '.join(foreign[:5])})"
            )
            raise CheckpointExistsError(
                f"{dir} already holds {what}; pass save_overwrite=True to replace it"
            )
        if names:
            if DCP_METADATA in names:
                storage.remove(
                    storage.join(dir, DCP_METADATA), storage_options=self.storage_options
                )
            discovery.remove_checkpoint(dir, self.storage_options)

    def _commit(self, dir: str, ephemeral: bool, save_id: str) -> None:
        """Step 5: publish ``.metadata.json`` (rank 0), then retire older ephemeral checkpoints."""
        metadata = CheckpointMetadata(
            ephemeral=ephemeral, world_size=tpdist.get_world_size(), save_id=save_id
        )
        with agreed(f"finishing the checkpoint {dir}"):
            if tpdist.get_rank() == 0:
                storage.publish(
                    metadata_path(dir),
                    metadata.to_json(),
                    storage_options=self.storage_options,
                    upload=self._upload,
                )
        if tpdist.get_rank() == 0:
            self._retire_ephemeral(dir)
        self._ephemeral = [dir] if ephemeral else []

    def _retire_ephemeral(self, dir: str) -> None:
        doomed = [p for p in self._ephemeral if p != dir]
        step = discovery.step_of(storage.basename(dir))
        if step is not None:
            try:
                for s, path in self.find_checkpoints(
                    discovery.parent_of(dir), ephemeral=True, storage_options=self.storage_options
                ):
                    if s < step and path not in doomed:
                        doomed.append(path)
            except Exception as e:  # noqa: BLE001 - the new checkpoint is finished already
                logger.warning("could not list the ephemeral checkpoints next to %s: %s", dir, e)
        for path in doomed:
            try:
                discovery.remove_checkpoint(path, self.storage_options)
                logger.info("removed the ephemeral checkpoint %s", path)
            except Exception as e:  # noqa: BLE001 - the new checkpoint is finished already
                logger.warning("could not remove the ephemeral checkpoint %s: %s", path, e)

    # ------------------------------------------------------------------------------ loading

    def load(
        self,
        dir: str | os.PathLike,
        train_module: TrainModule,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
        allow_pickled_trainer_state: bool | None = None,
    ) -> dict[str, Any] | None:
        """Load the checkpoint at ``dir`` into ``train_module`` (collective); returns this rank's
        trainer state (rank 0's when the checkpoint was saved by another number of ranks), or
        ``None`` when not asked for or the checkpoint has none.

        ``load_trainer_state``: ``None`` if present, ``True`` required (else
        ``FileNotFoundError``), ``False`` skipped; saved by this many ranks, each rank's own file
        must be there (else ``CorruptCheckpointError``). ``load_optim_state``: passed to
        ``state_dict_to_load`` (``False``: model only). ``allow_pickled_trainer_state``: read
        OLMo-core's ``train/rank<r>.pt`` pickles through ``torch.load(weights_only=True)`` and
        numpy's array globals (default: the Checkpointer's field, ``False``).
        """
        dir = normalize(dir)
        self._wait_for_pending_saves()
        allow = (
            self.allow_pickled_trainer_state
            if allow_pickled_trainer_state is None
            else check_flag("allow_pickled_trainer_state", allow_pickled_trainer_state)
        )
        rank, world = tpdist.get_rank(), tpdist.get_world_size()
        options = self.storage_options
        found: dict[str, Any] = {}
        with agreed(f"reading the checkpoint {dir}"):
            meta = None
            if storage.exists(metadata_path(dir), options):
                meta = read_metadata(dir, options)
            found["path"] = self._model_and_optim(dir, meta)
            if load_trainer_state is not False:
                found["trainer"] = trainer_state.read(
                    dir,
                    rank,
                    world_size=world,
                    saved_world_size=meta.world_size if meta else None,
                    save_id=meta.save_id if meta else None,
                    allow_pickle=allow,
                    work_dir=str(self.work_dir),
                    storage_options=options,
                )
                if found["trainer"] is not None and found["path"] == dir:
                    raise self._unfinished(dir)  # trainer state, but no model_and_optim
                if found["trainer"] is None and load_trainer_state:
                    raise CheckpointNotFoundError(
                        f"Missing trainer state in checkpoint dir '{dir}'"
                    )
            found["metadata"] = dcp.read_metadata(found["path"], storage_options=options)
        state = train_module.state_dict_to_load(found["metadata"], optim=load_optim_state)
        load_options: dict[str, Any] = {"storage_options": options}
        if self.load_thread_count is not None:
            load_options["thread_count"] = self.load_thread_count
        dcp.load(state, found["path"], **load_options)
        train_module.load_state_dict(state)
        return found.get("trainer")

    def _model_and_optim(self, dir: str, meta: CheckpointMetadata | None) -> str:
        """Where the DCP checkpoint of ``dir`` is: ``model_and_optim/`` of a finished step, or
        ``dir`` itself when it is a bare DCP checkpoint (model weights, no trainer state)."""
        options = self.storage_options
        path = storage.join(dir, MODEL_AND_OPTIM)
        if storage.exists(storage.join(path, DCP_METADATA), options):
            if meta is None:
                raise CheckpointNotFoundError(
                    f"{dir} has no {METADATA_FNAME}: its save did not finish (or it is not a "
                    "checkpoint); load an older one (latest_checkpoint lists finished ones)"
                )
            return path
        if storage.exists(storage.join(dir, DCP_METADATA), options):
            return dir
        raise self._unfinished(dir)

    @staticmethod
    def _unfinished(dir: str) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(
            f"{dir} has no {MODEL_AND_OPTIM}/{DCP_METADATA}: not a finished checkpoint (a bare DCP "
            "checkpoint of model weights loads with load_trainer_state=False)"
        )

    # ------------------------------------------------------------------------------ files

    def write_file(self, dir: str | os.PathLike, fname: str, contents: str | bytes) -> str | Path:
        """Write ``contents`` to ``dir/fname`` atomically (any rank, not collective); returns the
        path (a ``Path`` for local directories) or URL. An existing file raises
        ``FileExistsError`` unless ``save_overwrite``."""
        dir = normalize(dir)
        target = storage.join(dir, os.fspath(fname).lstrip("/"))
        if not self.save_overwrite and storage.exists(target, self.storage_options):
            raise CheckpointExistsError(f"{target} exists; pass save_overwrite=True to replace it")
        data = contents.encode() if isinstance(contents, str) else bytes(contents)
        if storage.is_local(target):
            storage.makedirs(os.path.dirname(storage.local_path(target)))
        storage.publish(target, data, storage_options=self.storage_options, upload=self._upload)
        return Path(storage.local_path(target)) if storage.is_local(target) else target

    # ------------------------------------------------------------------------------ discovery

    @classmethod
    def checkpoint_dirname(cls, step: int) -> str:
        """``step<N>``."""
        return discovery.checkpoint_dirname(step)

    @classmethod
    def dir_is_checkpoint(
        cls, dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
    ) -> bool:
        """Whether ``dir`` is a finished checkpoint (or a bare DCP checkpoint)."""
        return discovery.dir_is_checkpoint(dir, storage_options)

    @classmethod
    def find_checkpoints(
        cls,
        dir: str | os.PathLike,
        ephemeral: bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> Iterator[tuple[int, str]]:
        """``(step, path)`` of the finished checkpoints in ``dir``, by ascending step."""
        return discovery.find_checkpoints(dir, ephemeral, storage_options)

    @classmethod
    def contains_checkpoint(
        cls, dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
    ) -> bool:
        """Whether ``dir`` is a checkpoint or directly holds one."""
        return discovery.contains_checkpoint(dir, storage_options)

    @classmethod
    def latest_checkpoint(
        cls, dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
    ) -> str:
        """The newest finished checkpoint in ``dir``; ``FileNotFoundError`` when there is none."""
        return discovery.latest_checkpoint(dir, storage_options)


__all__ = ["Checkpointer"]
