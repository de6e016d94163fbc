"""Asynchronous saving: the training thread pays only for the snapshot.

Public names: :class:`AsyncRequest` and :class:`AsyncCallsQueue` (NVRx-compatible). Typical use::

    queue = AsyncCallsQueue()
    request = manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
    queue.schedule_async_request(request)
    ...
    queue.maybe_finalize_async_calls(blocking=False)   # once per training step
"""

from .queue import AsyncCallsQueue
from .request import AsyncRequest

__all__ = ["AsyncCallsQueue", "AsyncRequest"]
