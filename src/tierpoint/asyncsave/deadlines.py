"""The deadlines of an :class:`~tierpoint.asyncsave.AsyncCallsQueue`'s blocking waits.

Call order: a blocking wait notes its start, then asks :func:`deadline` each time it checks
(the worker may become ready meanwhile), and a finalize round says how late it is with
:func:`lateness` (the ranks agree on the largest, see :mod:`tierpoint.asyncsave.agreement`).

Invariants: time a worker spends starting (importing torch) does not count against a wait's
``timeout``; the start itself is bounded by ``max(timeout, WORKER_START_TIMEOUT)``. A wait on a
dead or missing worker ends ``timeout`` seconds after it began.
"""

from __future__ import annotations

from .agreement import NOT_LATE, TIMED_OUT, WAIT_OVER
from .worker import Worker

WORKER_START_TIMEOUT = 120.0
"""Seconds a worker process may take to start (import torch) on a loaded machine."""


def deadline(worker: Worker | None, start: float, timeout: float) -> float:
    """When a wait that began at ``start`` times out: ``timeout`` seconds after ``start`` or after
    ``worker`` became ready, whichever is later (its start-up is bounded on its own)."""
    if worker is None or worker.exitcode is not None:
        return start + timeout
    if worker.ready_at is None:
        return start + max(timeout, WORKER_START_TIMEOUT)
    return max(start, worker.ready_at) + timeout


def lateness(blocking: bool, now: float, deadline: float, wait_until: float | None) -> int:
    """How late a finalize round is on this rank: ``TIMED_OUT`` past the queue's ``deadline``,
    ``WAIT_OVER`` past the caller's own limit (``wait_until``), else ``NOT_LATE`` (always when not
    ``blocking``)."""
    if blocking and now > deadline:
        return TIMED_OUT
    if blocking and wait_until is not None and now > wait_until:
        return WAIT_OVER
    return NOT_LATE
