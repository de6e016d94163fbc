"""The process's live queues: naming their pending calls at exit, and aborting them all at once
(NVRx's :func:`abort_nvrx_checkpoint`).

Call order: every :class:`~tierpoint.asyncsave.AsyncCallsQueue` registers itself when constructed
(:func:`register`); :func:`abort_nvrx_checkpoint` may be called on every rank at any time; at
process exit the calls still pending are named.

Invariants: the registry holds the queues weakly (a garbage-collected queue leaves it); a call
still pending at exit is named in a WARNING while logging still works (the worker dies with the
process, so the call is lost). A queue belongs to the process that made it: in a process forked
from that one, its copy takes no calls (:func:`refuse_if_forked`), finalizes, aborts and stops
nothing, and names nothing at exit (:func:`owned`), since its worker, its pending calls (their
files) and its gloo group are the parent's.
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Any

from ..errors import CheckpointingError

_live_queues: weakref.WeakSet[Any] = weakref.WeakSet()
"""Every queue not yet garbage-collected, to name the calls still pending at exit."""


def register(queue: Any) -> None:
    """Count ``queue`` among the live ones (it has ``abort(why)`` and ``_drop_pending(why)``)."""
    _live_queues.add(queue)


def owned(queue: Any) -> bool:
    """Whether ``queue`` was made in this process (not inherited by a fork); its ``_pid`` says."""
    return getattr(queue, "_pid", None) == os.getpid()


def refuse_if_forked(queue: Any) -> None:
    """Raise :class:`CheckpointingError` when ``queue`` was made in another process (this one was
    forked from it): using it would stop or feed the parent's worker, take the results of the
    parent's calls, run their ``abort_fns`` here (removing the files of its saves in flight) and
    join collectives on the parent's gloo group."""
    if not owned(queue):
        raise CheckpointingError(
            f"this AsyncCallsQueue was made in process {getattr(queue, '_pid', '?')}, and process "
            f"{os.getpid()} was forked from it: its worker, pending calls and group belong to the "
            "parent. Make a new AsyncCallsQueue in this process"
        )


def abort_nvrx_checkpoint() -> None:
    """Abort the async checkpoints in flight in this process (NVRx's name): every live queue
    kills its worker and undoes its pending calls (:meth:`AsyncCallsQueue.abort`); the queues stay
    usable and start a new worker with their next call. Call it on every rank."""
    for queue in list(_live_queues):
        if owned(queue):  # (a forked process's copies of its parent's queues are not its own)
            queue.abort("aborted by abort_nvrx_checkpoint()")


@atexit.register
def _drop_pending_at_exit() -> None:
    # The worker dies with this process, so whatever is pending now is lost: say so while logging
    # still works (a queue's __del__ may run too late at shutdown, or never).
    for queue in list(_live_queues):
        if owned(queue):  # a forked process exiting loses nothing: the parent's calls go on
            queue._drop_pending("the process exited")
