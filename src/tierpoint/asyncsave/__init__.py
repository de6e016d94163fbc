"""Asynchronous saving: the training thread pays only for the snapshot.

Public names (NVRx's): :class:`AsyncRequest`, :class:`AsyncCallsQueue`, :class:`TorchAsyncCheckpoint`
(``torch.save`` in the background) and :func:`abort_nvrx_checkpoint`. Typical use::

    queue = AsyncCallsQueue()
    request = manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
    queue.schedule_async_request(request)
    ...
    queue.maybe_finalize_async_calls(blocking=False)   # once per training step

Invariants: the async layer runs calls; it knows no tier and no checkpoint file format (a tier's
work for the worker lives in that tier's ``jobs`` module). Modules: :mod:`~.queue` (scheduling and
finalizing), :mod:`~.calls` (the calls' bookkeeping), :mod:`~.agreement` (the finalize rounds'
collectives), :mod:`~.deadlines` (the waits' deadlines), :mod:`~.queue_options` (the queue's
arguments, NVRx's included), :mod:`~.live_queues` (exit, :func:`abort_nvrx_checkpoint`),
:mod:`~.worker` (the process), :mod:`~.request`, :mod:`~.torch_ckpt` (``torch.save`` in the
background).
"""

from .queue import AsyncCallsQueue, abort_nvrx_checkpoint
from .request import AsyncRequest
from .torch_ckpt import TorchAsyncCheckpoint

__all__ = ["AsyncCallsQueue", "AsyncRequest", "TorchAsyncCheckpoint", "abort_nvrx_checkpoint"]
