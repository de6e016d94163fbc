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
  new worker. Time a worker spends starting (importing torch) does not count; the start itself is
  bounded by ``max(timeout, WORKER_START_TIMEOUT)``. If a round itself fails (a peer is gone), the
  queue drops its calls without undoing them (a rank may have concluded them) and refuses more.
- A dead worker is detected by its exit status and replaced at the next schedule.
- Misuse is refused before anything changes: a wrong argument raises ``TypeError`` or
  ``ValueError`` naming it, and a request already scheduled raises :class:`CheckpointingError`.
- A call dropped before it was finalized (``close(abort=True)``, a failing ``close()``, the queue
  garbage-collected, or the process exiting) is named in a WARNING on the ``tierpoint`` logger; the
  warning changes nothing on disk (an aborted save leaves the previous checkpoint intact).

Over 400 lines: one class whose parts (scheduling, finalizing, timing out, shutting down) all act on
the same pending calls and worker; the worker process is :mod:`~tierpoint.asyncsave.worker`, the
rounds' collectives :mod:`~tierpoint.asyncsave.agreement`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import numbers
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import dist as tpdist
from ..errors import (
    CheckpointingError,
    CoordinationTimeoutError,
    agreed_error,
    error_text,
    failed_on_ranks,
)
from ..staging import StagingBuffer
from .agreement import (
    NOT_LATE,
    TIMED_OUT,
    WAIT_OVER,
    RoundFailed,
    Status,
    agree_outcome,
    agree_progress,
    new_group,
)
from .request import AsyncRequest
from .worker import Worker

logger = logging.getLogger("tierpoint")

_GAVE_UP_HINT = (
    "the queue accepts no more calls: its ranks cannot agree any more (a rank is gone or stopped). "
    "Restart the job; it resumes from the last complete checkpoint"
)

WORKER_START_TIMEOUT = 120.0
"""Seconds a worker process may take to start (import torch) on a loaded machine."""

_live_queues: weakref.WeakSet[AsyncCallsQueue] = weakref.WeakSet()
"""Every queue not yet garbage-collected, to name the calls still pending at exit."""


@dataclass
class _Call:
    id: int
    request: AsyncRequest
    scheduled_at: float
    snapshot: threading.Thread | None = None
    dispatched: bool = False
    worker_result: tuple[bool, Any, str | None] | None = None  # (ok, result or message, error type)
    background: threading.Thread | None = None
    local: tuple[bool, Any, str | None] | None = None  # this rank's final outcome
    buffers: set[str] = field(default_factory=set)  # staging buffers the call's arguments use


class AsyncCallsQueue:
    """Runs checkpoint work in a persistent background process per rank; see the module docstring.

    Args:
        persistent: accepted for NVRx compatibility; the worker is always a persistent process.
        is_daemon: accepted for NVRx compatibility (NVRx: start its worker as a daemon process, so
            that it dies with the trainer but cannot start children). No effect: tierpoint's worker
            always dies with its trainer (``PR_SET_PDEATHSIG``) and may start children.
        cpu_priority: the worker's nice value, 0-19 (None: ``TIERPOINT_WORKER_NICE`` or 19; NVRx's
            default is 10). Only raised, never lowered, as with NVRx.
        io_priority: the worker's I/O scheduling class, 0-3 as ``ionice -c`` takes it (3: idle,
            which deprioritizes checkpoint I/O); None leaves it unchanged. Set with ``ionice``
            where installed; a failure is logged by the worker, not fatal (as with NVRx).
        sigterm_timeout: seconds :meth:`close` waits for the worker to exit before killing it.
        cpu_shm_mode: accepted for NVRx compatibility (NVRx: stage into CPU shared memory and keep
            CUDA out of the worker). No effect: that is what tierpoint always does.
        max_in_flight: unfinalized calls allowed before scheduling waits (an int >= 1).
        timeout: seconds any blocking wait may take, finite and > 0 (default: ``TIERPOINT_TIMEOUT``
            or 300); the worker's start-up is not counted.
        overlap_snapshot: copy into staging memory on a background thread, so that
            ``schedule_async_request`` returns at once; call :meth:`wait_for_snapshot` (or install
            :meth:`install_optimizer_hook`) before the state is modified.

    Raises ``TypeError`` or ``ValueError``, naming the argument, before any worker is started.
    Finalize (``maybe_finalize_async_calls(blocking=True)``) or :meth:`close` the queue before the
    process exits: a call still pending then is dropped, with a WARNING.
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
        for name, flag in (
            ("persistent", persistent),
            ("is_daemon", is_daemon),
            ("cpu_shm_mode", cpu_shm_mode),
            ("overlap_snapshot", overlap_snapshot),
        ):
            _check_bool(name, flag)
        self.persistent, self.is_daemon, self.cpu_shm_mode = persistent, is_daemon, cpu_shm_mode
        self.cpu_priority = _check_priority("cpu_priority", cpu_priority, 19)
        self.io_priority = _check_priority("io_priority", io_priority, 3)
        self.sigterm_timeout = tpdist.timeout_or(sigterm_timeout, 30.0)
        self.max_in_flight = _check_max_in_flight(max_in_flight)
        # default_timeout() checks TIERPOINT_TIMEOUT
        self.timeout = tpdist.timeout_or(timeout, tpdist.default_timeout().total_seconds())
        self.overlap_snapshot = overlap_snapshot
        self._worker: Worker | None = self._new_worker()
        self._calls: deque[_Call] = deque()
        self._ids = itertools.count()
        self._group: Any = None
        self._closed = False
        self._gave_up: str | None = None  # why, once the ranks could not agree any more
        self._pump_lock = threading.Lock()
        self._results: dict[int, tuple[bool, Any, str | None]] = {}  # by call id, not yet claimed
        _live_queues.add(self)

    @classmethod
    def warmup_persistent_caller(cls, rank: int, *args: Any, **kwargs: Any) -> None:
        """NVRx's pre-start of the worker: nothing to do, a queue starts its worker when it is
        constructed (in the background; :meth:`wait_ready` waits for it)."""

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
        (:meth:`AsyncRequest.from_nvrx`). Raises ``TypeError`` for anything else that is not a
        valid :class:`AsyncRequest`, and
        :class:`CheckpointingError` for a request scheduled before (on any queue) or a closed queue,
        all before the queue changes. When the request cannot be taken (a closed or given-up queue,
        or finalizing an earlier call to make room raised), its ``abort_fns`` run before the error
        is raised: a planned save releases what it holds (its directory, staging, markers).
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
            _run_all(request.abort_fns)
            raise
        request.scheduled = True
        call = _Call(next(self._ids), request, time.monotonic())
        self._calls.append(call)
        if self.overlap_snapshot and request.preload_fn is not None:
            call.snapshot = threading.Thread(
                target=self._preload_and_dispatch, args=(call,), daemon=True
            )
            call.snapshot.start()
        else:
            # A failed snapshot is this rank's outcome of the call: it is agreed like any other, so
            # every rank raises it at the next finalize instead of this rank alone raising now.
            self._preload_and_dispatch(call)
        return call.id

    def _make_room(self) -> None:
        """Ready to take one more call: open, earlier calls finalized down to ``max_in_flight - 1``
        (collective), the group and a live worker there."""
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
        if tpdist.is_distributed() and self._group is None:
            self._group = new_group()
        if self._worker is None or self._worker.exitcode is not None:
            logger.warning("starting a new background worker (the previous one exited)")
            self._worker = self._new_worker()

    def _new_worker(self) -> Worker:
        return Worker(nice=self.cpu_priority, io_class=self.io_priority)

    def _preload_and_dispatch(self, call: _Call) -> None:
        request = call.request
        try:
            kwargs = dict(request.async_fn_kwargs or {})
            if request.preload_fn is not None:
                kwargs.update(request.preload_fn() or {})
            if request.async_fn is None:
                self._set_worker_result(call, (True, None, None))
            else:
                assert self._worker is not None
                args = tuple(request.async_fn_args)
                call.buffers = {
                    v.id for v in (*args, *kwargs.values()) if isinstance(v, StagingBuffer)
                }
                # Staging buffers no pending call uses any more (a layout changed) leave the worker.
                self._worker.drop_buffers(set().union(*(c.buffers for c in list(self._calls))))
                self._worker.submit(call.id, request.async_fn, args, kwargs)
            call.dispatched = True
        except BaseException as e:  # noqa: BLE001 - becomes this rank's outcome for the call
            logger.warning(  # raised on every rank at finalize; the traceback goes to DEBUG
                "%s: snapshot failed (every rank raises it when finalizing): %s",
                request.description,
                error_text(e),
            )
            logger.debug("%s: snapshot failure", request.description, exc_info=True)
            failed = (False, f"snapshot failed: {error_text(e)}", type(e).__name__)
            self._set_worker_result(call, failed)
        if request.background_fn is not None:
            # Also after a failure: the background step then tells its peers at once.
            call.background = threading.Thread(
                target=self._run_background, args=(call,), daemon=True
            )
            call.background.start()

    def _deadline(self, start: float) -> float:
        """When a wait that began at ``start`` times out: ``timeout`` seconds after ``start`` or
        after the worker became ready, whichever is later (its start-up is bounded on its own)."""
        worker = self._worker
        if worker is None or worker.exitcode is not None:
            return start + self.timeout
        if worker.ready_at is None:
            return start + max(self.timeout, WORKER_START_TIMEOUT)
        return max(start, worker.ready_at) + self.timeout

    def _run_background(self, call: _Call) -> None:
        """Wait (bounded) for the worker's result, then run the request's ``background_fn``."""
        start = time.monotonic()
        while call.worker_result is None and time.monotonic() < self._deadline(start):
            self._pump(0.05)
        worker = call.worker_result
        if worker is None and self._worker is not None:
            # Stuck (or stopped): replaced at the next schedule instead of failing every save.
            logger.warning(
                "%s: the background worker did not finish within %g s: killing it (a new one "
                "starts with the next save)",
                call.request.description,
                self.timeout,
            )
            self._worker.kill()
        worker = worker or (False, "the background worker did not finish in time", None)
        try:
            assert call.request.background_fn is not None
            call.request.background_fn(worker[0])
            outcome = worker
        except BaseException as e:  # noqa: BLE001 - becomes this rank's outcome for the call
            logger.debug("%s: background step failed: %s", call.request.description, e)
            outcome = worker if not worker[0] else (False, error_text(e), type(e).__name__)
        call.local = outcome

    def wait_for_snapshot(self, timeout: float | None = None) -> None:
        """Block until every scheduled snapshot copy finished (the state may be modified after)."""
        deadline = time.monotonic() + tpdist.timeout_or(timeout, self.timeout)
        for call in list(self._calls):
            if call.snapshot is not None:
                call.snapshot.join(max(0.0, deadline - time.monotonic()))
                if call.snapshot.is_alive():
                    raise CoordinationTimeoutError(
                        f"{call.request.description}: snapshot did not finish in time"
                    )

    def install_optimizer_hook(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for pending snapshots first. Returns the hook handle."""
        return optimizer.register_step_pre_hook(lambda *_: self.wait_for_snapshot())

    # ------------------------------------------------------------------------------ completion

    def get_num_unfinalized_calls(self) -> int:
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
        done: list[int] = []
        start = time.monotonic()
        while self._calls and (limit is None or len(done) < limit):
            ready = self._ready_count()
            now = time.monotonic()
            late = NOT_LATE
            if blocking and now > self._deadline(start):
                late = TIMED_OUT
            elif blocking and wait is not None and now > start + wait:
                late = WAIT_OVER
            if not (no_dist or self._group is None):
                ready, late = self._agreed(agree_progress, self._group, ready, late)
            if ready == 0:
                if late == TIMED_OUT:
                    raise CoordinationTimeoutError(self._time_out())
                if late == WAIT_OVER:
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
                self._conclude(call, self._statuses(call, no_dist))
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

    def _ready_count(self) -> int:
        """How many leading calls finished on this rank (worker, snapshot and background step)."""
        self._pump(0.0)
        count = 0
        for call in self._calls:
            threads = (call.snapshot, call.background)
            if call.local is None or any(t is not None and t.is_alive() for t in threads):
                break
            count += 1
        return count

    def _statuses(self, call: _Call, no_dist: bool) -> dict[int, Status]:
        """The outcome of ``call``, which every rank finished (agreed, see
        :func:`~tierpoint.asyncsave.agreement.agree_outcome`). Collective."""
        assert call.local is not None
        ok, payload, kind = call.local
        mine = (ok, "" if ok else str(payload), kind)
        if no_dist or self._group is None:
            return {tpdist.get_rank(): mine}
        self._calls.appendleft(call)  # dropped (named) with the others if a collective fails
        statuses = self._agreed(agree_outcome, self._group, mine, call.request.description)
        self._calls.popleft()
        return statuses

    def _agreed(self, round_fn: Any, *args: Any) -> Any:
        """``round_fn(*args)``, one agreement round; if it fails, the queue gives up."""
        try:
            return round_fn(*args)
        except RoundFailed as e:
            raise CheckpointingError(self._give_up(str(e))) from e.__cause__

    def _time_out(self) -> str:
        """Every rank agreed that the oldest call did not finish in time: stop the workers (one is
        stuck, and the others may still write files of the calls undone now), undo every pending
        call on every rank, and go on (a new worker starts at the next schedule)."""
        description = self._calls[0].request.description
        self._abort_pending("undone on every rank after a timeout", hint=False)
        return f"{description}: not finished on every rank within {self.timeout:g} s"

    def _give_up(self, why: str) -> str:
        """The queue's group failed (a peer is gone, or a collective timed out): the ranks cannot
        agree any more. Refuse further calls, stop the worker, drop the pending calls without undoing
        them (a rank may have concluded them before the failure). Returns the error message."""
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
            for call_id, ok, payload, kind in worker.results(wait):
                self._results[call_id] = (ok, payload, kind)
            calls = list(self._calls)  # a snapshot: the training thread may pop meanwhile
            for call in calls:
                if call.worker_result is None and call.id in self._results:
                    self._set_worker_result(call, self._results.pop(call.id))
            if worker.exitcode is not None:
                for call in calls:
                    if call.worker_result is None and call.dispatched:
                        died = f"background worker process died (exit code {worker.exitcode})"
                        self._set_worker_result(call, (False, died, None))

    @staticmethod
    def _set_worker_result(call: _Call, result: tuple[bool, Any, str | None]) -> None:
        call.worker_result = result
        if call.request.background_fn is None:
            call.local = result

    def _conclude(self, call: _Call, statuses: dict[int, tuple[bool, str, str | None]]) -> None:
        failures = {rank: msg for rank, (ok, msg, _) in statuses.items() if not ok}
        request = call.request
        if failures:
            _run_all(request.abort_fns)
            kinds = {statuses[r][2] for r in failures}
            raise agreed_error(
                kinds.pop() if len(kinds) == 1 and None not in kinds else "",
                failed_on_ranks(request.description, failures),
                failures,
            )
        for fn in request.finalize_fns:
            fn()
        logger.debug(
            "%s finalized %.3f s after scheduling",
            request.description,
            time.monotonic() - call.scheduled_at,
        )

    # ------------------------------------------------------------------------------ shutdown

    def close(self, abort: bool = False) -> None:
        """Finalize everything (or, with ``abort=True``, kill the worker and undo pending calls).

        Calls dropped unfinalized (all pending ones with ``abort=True``; those still pending
        when finalizing raises) are named in a WARNING.
        """
        if self._closed:
            return
        try:
            if abort:
                self._abort_pending("the queue was closed with abort=True")
            else:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            self._closed = True
            self._drop_pending("close() raised before finalizing it")
            if self._worker is not None:
                self._worker.stop(self.sigterm_timeout)
                self._worker = None

    def abort(self, why: str = "aborted") -> None:
        """Kill the worker and undo every pending call on this rank (their ``abort_fns``), without
        waiting for other ranks; the queue stays usable (a new worker starts with the next call).
        For fault handling, called on every rank (see :func:`abort_nvrx_checkpoint`)."""
        if not self._closed:
            self._abort_pending(why, hint=False)

    def _abort_pending(self, why: str, hint: bool = True) -> None:
        """Kill the worker, let the calls' threads end, run every pending call's ``abort_fns``, and
        drop the calls (named in a WARNING)."""
        if self._worker is not None:
            self._worker.kill()
        for call in self._calls:
            for thread in (call.snapshot, call.background):
                if thread is not None:
                    thread.join(self.timeout)
            _run_all(call.request.abort_fns)
        self._drop_pending(why, hint)

    def _drop_pending(self, why: str, hint: bool = True) -> None:
        """Forget the unfinalized calls, naming each in a WARNING: they are lost silently otherwise."""
        while self._calls:
            call = self._calls.popleft()
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

    def __enter__(self) -> AsyncCallsQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(abort=exc[0] is not None)

    def __del__(self) -> None:
        if getattr(self, "_calls", None):
            self._drop_pending("its AsyncCallsQueue was garbage-collected without close()")
        worker = getattr(self, "_worker", None)
        if worker is not None and worker.exitcode is None:
            worker.kill()


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


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_priority(name: str, value: object, highest: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    if not 0 <= value <= highest:
        raise ValueError(f"{name} must be between 0 and {highest}, got {value}")
    return int(value)


def _check_max_in_flight(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"max_in_flight must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {value}")
    return int(value)


def _run_all(fns: Any) -> None:
    for fn in fns:
        try:
            fn()
        except CheckpointingError as e:  # names what it could not remove; no traceback needed
            logger.warning("clean-up after a failed checkpoint call: %s", e)
        except Exception:  # noqa: BLE001 - clean-up must not hide the original failure
            logger.exception("clean-up after a failed checkpoint call raised")
