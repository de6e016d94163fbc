"""The process's live queues: naming their pending calls at exit, and aborting them all at once
(NVRx's :func:`abort_nvrx_checkpoint`).

Call order: every :class:`~tierpoint.asyncsave.AsyncCallsQueue` registers itself when constructed
(:func:`register`); :func:`abort_nvrx_checkpoint` may be called on every rank at any time; at
process exit the calls still pending are named.

Invariants: the registry holds the queues weakly (a garbage-collected queue leaves it); a call
still pending at exit is named in a WARNING while logging still works (the worker dies with the
process, so the call is lost).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

_live_queues: weakref.WeakSet[Any] = weakref.WeakSet()
"""Every queue not yet garbage-collected, to name the calls still pending at exit."""


def register(queue: Any) -> None:
    """Count ``queue`` among the live ones (it has ``abort(why)`` and ``_drop_pending(why)``)."""
    _live_queues.add(queue)


def abort_nvrx_checkpoint() -> None:
    """Abort the async checkpoints in flight in this process (NVRx's name): every live queue
    kills its worker and undoes its pending calls (:meth:`AsyncCallsQueue.abort`); the queues stay
    usable and start a new worker with their next call. Call it on every rank."""
    for queue in list(_live_queues):
        queue.abort("aborted by abort_nvrx_checkpoint()")


@atexit.register
def _drop_pending_at_exit() -> None:
    # The worker dies with this process, so whatever is pending now is lost: say so while logging
    # still works (a queue's __del__ may run too late at shutdown, or never).
    for queue in list(_live_queues):
        queue._drop_pending("the process exited")
