"""TorchAsyncCheckpoint: ``torch.save`` in the background worker, with NVRx's names.

Call order (as with NVRx)::

    ckpt = TorchAsyncCheckpoint()
    ckpt.async_save(state_dict, "ckpt.pt")        # snapshot, then the worker runs torch.save
    ...
    ckpt.finalize_async_save(blocking=False)      # each step; blocking=True before exiting
    ckpt.finalize_async_save(blocking=True, terminate=True)

The snapshot is taken before ``async_save`` returns: the state's tensors (CPU or CUDA) are copied
into a staging buffer reused from save to save (:mod:`tierpoint.staging`); what is not a tensor
travels as the skeleton of :func:`tierpoint.tree.flatten`, objects it cannot express pickled (this
is the caller's own data in memory, never read from a file). The worker rebuilds the state on the
staging memory and calls ``torch.save(state, *args, **kwargs)``, so the file is an ordinary
``torch.save`` file (``torch.load`` reads it). It is written under the name plus ``.dirty``, then
renamed: a save that fails or is killed midway (the worker dies with its trainer) leaves the file a
previous save wrote at that path intact (NVRx's ``torch.save`` in place truncated it). A second
save waits for the first (at most one in flight), so the buffer is never overwritten while the
worker reads it. ``finalize_async_save(terminate=True)`` closes the queue; a save after it starts
a new one (and its worker), as with NVRx.

As with NVRx, ``finalize_async_save``'s ``no_dist=True`` (the default) checks this rank's worker
alone: then no call here is collective, and a rank may save files the others do not (rank 0 alone,
say). The wait for the previous save before the next follows the ``no_dist`` of the last
``finalize_async_save`` (the queue's collective back-pressure when it was ``False``, or when the
queue was given as ``queue=``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from .. import files
from ..fileformat import DTYPES, PartPlan, plan_part
from ..staging import Stager
from ..tree import flatten, unflatten
from .queue import AsyncCallsQueue
from .request import AsyncRequest
from .worker import BufferRef, resolve_buffer

logger = logging.getLogger("tierpoint")


class TorchAsyncCheckpoint:
    """Asynchronous ``torch.save`` (NVRx's class of the same name; see the module docstring).

    Args:
        persistent_queue: accepted for NVRx compatibility: tierpoint's worker is always persistent.
        queue: the :class:`AsyncCallsQueue` to use (default: a new one); its ``max_in_flight``
            must be 1 (the staging buffer is reused once the previous save is finalized).
    """

    def __init__(
        self, persistent_queue: bool = False, *, queue: AsyncCallsQueue | None = None
    ) -> None:
        if not isinstance(persistent_queue, bool):
            raise TypeError(f"persistent_queue must be a bool, got {persistent_queue!r}")
        self.save = torch.save
        if queue is not None and queue.max_in_flight != 1:
            raise ValueError(
                "TorchAsyncCheckpoint reuses one staging buffer from save to save: give it a queue "
                f"with max_in_flight=1, not {queue.max_in_flight}"
            )
        self._own_queue = queue is None
        self._async_calls_queue = queue if queue is not None else AsyncCallsQueue()
        self._stager = Stager()
        self._no_dist = True  # that of the last finalize_async_save (NVRx's default before one)

    def async_save(self, state_dict: Any, *args: Any, **kwargs: Any) -> int:
        """``torch.save(state_dict, *args, **kwargs)`` in the background; returns the call id.
        The file argument must be a path (a file object cannot travel to the worker)."""
        target = args[0] if args else kwargs.get("f")
        if not isinstance(target, (str, os.PathLike)):
            raise TypeError(
                "TorchAsyncCheckpoint.async_save needs a file path (str or os.PathLike) to save to, "
                f"got {type(target).__name__}: the background worker opens the file itself"
            )
        final = os.path.realpath(target)  # through a link, as torch.save writes
        args, kwargs = ((final, *args[1:]), kwargs) if args else ((), {**kwargs, "f": final})
        flat = flatten(state_dict, allow_pickle=True)
        plan = plan_part(flat)
        stager = self._stager
        if self._own_queue and self._async_calls_queue.closed:
            # finalize_async_save(terminate=True) closed it; NVRx's next save starts a new worker.
            self._async_calls_queue = AsyncCallsQueue()
        queue = self._async_calls_queue
        if self._own_queue and self._no_dist and queue.get_num_unfinalized_calls():
            # The staging buffer is this rank's: wait for this rank's worker alone, as the caller's
            # no_dist finalizing does (the queue's own back-pressure would be collective).
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

        def snapshot() -> dict[str, Any]:
            # Runs inside schedule_async_request, after the previous save was finalized.
            return {"_staged": stager.stage(flat, plan)} if plan.data_size else {}

        request = AsyncRequest(
            torch_save_staged,
            (plan, *args),
            [],
            dict(kwargs),
            preload_fn=snapshot,
            abort_fns=[functools.partial(files.unlink_quietly, files.dirty_name(final))],
            description=f"async torch.save to {os.fspath(target)}",
        )
        return queue.schedule_async_request(request)

    async_torch_save = async_save
    """Another name for :meth:`async_save` (NVRx's method is ``async_save``)."""

    def finalize_async_save(
        self, blocking: bool = False, no_dist: bool = True, terminate: bool = False
    ) -> list[int]:
        """Finalize the saves that finished (all of them, waiting, with ``blocking``); with
        ``terminate``, close the queue afterwards (waiting for this rank's saves first when
        ``no_dist``), which stops the worker and frees the staging buffer: a later
        :meth:`async_save` starts a new queue, as NVRx's does (not when the queue was given as
        ``queue=``: a closed queue takes no more calls). Returns the finalized call ids.

        ``no_dist=True`` (NVRx's default): this rank's saves alone, no collective; ``False``: every
        rank calls it at the same point and the saves are finalized when every rank finished."""
        self._no_dist = bool(no_dist)
        queue = self._async_calls_queue
        done = queue.maybe_finalize_async_calls(blocking, no_dist=no_dist)
        if terminate:
            try:
                if no_dist:  # close() would finalize what is left with a collective round
                    done += queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
            finally:  # (closed also when that raised)
                queue.close()
                self._stager.close()
        return done


def torch_save_staged(
    part_plan: PartPlan, *args: Any, _staged: BufferRef | None = None, **kwargs: Any
) -> None:
    """Worker side: rebuild the state on the staging memory and ``torch.save`` it, under a dirty
    name first (see the module docstring)."""
    data = resolve_buffer(_staged) if _staged is not None else memoryview(b"")
    tensors = []
    for (begin, end), dtype_name, shape in zip(
        part_plan.offsets, part_plan.dtypes, part_plan.shapes
    ):
        dtype = DTYPES[dtype_name]
        # One storage per tensor (torch.save refuses one storage seen as several dtypes, and would
        # write all of it for each view), each on its bytes of the shared memory: nothing copied.
        tensors.append(
            torch.frombuffer(data[begin:end], dtype=dtype).view(shape)
            if end > begin
            else torch.empty(shape, dtype=dtype)
        )
    state = unflatten(part_plan.skeleton, tensors, allow_pickle=True)
    final, args = (args[0], args[1:]) if args else (kwargs.pop("f"), ())
    files.write_whole(final, lambda dirty: torch.save(state, dirty, *args, **kwargs))
