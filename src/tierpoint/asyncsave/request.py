"""AsyncRequest: one unit of background work and what to do when every rank has finished it.

Field names follow NVRx: ``async_fn(*async_fn_args, **async_fn_kwargs)`` runs in the background worker
process; ``finalize_fns`` run in the training process once every rank's ``async_fn`` succeeded;
``preload_fn`` runs in the training process when the request is scheduled, before ``async_fn`` is
dispatched (tierpoint uses it for the snapshot into staging memory); a dict it returns is merged into
``async_fn_kwargs``. tierpoint adds ``abort_fns``: run on every rank when the call failed on any rank
or was aborted, to remove what the call left behind; and ``background_fn(worker_ok)``: run on a thread
of the training process as soon as ``async_fn`` finished in the worker (whether it succeeded or not),
before the outcome is agreed, for work that needs ``torch.distributed`` (peer replication); raising
there fails the call like a failed ``async_fn``.

A request is scheduled once: :meth:`~tierpoint.asyncsave.AsyncCallsQueue.schedule_async_request`
checks its fields (:meth:`AsyncRequest.validate`) and refuses a request that was scheduled before.

Arguments travel to the worker by pickle over a private pipe between the two processes (never from
a file); ``async_fn`` travels by module and name, so it must sit at the top level of a module the
worker can import (not in the script being run, not a lambda): scheduling refuses anything else.
:class:`~tierpoint.staging.StagingBuffer` arguments travel as shared memory, not as bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointingError


@dataclass
class AsyncRequest:
    async_fn: Callable[..., Any] | None
    async_fn_args: tuple = ()
    finalize_fns: Sequence[Callable[[], Any]] = ()
    async_fn_kwargs: dict[str, Any] | None = None
    preload_fn: Callable[[], dict[str, Any] | None] | None = None
    abort_fns: Sequence[Callable[[], Any]] = field(default_factory=list)
    description: str = "async checkpoint call"
    background_fn: Callable[[bool], Any] | None = None
    scheduled: bool = field(default=False, init=False, repr=False, compare=False)
    """Set when a queue accepted the request."""

    def validate(self) -> None:
        """Raise ``TypeError`` naming the first field that does not hold what it should."""
        for name in ("async_fn", "preload_fn", "background_fn"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"AsyncRequest.{name} must be callable or None, got {fn!r}")
        _check_importable(self.async_fn)
        if not isinstance(self.async_fn_args, (tuple, list)):
            raise TypeError(
                "AsyncRequest.async_fn_args must be a tuple or list, "
                f"got {type(self.async_fn_args).__name__}"
            )
        if self.async_fn_kwargs is not None and not isinstance(self.async_fn_kwargs, dict):
            raise TypeError(
                "AsyncRequest.async_fn_kwargs must be a dict or None, "
                f"got {type(self.async_fn_kwargs).__name__}"
            )
        for name in ("finalize_fns", "abort_fns"):
            fns = getattr(self, name)
            if not isinstance(fns, (tuple, list)) or not all(callable(fn) for fn in fns):
                raise TypeError(f"AsyncRequest.{name} must be a list of callables, got {fns!r}")
        if not isinstance(self.description, str):
            raise TypeError(
                f"AsyncRequest.description must be a str, got {type(self.description).__name__}"
            )

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` too once the call succeeded on every rank; only before it is scheduled."""
        if not callable(fn):
            raise TypeError(f"finalize function must be callable, got {fn!r}")
        if self.scheduled:
            raise CheckpointingError(
                f"{self.description}: finalize functions cannot be added to a scheduled "
                "AsyncRequest (add them before schedule_async_request)"
            )
        self.finalize_fns = [*self.finalize_fns, fn]

    def execute_sync(self) -> Any:
        """Run the whole request in this process (no worker): preload, call, finalize."""
        kwargs = dict(self.async_fn_kwargs or {})
        if self.preload_fn is not None:
            kwargs.update(self.preload_fn() or {})
        result = self.async_fn(*self.async_fn_args, **kwargs) if self.async_fn is not None else None
        if self.background_fn is not None:
            self.background_fn(True)
        for fn in self.finalize_fns:
            fn()
        return result


def _check_importable(fn: Callable[..., Any] | None) -> None:
    """The worker process finds ``async_fn`` by module and name: refuse, before anything is sent,
    a function it could not import there (it would die unpickling it)."""
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str):  # None, or a callable object: pickled by its class
        return
    where = None
    if getattr(fn, "__module__", None) == "__main__":
        where = "in the script being run (__main__), which the worker does not import"
    elif "<lambda>" in qualname or "<locals>" in qualname:
        where = "inside a function or as a lambda, so it has no importable name"
    if where is not None:
        raise TypeError(
            f"AsyncRequest.async_fn {qualname!r} is defined {where}: the background worker runs it "
            "by module and name; define it at the top level of a module the script imports"
        )
