"""AsyncRequest: one unit of background work and what to do when every rank has finished it.

Field names follow NVRx: ``async_fn(*async_fn_args, **async_fn_kwargs)`` runs in the background worker
process; ``finalize_fns`` run in the training process once every rank's ``async_fn`` succeeded
(in order; after one raised, only tierpoint's own commits still run, :class:`Commit`, and the first
error is raised once they ran: a user's function can neither skip a tier's commit nor run after a
failed one);
``preload_fn`` runs in the training process when the request is scheduled, before ``async_fn`` is
dispatched (tierpoint uses it for the snapshot into staging memory); a dict it returns is merged into
``async_fn_kwargs``. tierpoint adds ``abort_fns``: run on every rank when the call failed on any rank
or was aborted, to remove what the call left behind; and ``background_fn(worker_ok)``: run on a thread
of the training process as soon as ``async_fn`` finished in the worker (whether it succeeded or not),
before the outcome is agreed, for work that needs ``torch.distributed`` (peer replication); raising
there fails the call like a failed ``async_fn``.

NVRx's own fields ``is_frozen`` and ``call_idx`` and its methods ``freeze()``, ``_replace()`` and
``_asdict()`` exist too, so code written for NVRx's NamedTuple runs unchanged; a request built by
NVRx's own class (any NamedTuple with NVRx's fields) is converted by :meth:`AsyncRequest.from_nvrx`
when scheduled, with NVRx's meaning of ``preload_fn`` (its result replaces ``async_fn_args[1]``).

A request is scheduled once: :meth:`~tierpoint.asyncsave.AsyncCallsQueue.schedule_async_request`
checks its fields (:meth:`AsyncRequest.validate`) and refuses a request that was scheduled before.

Arguments travel to the worker by pickle over a private pipe between the two processes (never from
a file); ``async_fn`` travels by module and name, so it must sit at the top level of a module the
worker can import (not in the script being run, not a lambda): scheduling refuses anything else.
:class:`~tierpoint.staging.StagingBuffer` and :class:`~tierpoint.staging.SourceFile` arguments
travel as shared memory (by descriptor), not as bytes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointingError

logger = logging.getLogger("tierpoint")


class Commit:
    """A finalize function of tierpoint's own (a tier's commit, the release of what a save holds):
    it runs even after an earlier finalize function raised, so that a user's function put first
    cannot leave a save committed on some ranks and in flight on others."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __call__(self) -> Any:
        return self.fn()


def run_finalize_fns(fns: Sequence[Callable[[], Any]], description: str) -> None:
    """Run a call's finalize functions in order; after one raised, only the :class:`Commit` ones,
    then raise the first error (what the others raise is logged)."""
    first: Exception | None = None
    for fn in fns:
        if first is not None and not isinstance(fn, Commit):
            logger.warning(
                "%s: finalize function %r not run (one before it raised)", description, fn
            )
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - raised below, once the commits after it ran
            if first is not None:
                logger.warning("%s: a finalize function raised too: %s", description, e)
            first = first or e
    if first is not None:
        raise first


@dataclass
class AsyncRequest:
    async_fn: Callable[..., Any] | None
    async_fn_args: tuple = ()
    finalize_fns: Sequence[Callable[[], Any]] = ()
    async_fn_kwargs: dict[str, Any] | None = None
    preload_fn: Callable[[], dict[str, Any] | None] | None = None
    is_frozen: bool = False
    """NVRx's flag: set by :meth:`freeze`; a frozen request takes no more finalize functions."""
    call_idx: int = 0
    """NVRx's field; the queue numbers calls itself (the id ``schedule_async_request`` returns)."""
    abort_fns: Sequence[Callable[[], Any]] = field(default_factory=list)
    description: str = "async checkpoint call"
    background_fn: Callable[[bool], Any] | None = None
    state_copied: bool = False
    """The request holds its own copy of the state, taken when it was made: its snapshot does not
    read the caller's tensors, so :meth:`AsyncCallsQueue.wait_for_snapshot` does not wait for it."""
    scheduled: bool = field(default=False, init=False, repr=False, compare=False)
    """Set when a queue accepted the request."""
    failure: str = field(default="", init=False, repr=False, compare=False)
    """Why the call failed (the agreed error, every rank's reason), set before its ``abort_fns``
    run (they take no argument, as NVRx's), or what a finalize function raised: a record or a
    future of the save can say it."""

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
        if self.scheduled or self.is_frozen:
            raise CheckpointingError(
                f"{self.description}: finalize functions cannot be added to a "
                f"{'scheduled' if self.scheduled else 'frozen'} AsyncRequest "
                "(add them before freeze() and schedule_async_request)"
            )
        self.finalize_fns = [*self.finalize_fns, fn]

    def freeze(self) -> AsyncRequest:
        """A copy that takes no more finalize functions (NVRx's method)."""
        return self._replace(is_frozen=True)

    def _replace(self, **changes: Any) -> AsyncRequest:
        """A copy with ``changes`` (NVRx's NamedTuple method); never marked scheduled."""
        return dataclasses.replace(self, **changes)

    def _asdict(self) -> dict[str, Any]:
        """The fields by name (NVRx's NamedTuple method)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_nvrx(cls, request: Any) -> AsyncRequest:
        """Convert a request built by NVRx's ``AsyncRequest`` NamedTuple (or any object with its
        ``_fields``); ``TypeError`` for anything else. ``preload_fn`` keeps NVRx's meaning: its
        result replaces ``async_fn_args[1]`` in the worker."""
        fields = getattr(request, "_fields", None)
        if not isinstance(fields, tuple) or not set(_NVRX_FIELDS) <= set(fields):
            raise TypeError(
                f"request must be an AsyncRequest, got {type(request).__name__} (accepted: "
                "tierpoint.asyncsave.AsyncRequest, or NVRx's AsyncRequest with the fields "
                f"{', '.join(_NVRX_FIELDS)})"
            )
        values = {name: getattr(request, name) for name in fields if name in _NVRX_OPTIONAL}
        fn, args, preload = request.async_fn, request.async_fn_args, values.pop("preload_fn", None)
        if preload is not None and callable(preload):
            _check_importable(fn)
            args, fn = (fn, *args), call_with_preloaded
            values["preload_fn"] = lambda: {_PRELOADED: preload()}
        finalize = request.finalize_fns
        return cls(
            fn,
            args,
            list(finalize) if isinstance(finalize, (list, tuple)) else finalize,
            description=f"NVRx async call {getattr(request.async_fn, '__qualname__', '')}".strip(),
            **values,
        )

    def execute_sync(self) -> Any:
        """Run the whole request in this process (no worker): preload, call, finalize (after a
        finalize function raised, only the :class:`Commit` ones, as in the queue)."""
        kwargs = dict(self.async_fn_kwargs or {})
        if self.preload_fn is not None:
            kwargs.update(self.preload_fn() or {})
        result = self.async_fn(*self.async_fn_args, **kwargs) if self.async_fn is not None else None
        if self.background_fn is not None:
            self.background_fn(True)
        run_finalize_fns(self.finalize_fns, self.description)  # the queue's rule
        return result


_NVRX_FIELDS = ("async_fn", "async_fn_args", "finalize_fns")
_NVRX_OPTIONAL = ("async_fn_kwargs", "preload_fn", "is_frozen", "call_idx")
_PRELOADED = "_tierpoint_nvrx_preloaded"


def call_with_preloaded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Worker side of an NVRx request with a ``preload_fn``: its result replaces ``args[1]``."""
    if _PRELOADED in kwargs:
        args = (*args[:1], kwargs.pop(_PRELOADED), *args[2:])
    return fn(*args, **kwargs)


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
