"""The bookkeeping of an :class:`~tierpoint.asyncsave.AsyncCallsQueue`'s calls, from scheduling to
conclusion.

Call order (driven by the queue): a scheduled request becomes a :class:`Call` in the queue's
:class:`PendingCalls`; :func:`snapshot_and_dispatch` runs its ``preload_fn`` and hands ``async_fn``
to the worker; :meth:`PendingCalls.collect` notes the worker's results (and a dead worker);
:func:`run_background_step` runs the request's ``background_fn`` once the worker is done;
:meth:`PendingCalls.ready_count` tells how many leading calls finished on this rank; once every
rank agreed on a call's outcome, :func:`conclude` runs its finalize functions or raises; a call that
leaves unfinalized is named by :meth:`PendingCalls.drop`.

Invariants:
- A call's ``local`` outcome (``(ok, result or message, error type)``) is set once its worker
  result is known and, with a ``background_fn``, once that step ran; a failed snapshot or step is
  this rank's outcome of the call, agreed like any other.
- Clean-up functions (``abort_fns``) never raise: what they fail to do is logged.
- After a finalize function raised, only tierpoint's own commits (``Commit``) still run, then the
  first error is raised: a user's function never skips a tier's commit nor runs after a failure.
- A call dropped unfinalized is always named in a WARNING on the ``tierpoint`` logger.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    CheckpointingError,
    CoordinationTimeoutError,
    agreed_error,
    error_text,
    failed_on_ranks,
)
from ..staging import SourceFile
from .request import AsyncRequest, run_finalize_fns
from .worker import SHARED, Worker

logger = logging.getLogger("tierpoint")

Outcome = tuple[bool, Any, str | None]
"""``(ok, result or message, error type)``: a call's outcome on one rank."""


@dataclass
class Call:
    """One scheduled request and what this rank knows of it."""

    id: int
    request: AsyncRequest
    scheduled_at: float
    snapshot: threading.Thread | None = None
    dispatched: bool = False
    worker_result: Outcome | None = None
    background: threading.Thread | None = None
    local: Outcome | None = None  # this rank's final outcome
    buffers: set[str] = field(default_factory=set)  # shared memory the call's arguments use
    one_off: set[str] = field(default_factory=set)  # of which source files: no later call uses them

    def set_worker_result(self, result: Outcome) -> None:
        """The worker's outcome; also the call's own when there is no background step."""
        self.worker_result = result
        if self.request.background_fn is None:
            self.local = result

    def status(self) -> tuple[bool, str, str | None]:
        """This rank's outcome as the ranks agree on it: ``(ok, message, error type)``."""
        assert self.local is not None
        ok, payload, kind = self.local
        return ok, "" if ok else str(payload), kind

    def finished_here(self) -> bool:
        """Worker, snapshot and background step all done on this rank."""
        threads = (self.snapshot, self.background)
        return self.local is not None and not any(t is not None and t.is_alive() for t in threads)


class PendingCalls(deque[Call]):
    """A queue's unfinalized calls, oldest first, with the worker's results not yet claimed."""

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count()
        self._results: dict[int, Outcome] = {}  # by call id, not yet claimed

    def new(self, request: AsyncRequest) -> Call:
        """A new call of ``request``, appended."""
        call = Call(next(self._ids), request, time.monotonic())
        self.append(call)
        return call

    def buffers_in_use(self) -> set[str]:
        """The staging buffers any pending call's arguments use."""
        return set().union(*(c.buffers for c in list(self)))

    def collect(self, worker: Worker, wait: float) -> None:
        """Note the results ``worker`` has (waiting up to ``wait`` seconds for the first), by call
        id; if the worker exited, every dispatched call still without a result failed. Call under
        the queue's pump lock."""
        for call_id, ok, payload, kind in worker.results(wait):
            self._results[call_id] = (ok, payload, kind)
        calls = list(self)  # a snapshot: the training thread may pop meanwhile
        for call in calls:
            if call.worker_result is None and call.id in self._results:
                call.set_worker_result(self._results.pop(call.id))
        if worker.exitcode is not None:
            for call in calls:
                if call.worker_result is None and call.dispatched:
                    died = f"background worker process died (exit code {worker.exitcode})"
                    call.set_worker_result((False, died, None))

    def ready_count(self) -> int:
        """How many leading calls finished on this rank (worker, snapshot and background step)."""
        count = 0
        for call in self:
            if not call.finished_here():
                break
            count += 1
        return count

    def wait_for_snapshots(self, deadline: float) -> None:
        """Block until every pending call's snapshot thread ended, except those of requests holding
        their own copy of the state (``state_copied``); raise past ``deadline``."""
        for call in list(self):
            if call.snapshot is not None and not call.request.state_copied:
                call.snapshot.join(max(0.0, deadline - time.monotonic()))
                if call.snapshot.is_alive():
                    raise CoordinationTimeoutError(
                        f"{call.request.description}: snapshot did not finish in time"
                    )

    def undo_all(self, timeout: float) -> None:
        """Let every pending call's threads end (each waited for at most ``timeout`` seconds), then
        run its ``abort_fns`` (the worker is killed first, by the caller)."""
        for call in self:
            for thread in (call.snapshot, call.background):
                if thread is not None:
                    thread.join(timeout)
            run_all(call.request.abort_fns)

    def drop(self, why: str, hint: bool = True) -> None:
        """Forget the unfinalized calls, naming each in a WARNING: they are lost silently otherwise."""
        while self:
            call = self.popleft()
            logger.warning(
                "%s (call %d) was dropped before it was finalized: %s.%s",
                call.request.description,
                call.id,
                why,
                " To keep an async save, call maybe_finalize_async_calls(blocking=True) or close() "
                "on its AsyncCallsQueue before exiting."
                if hint
                else "",
            )


def snapshot_and_dispatch(
    call: Call, worker: Worker | None, pending: PendingCalls
) -> BaseException | None:
    """Run the request's ``preload_fn`` (the snapshot) and hand ``async_fn`` to ``worker``. A
    failure becomes this rank's outcome of the call (raised on every rank at finalize); an
    interrupt (a Ctrl-C's ``KeyboardInterrupt``, a signal handler's ``SystemExit``) does too, and
    is returned for the caller to raise once the call's bookkeeping is done: the user stopped the
    process, the snapshot must not swallow that."""
    request = call.request
    try:
        kwargs = dict(request.async_fn_kwargs or {})
        if request.preload_fn is not None:
            kwargs.update(request.preload_fn() or {})
        if request.async_fn is None:
            call.set_worker_result((True, None, None))
        else:
            assert worker is not None
            args = tuple(request.async_fn_args)
            shared = [v for v in (*args, *kwargs.values()) if isinstance(v, SHARED)]
            call.buffers = {v.id for v in shared}
            call.one_off = {v.id for v in shared if isinstance(v, SourceFile)}
            # Staging buffers no pending call uses any more (a layout changed) leave the worker.
            worker.drop_buffers(pending.buffers_in_use())
            worker.submit(call.id, request.async_fn, args, kwargs)
        call.dispatched = True
    except BaseException as e:  # noqa: BLE001 - becomes this rank's outcome for the call
        logger.warning(  # raised on every rank at finalize; the traceback goes to DEBUG
            "%s: snapshot failed (every rank raises it when finalizing): %s",
            request.description,
            error_text(e),
        )
        logger.debug("%s: snapshot failure", request.description, exc_info=True)
        call.set_worker_result((False, f"snapshot failed: {error_text(e)}", type(e).__name__))
        if not isinstance(e, Exception):
            return e
    return None


def start_thread(target: Callable[[Call], None], call: Call) -> threading.Thread:
    """``target(call)`` on a daemon thread, started."""
    thread = threading.Thread(target=target, args=(call,), daemon=True)
    thread.start()
    return thread


def warn_stuck(call: Call, timeout: float) -> None:
    """Say that the worker did not finish ``call`` in time and is killed (the caller kills it)."""
    logger.warning(
        "%s: the background worker did not finish within %g s: killing it (a new one starts with "
        "the next save)",
        call.request.description,
        timeout,
    )


def run_background_step(call: Call, worker: Outcome | None) -> None:
    """Run the request's ``background_fn`` with the worker's outcome (``None``: it did not finish
    in time); its failure, or the worker's, becomes the call's outcome on this rank."""
    worker = worker or (False, "the background worker did not finish in time", None)
    try:
        assert call.request.background_fn is not None
        call.request.background_fn(worker[0])
        outcome = worker
    except BaseException as e:  # noqa: BLE001 - becomes this rank's outcome for the call
        logger.debug("%s: background step failed: %s", call.request.description, e)
        outcome = worker if not worker[0] else (False, error_text(e), type(e).__name__)
    call.local = outcome


def conclude(call: Call, statuses: dict[int, tuple[bool, str, str | None]]) -> None:
    """Every rank's outcome of ``call`` is known (agreed): run its finalize functions (after one
    raised, only the :class:`~tierpoint.asyncsave.request.Commit` ones, then raise the first
    error), or, if any rank failed, its ``abort_fns`` and raise the agreed error."""
    failures = {rank: msg for rank, (ok, msg, _) in statuses.items() if not ok}
    request = call.request
    if failures:
        kinds = {statuses[r][2] for r in failures}
        error = agreed_error(
            kinds.pop() if len(kinds) == 1 and None not in kinds else "",
            failed_on_ranks(request.description, failures),
            failures,
        )
        request.failure = error_text(error)
        run_all(request.abort_fns)
        raise error
    try:
        run_finalize_fns(request.finalize_fns, request.description)
    except Exception as e:
        request.failure = error_text(e)  # (its handles can tell a failed commit from a pending one)
        raise
    logger.debug(
        "%s finalized %.3f s after scheduling",
        request.description,
        time.monotonic() - call.scheduled_at,
    )


def run_all(fns: Iterable[Any]) -> None:
    """Run clean-up functions; what they raise is logged, never raised."""
    for fn in fns:
        try:
            fn()
        except CheckpointingError as e:  # names what it could not remove; no traceback needed
            logger.warning("clean-up after a failed checkpoint call: %s", e)
        except Exception:  # noqa: BLE001 - clean-up must not hide the original failure
            logger.exception("clean-up after a failed checkpoint call raised")
