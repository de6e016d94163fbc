"""The ``concurrent.futures.Future`` that :meth:`Checkpointer.save_async` returns.

An async save is an :class:`~tierpoint.asyncsave.AsyncRequest` on an
:class:`~tierpoint.asyncsave.AsyncCallsQueue`: the worker process writes the files, and the
request is finalized (committed) once every rank's write succeeded, in an agreement round that
every rank runs at the same point. So, unlike OLMo-core's future (completed by a thread), this one
is driven by its callers:

- ``done()`` runs one non-blocking finalize round and says whether the save has finished;
- ``result(timeout)`` finalizes the save, waiting for it, and returns ``None`` or raises its error;
  past ``timeout`` seconds it raises ``TimeoutError`` on every rank and the save stays pending;
- ``add_done_callback(fn)`` runs ``fn(future)`` when the save finishes (in the thread that
  finalized it), or at once if it has finished;
- ``cancel()`` returns ``False``: a scheduled save runs to its end.

Call ``done()`` and ``result()`` on every rank at the same points (as a training loop does): they
are collective. A failed save's error is the same on every rank.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from ..asyncsave import AsyncCallsQueue, AsyncRequest
from ..errors import CheckpointingError, CoordinationTimeoutError


class CheckpointFuture(concurrent.futures.Future):
    """See the module docstring."""

    def __init__(
        self, queue: AsyncCallsQueue, description: str, request: AsyncRequest | None = None
    ) -> None:
        super().__init__()
        self.set_running_or_notify_cancel()  # running: cancel() answers False
        self.queue = queue
        self.description = description
        self.request = request  # (its failure: where another call finalized it)
        self.call_id: int | None = None
        self._failed = False

    def _finished(self) -> bool:
        return concurrent.futures.Future.done(self)

    def finish(self) -> None:
        """Mark the save committed (its last finalize step)."""
        if not self._finished():
            self.set_result(None)

    def mark_failed(self) -> None:
        """The request's abort step: the queue raises the agreed error where it finalizes."""
        self._failed = True

    def _settle(self, blocking: bool, timeout: float | None = None) -> None:
        if self._finished():
            return
        try:
            if blocking and self.call_id is not None:
                self.queue.finalize_through(self.call_id, timeout)
            else:
                self.queue.maybe_finalize_async_calls(blocking=False)
        except CoordinationTimeoutError as e:
            if self._finished():
                return
            if blocking and timeout is not None and not self._failed:
                raise TimeoutError(f"{self.description}: not finished within {timeout:g} s") from e
            self.set_exception(e)
            return
        except Exception as e:  # noqa: BLE001 - the save's agreed error becomes the future's
            if not self._finished():
                self.set_exception(e)
            return
        if self._finished():
            return
        # After finalize_through the call is concluded; without blocking, an empty queue says so.
        failure = self.request.failure if self.request is not None else ""
        if self._failed or failure or blocking or self.queue.get_num_unfinalized_calls() == 0:
            self.set_exception(
                CheckpointingError(
                    f"{self.description} failed: {failure}"
                    if failure
                    else f"{self.description} failed; its error was raised where the queue "
                    "finalized it"
                    if self._failed
                    else f"{self.description} was dropped before it was committed"
                )
            )

    def done(self) -> bool:
        self._settle(blocking=False)
        return self._finished()

    def result(self, timeout: float | None = None) -> Any:
        self._settle(blocking=True, timeout=timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._settle(blocking=True, timeout=timeout)
        return super().exception(timeout=0)

    def cancel(self) -> bool:
        return False
