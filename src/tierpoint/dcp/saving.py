"""The one-call entry points: ``save`` (synchronous) and ``async_save`` (the trainer pays only for
the snapshot).

Call order (every rank)::

    tierpoint.dcp.save(state_dict, step_path(base, step))          # returns when committed
    tierpoint.dcp.save(state_dict, checkpoint_id=step_path(base, step))  # torch DCP's keyword

    future = tierpoint.dcp.async_save(state_dict, step_path(base, step), queue=queue)
    ...                                    # train; state may change as soon as async_save returns
    queue.maybe_finalize_async_calls()     # each step (or future.result() to wait)

``async_save`` plans (cached: no planning collectives while the layout is unchanged), copies the
state into a staging buffer reused across saves, and schedules an :class:`~tierpoint.asyncsave.
AsyncRequest` on ``queue`` (an :class:`~tierpoint.asyncsave.AsyncCallsQueue`; by default one owned by
this module). The files are written by the queue's persistent worker process; ``.metadata`` is
written and markers removed by the finalize step, once every rank's write succeeded. NVRx-style
callers who schedule requests themselves use :func:`async_save_request`.

As in torch DCP, a top-level value that is ``Stateful`` (has ``state_dict`` and ``load_state_dict``:
a module, a torchtitan-style ``ModelWrapper``) is saved as what its ``state_dict()`` returns, called
when the save is planned (:func:`tierpoint.dcp.load` hands the loaded values to its
``load_state_dict``).

The three entry points take the same keywords, declared once in :mod:`tierpoint.dcp.options`
(each call gathers them into one ``SaveOptions``); every save starts in ``_plan``, which builds the
:class:`~tierpoint.dcp.writer.Writer` and plans.

Invariants: those of :mod:`tierpoint.dcp.state_dict_saver` and :mod:`tierpoint.dcp.writer`;
finalization (and so :meth:`SaveFuture.result`) is collective: every rank calls it at the same point.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from .. import dist as tpdist
from ..asyncsave import AsyncCallsQueue, AsyncRequest
from ..asyncsave.request import Commit
from ..errors import CheckpointingError
from .options import SaveOptions, takes_save_options
from .state_dict_saver import save_state_dict_async_finalize, save_state_dict_async_plan
from .step_dirs import checkpoint_id_or_path
from .writer import Writer


@takes_save_options(without=("staging_pool", "source_file"))
def save(
    state_dict: dict[str, Any],
    path_or_url: str | os.PathLike | None = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    options: SaveOptions,
) -> Metadata | None:
    """Save ``state_dict`` as a torch DCP checkpoint at ``path_or_url``; returns when it is committed.

    Collective: every rank of ``process_group`` (default: all ranks) calls it. Returns the metadata
    written (on the coordinator; ``None`` elsewhere). Raises the same
    :class:`~tierpoint.errors.CheckpointingError` on every rank if any rank failed. A directory that
    holds a committed checkpoint is refused unless ``overwrite=True`` (which un-commits it first: a
    crash during the new save then leaves no checkpoint there; the refusal says "Checkpoint already
    exists", as torch's does). ``checkpoint_id=`` is torch's name for ``path_or_url``.

    The keywords after ``checkpoint_id`` (:class:`~tierpoint.dcp.options.SaveOptions`):
    ``process_group``, ``thread_count`` (writer threads per rank), ``storage_options`` (fsspec's,
    for URLs), ``planner``, ``coordinator_rank``, ``enable_cache`` and ``metadata_cache`` (cached
    planning), ``sync_files``, ``upload`` (multipart upload settings), ``overwrite``.
    """
    path = checkpoint_id_or_path(path_or_url, checkpoint_id, "save")
    writer, metadata, dist_wrapper = _plan(state_dict, path, options)
    writer.write_now()
    save_state_dict_async_finalize(writer, metadata, dist_wrapper)
    return metadata


@takes_save_options()
def async_save_request(
    state_dict: dict[str, Any],
    path_or_url: str | os.PathLike | None = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    options: SaveOptions,
) -> AsyncRequest:
    """Plan an async save now and return the request to schedule (NVRx style)::

        queue.schedule_async_request(async_save_request(state_dict, path))

    The snapshot happens when the request is scheduled (its ``preload_fn``); the state must not
    change until then. The keywords are :func:`save`'s, ``staging_pool`` (where snapshots go) and
    ``source_file``: a :class:`~tierpoint.staging.SourceFile` whose pages the state's tensors view
    and whose bytes the caller keeps unchanged until the save is finalized or aborted (then the
    snapshot copies nothing: the worker writes the tensors' bytes from the file).
    """
    path = checkpoint_id_or_path(path_or_url, checkpoint_id, "async_save_request")
    return _request(state_dict, path, options)


def _plan(state_dict: dict[str, Any], path: Any, options: SaveOptions) -> tuple[Writer, Any, Any]:
    """The writer for ``path`` and the collective plan of ``state_dict`` (every save's start)."""
    writer = Writer(
        path,
        thread_count=options.thread_count,
        storage_options=options.storage_options,
        staging_pool=options.staging_pool,
        sync_files=options.sync_files,
        upload=options.upload,
        overwrite=options.overwrite,
        source_file=options.source_file,
    )
    return save_state_dict_async_plan(
        stateful_to_state_dict(state_dict),
        writer,
        options.process_group,
        options.coordinator_rank,
        options.planner,
        options.enable_cache,
        options.metadata_cache,
    )


def _request(state_dict: dict[str, Any], path: Any, options: SaveOptions) -> AsyncRequest:
    """Plan now; the request writes (its worker), then finalizes or aborts the save."""
    planned = _plan(state_dict, path, options)
    writer = planned[0]
    async_fn, preload_fn, args = writer.get_save_function_and_args()

    def finalize() -> None:
        save_state_dict_async_finalize(*planned)  # releases the staging buffer too

    def abort() -> None:
        writer.release_staging()
        writer.discard()

    return AsyncRequest(
        async_fn,
        args,
        [Commit(finalize)],
        preload_fn=preload_fn,
        abort_fns=[abort],
        description=f"DCP save to {writer.path}",
    )


class SaveFuture:
    """Handle on a scheduled async save (like the future torch's ``dcp.async_save`` returns).

    ``done()`` finalizes whatever finished on every rank, without blocking; ``result(timeout)``
    waits until this save is committed and raises its :class:`~tierpoint.errors.CheckpointingError`
    if it failed. Both are collective (every rank calls them at the same point).
    """

    def __init__(self, queue: AsyncCallsQueue, request: AsyncRequest, path: str) -> None:
        self.queue = queue
        self.path = path
        self.call_id: int | None = None
        self._state = "pending"
        self._request = request  # (its failure: a commit that raised runs no function after it)
        request.add_finalize_fn(self._committed)
        request.abort_fns = [*request.abort_fns, self._failed]

    def _committed(self) -> None:
        self._state = "committed"

    def _failed(self) -> None:
        self._state = "failed"

    def done(self) -> bool:
        if self._state == "pending" and not self._request.failure:
            self.queue.maybe_finalize_async_calls(blocking=False)
        return self._state != "pending" or bool(self._request.failure)

    def result(self, timeout: float | None = None) -> str:
        """Wait until committed; returns the checkpoint path. After ``timeout`` seconds every rank
        raises :class:`~tierpoint.errors.CoordinationTimeoutError` (the save stays pending)."""
        wait = None if timeout is None else tpdist.check_timeout(timeout)
        if self._state == "pending" and self.call_id is not None and not self._request.failure:
            self.queue.finalize_through(self.call_id, wait)
        failure = self._request.failure
        if self._state == "committed":
            return self.path
        if self._state == "pending" and not failure:
            raise CheckpointingError(f"the save to {self.path} was dropped before it was finalized")
        raise CheckpointingError(
            f"the save to {self.path} failed" + (f": {failure}" if failure else "")
        )


_default_queue: AsyncCallsQueue | None = None
_queue_lock = threading.Lock()


def default_queue() -> AsyncCallsQueue:
    """The queue :func:`async_save` uses when given none (created on first use, and again after
    it was closed)."""
    global _default_queue
    with _queue_lock:
        if _default_queue is None or _default_queue.closed:
            if _default_queue is None:
                atexit.register(_close_default_queue)
            _default_queue = AsyncCallsQueue()
        return _default_queue


def _close_default_queue() -> None:
    global _default_queue
    if _default_queue is not None:
        try:  # its users hold futures, not the queue: the warning names what keeps a save
            _default_queue.abort(
                "the process was exiting (to keep an async save, call .result() on the future "
                "async_save or Checkpointer.save_async returned before the process ends)"
            )
            _default_queue.close()
        finally:
            _default_queue = None


@takes_save_options()
def async_save(
    state_dict: dict[str, Any],
    path_or_url: str | os.PathLike | None = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    queue: AsyncCallsQueue | None = None,
    options: SaveOptions,
) -> SaveFuture:
    """Save asynchronously: plan, snapshot into staging memory, hand the writing to ``queue``'s
    worker; returns a :class:`SaveFuture` once the snapshot is taken (unless the queue overlaps
    snapshots, see :class:`~tierpoint.asyncsave.AsyncCallsQueue`).

    Collective, like :func:`save`. With the default queue, call ``result()`` on the future (or
    ``default_queue().close()``) before the process group is destroyed: at exit the default queue
    is aborted, and a save not yet finalized is discarded. The other keywords are
    :func:`async_save_request`'s.
    """
    path_or_url = checkpoint_id_or_path(path_or_url, checkpoint_id, "async_save")
    if queue is not None and not isinstance(queue, AsyncCallsQueue):
        raise CheckpointingError(
            f"queue must be an AsyncCallsQueue or None, got {type(queue).__name__}"
        )
    request = _request(state_dict, path_or_url, options)
    q = queue if queue is not None else default_queue()
    future = SaveFuture(q, request, os.fspath(path_or_url))
    future.call_id = q.schedule_async_request(request)
    return future


def stateful_to_state_dict(state_dict: Any) -> Any:
    """A shallow copy of ``state_dict`` with each ``Stateful`` value replaced by its
    ``state_dict()`` (anything but a dict is returned as it is, for the planner to refuse)."""
    if not isinstance(state_dict, dict):
        return state_dict
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


__all__ = [
    "SaveFuture",
    "async_save",
    "async_save_request",
    "default_queue",
    "save",
    "stateful_to_state_dict",
]
