"""AsyncCallsQueue: schedules AsyncRequests on a persistent worker and finalizes them when every rank is done.

Call order (every rank at the same points, as with NVRx)::

    queue = AsyncCallsQueue()
    queue.schedule_async_request(manager.save(state, it, is_async=True))   # snapshot, then dispatch
    ...
    queue.maybe_finalize_async_calls(blocking=False)   # each step: free when nothing is pending
    ...
    queue.close()

Invariants:
- Back-pressure: at most ``max_in_flight`` (default 1) unfinalized calls; scheduling another first
  finalizes the oldest (blocking, bounded by the timeout) instead of allocating more memory.
- Agreement: while calls are pending, each finalize round (one per non-blocking poll; repeated
  while blocking) agrees on the queue's own gloo group how many leading calls every rank finished;
  the calls finished everywhere are then concluded, each after agreeing on its outcome (the rounds'
  collectives: :mod:`tierpoint.asyncsave.agreement`). Every rank thus concludes the same calls in
  the same round, so finalize functions may run collectives (as NVRx's do). With nothing pending a
  poll runs no collective.
- A failure anywhere makes every rank run the call's ``abort_fns`` and raise the same
  :class:`CheckpointingError`; finalize functions run only when every rank succeeded.
- Every blocking wait has a deadline (``timeout``, default ``TIERPOINT_TIMEOUT``); whether it has
  passed is agreed in the same round, so every rank times out together: the workers are killed (one
  is stuck), every pending call is undone on every rank (``abort_fns``) and the queue goes on with a
  new worker (a worker's start-up is bounded on its own, :mod:`~tierpoint.asyncsave.deadlines`). If
  a round itself fails (a peer is gone), the queue drops its calls without undoing them (a rank may
  have concluded them) and refuses more.
- A dead worker is detected by its exit status and replaced at the next schedule. Misuse is
  refused before anything changes (``TypeError`` / ``ValueError`` naming the argument;
  :class:`CheckpointingError` for a request already scheduled).
- A call dropped before it was finalized (``close(abort=True)``, a failing ``close()``, the queue
  garbage-collected, or the process exiting) is named in a WARNING on the ``tierpoint`` logger; the
  warning changes nothing on disk (an aborted save leaves the previous checkpoint intact).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from .. import dist as tpdist
from ..errors import CheckpointingError, CoordinationTimeoutError, ends_cleanly
from . import agreement
from .calls import (
    Call,
    PendingCalls,
    conclude,
    run_all,
    run_background_step,
    snapshot_and_dispatch,
    start_thread,
    warn_stuck,
)
from .deadlines import WORKER_START_TIMEOUT, deadline, lateness
from .live_queues import abort_nvrx_checkpoint, owned, refuse_if_forked, register
from .queue_options import checked_arguments
from .request import AsyncRequest
from .worker import Worker

logger = logging.getLogger("tierpoint")

_GAVE_UP_HINT = (
    "the queue accepts no more calls: its ranks cannot agree any more (a rank is gone or stopped). "
    "Restart the job; it resumes from the last complete checkpoint"
)


class AsyncCallsQueue:
    """Runs checkpoint work in a persistent background process per rank; see the module docstring.

    Args:
        persistent, is_daemon, cpu_shm_mode: accepted for NVRx compatibility, no effect (see
            :mod:`~tierpoint.asyncsave.queue_options`).
        cpu_priority: the worker's nice value, 0-19 (None: ``TIERPOINT_WORKER_NICE`` or 19; NVRx's
            default is 10). Only raised, never lowered, as with NVRx.
        io_priority: the worker's I/O scheduling class, 0-3 as ``ionice -c`` takes it (3: idle,
            which deprioritizes checkpoint I/O); None leaves it unchanged. Set with ``ionice``
            where installed; a failure is logged by the worker, not fatal (as with NVRx).
        sigterm_timeout: seconds :meth:`close` waits for the worker to exit before killing it.
        max_in_flight: unfinalized calls allowed before scheduling waits (an int >= 1).
        timeout: seconds any blocking wait may take, finite and > 0 (default: ``TIERPOINT_TIMEOUT``
            or 300); the worker's start-up is not counted.
        overlap_snapshot: copy into staging memory on a background thread, so that
            ``schedule_async_request`` returns at once; call :meth:`wait_for_snapshot` (or install
            :meth:`install_optimizer_hook`) before the state is modified.

    Finalize or :meth:`close` the queue before the process exits (a call still pending then is
    dropped, with a WARNING); a ``with`` block closes it, ``abort=True`` on exceptions but exit(0).
    """

    def __init__(
        self,
        persistent: bool = True,
        is_daemon: bool = True,
        cpu_priority: int | None = None,
        io_priority: int | None = None,
        sigterm_timeout: float = 30.0,
        cpu_shm_mode: bool = False,
        *,
        max_in_flight: int = 1,
        timeout: float | None = None,
        overlap_snapshot: bool = False,
    ) -> None:
        self.cpu_priority, self.io_priority, self.sigterm_timeout, self.max_in_flight = (
            checked_arguments(
                {"persistent": persistent, "is_daemon": is_daemon, "cpu_shm_mode": cpu_shm_mode},
                overlap_snapshot,
                cpu_priority,
                io_priority,
                sigterm_timeout,
                max_in_flight,
            )
        )
        self.persistent, self.is_daemon, self.cpu_shm_mode = persistent, is_daemon, cpu_shm_mode
        self.timeout = tpdist.timeout_or(timeout, tpdist.default_timeout().total_seconds())
        self.overlap_snapshot = overlap_snapshot
        self._worker: Worker | None = self._new_worker()
        self._calls = PendingCalls()
        self._group: Any = None
        self._closed = False
        self._gave_up: str | None = None  # why, once the ranks could not agree any more
        self._pump_lock = threading.Lock()
        self._pid = os.getpid()  # the process it belongs to (:func:`~.live_queues.owned`)
        register(self)

    @classmethod
    def warmup_persistent_caller(cls, rank: int, *args: Any, **kwargs: Any) -> None:
        """NVRx's pre-start of the worker: nothing to do, a queue starts it (:meth:`wait_ready`)."""

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the worker process has started (it imports torch, which takes a few seconds)."""
        if self._worker is not None:
            with self._pump_lock:
                self._worker.wait_ready(tpdist.timeout_or(timeout, self.timeout))

    def preload(self, *modules: str) -> None:
        """Let the worker import ``modules`` (those of the calls to come) while it is idle, so that
        the first save does not wait for the imports."""
        if self._worker is not None:
            self._worker.preload(list(modules))

    # ------------------------------------------------------------------------------ scheduling

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Snapshot (``preload_fn``) and dispatch ``request``; returns its call id.

        A request built by NVRx's own ``AsyncRequest`` class is converted
        (:meth:`AsyncRequest.from_nvrx`). Raises ``TypeError`` for anything else that is not a valid
        :class:`AsyncRequest`, and :class:`CheckpointingError` for a request scheduled before (on
        any queue), all before the queue changes. When the request cannot be taken (a closed or
        given-up queue, one made by the process this one was forked from, or finalizing an earlier
        call to make room raised), its ``abort_fns`` run before the error is raised: a planned save
        releases what it holds. A Ctrl-C (``KeyboardInterrupt``) during the snapshot fails the call
        on this rank (every rank raises that at finalize) and is then raised here, never swallowed.
        """
        if not isinstance(request, AsyncRequest):
            request = AsyncRequest.from_nvrx(request)
        request.validate()
        if request.scheduled:
            raise CheckpointingError(
                f"{request.description}: this AsyncRequest was scheduled already; a request is "
                "scheduled once (create a new one for another save)"
            )
        try:
            self._make_room()
        except BaseException:
            run_all(request.abort_fns)
            raise
        request.scheduled = True
        call = self._calls.new(request)
        if self.overlap_snapshot and request.preload_fn is not None:
            call.snapshot = start_thread(self._preload_and_dispatch, call)
        else:
            # A failed snapshot is this rank's outcome of the call: it is agreed like any other, so
            # every rank raises it at the next finalize instead of this rank alone raising now.
            self._preload_and_dispatch(call)
        return call.id

    def _make_room(self) -> None:
        """Ready to take one more call: open, earlier calls finalized down to ``max_in_flight - 1``
        (collective) and a live worker there."""
        refuse_if_forked(self)
        if self._closed:
            raise CheckpointingError("the AsyncCallsQueue is closed")
        if self._gave_up is not None:
            raise CheckpointingError(
                f"this AsyncCallsQueue gave up ({self._gave_up}); {_GAVE_UP_HINT}"
            )
        if len(self._calls) >= self.max_in_flight:
            self._finalize(
                blocking=True, no_dist=False, limit=len(self._calls) - self.max_in_flight + 1
            )
        if self._worker is None or self._worker.exitcode is not None:
            logger.warning("starting a new background worker (the previous one exited)")
            self._worker = self._new_worker()

    def _new_worker(self) -> Worker:
        return Worker(nice=self.cpu_priority, io_class=self.io_priority)

    def _preload_and_dispatch(self, call: Call) -> None:
        interrupted = snapshot_and_dispatch(call, self._worker, self._calls)
        if call.request.background_fn is not None:
            # Also after a failure: the background step then tells its peers at once.
            call.background = start_thread(self._run_background, call)
        if interrupted is not None:  # a Ctrl-C in the snapshot: the call failed, the user stops
            raise interrupted

    def _deadline(self, start: float) -> float:
        """When a wait that began at ``start`` times out (:func:`~.deadlines.deadline`)."""
        return deadline(self._worker, start, self.timeout)

    def _run_background(self, call: Call) -> None:
        """Wait (bounded) for the worker's result, then run the request's ``background_fn``."""
        start = time.monotonic()
        while call.worker_result is None and time.monotonic() < self._deadline(start):
            self._pump(0.05)
        worker = call.worker_result
        if worker is None and self._worker is not None:
            # Stuck (or stopped): replaced at the next schedule instead of failing every save.
            warn_stuck(call, self.timeout)
            self._worker.kill()
        run_background_step(call, worker)

    def wait_for_snapshot(self, timeout: float | None = None) -> None:
        """Block until every scheduled snapshot copy finished (the state may be modified after)."""
        self._calls.wait_for_snapshots(time.monotonic() + tpdist.timeout_or(timeout, self.timeout))

    def install_optimizer_hook(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for pending snapshots first. Returns the hook handle."""
        return optimizer.register_step_pre_hook(lambda *_: self.wait_for_snapshot())

    # ------------------------------------------------------------------------------ completion

    def get_num_unfinalized_calls(self) -> int:
        """How many scheduled calls are not finalized yet."""
        return len(self._calls)

    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False, finalize_timeout: float | None = None
    ) -> list[int]:
        """Finalize calls that finished on every rank (all of them, waiting, when ``blocking``).

        ``finalize_timeout`` (NVRx's argument): with ``blocking``, raise
        :class:`CoordinationTimeoutError` on every rank after that many seconds, the calls staying
        pending (the queue's own ``timeout`` still bounds every wait)."""
        wait = None if finalize_timeout is None else tpdist.timeout_or(finalize_timeout, 0)
        return self._finalize(blocking=blocking, no_dist=no_dist, limit=None, wait=wait)

    def _finalize(
        self, *, blocking: bool, no_dist: bool, limit: int | None, wait: float | None = None
    ) -> list[int]:
        """Conclude the leading calls that every rank finished. Each round is one agreement
        (:func:`~tierpoint.asyncsave.agreement.agree_progress`), so every rank concludes the same
        calls in the same round and finalize functions may run collectives; rounds repeat while
        ``blocking``.

        ``wait``: seconds the caller waits at most (agreed too); when over, every rank raises
        :class:`CoordinationTimeoutError` and the calls stay pending. Past the queue's own timeout
        the calls are undone instead (:meth:`_time_out`)."""
        refuse_if_forked(self)
        done: list[int] = []
        start = time.monotonic()
        while self._calls and (limit is None or len(done) < limit):
            self._pump(0.0)
            ready = self._calls.ready_count()  # leading calls finished on this rank
            wait_until = None if wait is None else start + wait
            late = lateness(blocking, time.monotonic(), self._deadline(start), wait_until)
            if not no_dist and self._group is None and tpdist.is_distributed():
                self._group = self._agreed(agreement.new_group)
                tpdist.drop_at_exit(self, "_group")
            if not (no_dist or self._group is None):
                ready, late = self._agreed(agreement.agree_progress, self._group, ready, late)
            if ready == 0:
                if late == agreement.TIMED_OUT:
                    raise CoordinationTimeoutError(self._time_out())
                if late == agreement.WAIT_OVER:
                    raise CoordinationTimeoutError(
                        f"{self._calls[0].request.description}: not finished on every rank "
                        f"within {wait:g} s (still pending)"
                    )
                if not blocking:
                    break
                self._pump(0.02)
                continue
            for _ in range(ready if limit is None else min(ready, limit - len(done))):
                call = self._calls.popleft()
                if call.one_off and self._worker is not None:
                    # their mappings would keep a file's pages (a retired part's RAM) alive
                    self._worker.forget(call.one_off)
                conclude(call, self._statuses(call, no_dist))
                done.append(call.id)
        return done

    def finalize_through(self, call_id: int, timeout: float | None = None) -> None:
        """Finalize the pending calls up to and including ``call_id`` (blocking, collective);
        ``timeout``: raise :class:`CoordinationTimeoutError` after that many seconds, on every rank
        in the same round, leaving the calls pending."""
        ids = [c.id for c in self._calls]
        if call_id in ids:
            limit = ids.index(call_id) + 1
            self._finalize(blocking=True, no_dist=False, limit=limit, wait=timeout)

    def _statuses(self, call: Call, no_dist: bool) -> dict[int, agreement.Status]:
        """The outcome of ``call``, which every rank finished (agreed, see
        :func:`~tierpoint.asyncsave.agreement.agree_outcome`). Collective."""
        mine = call.status()
        if no_dist or self._group is None:
            return {tpdist.get_rank(): mine}
        self._calls.appendleft(call)  # dropped (named) with the others if a collective fails
        statuses = self._agreed(
            agreement.agree_outcome, self._group, mine, call.request.description
        )
        self._calls.popleft()
        return statuses

    def _agreed(self, round_fn: Any, *args: Any) -> Any:
        """``round_fn(*args)``, one agreement round; if it fails, the queue gives up."""
        try:
            return round_fn(*args)
        except agreement.RoundFailed as e:
            raise CheckpointingError(self._give_up(str(e))) from e.__cause__

    def _time_out(self) -> str:
        """Every rank agreed that the oldest call is late: kill the workers (one is stuck, others
        may still write the calls' files), undo every pending call everywhere, go on."""
        description = self._calls[0].request.description
        self._abort_pending("undone on every rank after a timeout", hint=False)
        return f"{description}: not finished on every rank within {self.timeout:g} s"

    def _give_up(self, why: str) -> str:
        """The ranks cannot agree any more (a peer is gone, a collective timed out): refuse calls,
        kill the worker, drop the pending calls, not undone (a rank may have concluded them)."""
        self._gave_up = why
        if self._worker is not None:
            self._worker.kill()
        self._drop_pending("the queue's ranks could not agree any more", hint=False)
        return f"{why}; {_GAVE_UP_HINT}"

    def _pump(self, wait: float) -> None:
        """Collect finished calls from the worker; note a dead worker against the oldest pending call."""
        worker = self._worker
        if worker is None:
            return
        with self._pump_lock:
            self._calls.collect(worker, wait)

    # ------------------------------------------------------------------------------ shutdown

    def close(self, abort: bool = False) -> None:
        """Finalize everything (or, with ``abort=True``, kill the worker and undo pending calls).

        Calls dropped unfinalized (all pending ones with ``abort=True``; those still pending when
        finalizing raises) are named in a WARNING. A close interrupted while it waits (a Ctrl-C)
        kills the worker at once. The queue's gloo group is freed (local: a rank still in a
        collective on it times out).
        """
        if self._closed or not owned(self):  # (a forked copy: nothing in it is its own)
            return
        interrupted = False
        try:
            if abort:
                self._abort_pending("the queue was closed with abort=True")
            else:
                self.maybe_finalize_async_calls(blocking=True)
        except BaseException as e:
            interrupted = not isinstance(e, Exception)
            raise
        finally:
            self._closed = True
            self._drop_pending("close() raised before finalizing it")
            if self._worker is not None:
                self._worker.kill() if interrupted else self._worker.stop(self.sigterm_timeout)
                self._worker = None
            tpdist.destroy_group(self._group)
            self._group = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: a closed queue takes no more calls."""
        return self._closed

    def abort(self, why: str = "aborted") -> None:
        """Kill the worker, undo this rank's pending calls (``abort_fns``), not waiting for other
        ranks; the queue goes on. For fault handling, on every rank (:func:`abort_nvrx_checkpoint`)."""
        if not self._closed and owned(self):
            self._abort_pending(why, hint=False)

    def _abort_pending(self, why: str, hint: bool = True) -> None:
        """Kill the worker, let the calls' threads end, run their ``abort_fns``, drop them."""
        if self._worker is not None:
            self._worker.kill()
        self._calls.undo_all(self.timeout)
        self._drop_pending(why, hint)

    def _drop_pending(self, why: str, hint: bool = True) -> None:
        """Forget the unfinalized calls, naming each in a WARNING: they are lost silently otherwise."""
        self._calls.drop(why, hint)

    def __enter__(self) -> AsyncCallsQueue:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        self.close(abort=not ends_cleanly(error))

    def __del__(self) -> None:  # (a forked process's copy: nothing in it is its own)
        if getattr(self, "_calls", None) and owned(self):
            self._drop_pending("its AsyncCallsQueue was garbage-collected without close()")
        worker = getattr(self, "_worker", None) if owned(self) else None
        if worker is not None and worker.exitcode is None:
            worker.kill()


__all__ = ["WORKER_START_TIMEOUT", "AsyncCallsQueue", "abort_nvrx_checkpoint"]
