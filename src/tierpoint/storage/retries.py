"""Requests to object stores: how often each is tried, how long a try may take, what is retried.

Call order: :func:`request` (an fsspec filesystem method) or :func:`s3_request` (one S3 API call),
with the caller's :class:`UploadOptions`; :func:`with_retries` for anything else worth retrying;
:func:`deadline` around requests that must end by a time (between two collectives: the other ranks
wait for them at most ``TIERPOINT_TIMEOUT``).

Invariants:
- Every object-store request is tried :class:`UploadOptions` ``attempts`` times (the S3 client's
  own retries are off unless ``storage_options`` configure them), waiting ``backoff * 2**k``
  seconds between tries, each try bounded by the client's connect and read timeouts and by
  ``request_timeout``: a server that stops answering is an error, not a hang.
- Inside :func:`deadline` (on the thread that entered it, and on the threads given work through
  :func:`under_this_deadline`), no try starts after the deadline and a try on an async filesystem
  is cut at it: the request fails as if its last try timed out. Clean-up after such a failure
  runs inside :func:`grace`, which gives it a few seconds more.
- Only transient errors are retried (connection and timeout errors, throttling, a body cut short);
  a 4xx reply that the store would give again, a missing file or a refused permission fails at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from .store import reason, transient

logger = logging.getLogger("tierpoint")


@dataclass(frozen=True)
class UploadOptions:
    """How objects are sent to object stores.

    Objects larger than ``part_size`` are sent as a multipart upload (S3) with up to ``concurrency``
    parts in flight; each request is tried ``attempts`` times, waiting ``backoff * 2**k`` seconds.
    One try of a request may take ``request_timeout`` seconds in all, sending its body included
    (on fsspec's async filesystems, s3fs among them: the client's own read timeout does not bound
    sending a body to a server that stopped reading).
    """

    part_size: int = 32 << 20
    concurrency: int = 4
    attempts: int = 5
    backoff: float = 0.2
    request_timeout: float = 120.0


DEFAULT_UPLOAD = UploadOptions()


_DEADLINE = threading.local()


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Requests this thread makes inside end within ``seconds`` (see the module docstring)."""
    before = getattr(_DEADLINE, "at", None)
    at = time.monotonic() + seconds
    _DEADLINE.at = at if before is None else min(before, at)
    try:
        yield
    finally:
        _DEADLINE.at = before


@contextlib.contextmanager
def grace(seconds: float) -> Iterator[None]:
    """Inside a :func:`deadline`, at least ``seconds`` more for clean-up requests (an upload's
    abort); outside one, nothing changes."""
    before = getattr(_DEADLINE, "at", None)
    if before is not None:
        _DEADLINE.at = max(before, time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.at = before


def under_this_deadline(fn: Any) -> Any:
    """``fn``, to run on another thread (a pool's) under this thread's deadline, if any."""
    at = getattr(_DEADLINE, "at", None)
    if at is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        before = getattr(_DEADLINE, "at", None)
        _DEADLINE.at = at
        try:
            return fn(*args, **kwargs)
        finally:
            _DEADLINE.at = before

    return run


def _time_left() -> float | None:
    at = getattr(_DEADLINE, "at", None)
    return None if at is None else at - time.monotonic()


def with_retries(what: str, options: UploadOptions, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, tried again after transient errors as ``options`` say; ``what``
    names the request in the warning logged before each new try."""
    for attempt in range(options.attempts):
        left = _time_left()
        if attempt == 0 and left is not None and left <= 0:
            raise TimeoutError(f"{what}: out of time before the first try")
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified below
            if attempt + 1 >= options.attempts or not transient(e):
                raise
            wait = options.backoff * (2**attempt)
            left = _time_left()
            if left is not None and left <= wait:
                raise TimeoutError(f"{what}: out of time for another try ({reason(e)})") from e
            logger.warning("%s failed (%s); retrying in %.1f s", what, reason(e), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _bounded(fn: Any, timeout: float, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` where ``fn`` is a blocking method of an fsspec async filesystem
    (its ``timeout`` cancels the request); an expired deadline becomes a :class:`TimeoutError`."""
    from fsspec.exceptions import FSTimeoutError

    left = _time_left()
    timeout = timeout if left is None else max(0.001, min(timeout, left))
    try:
        return fn(*args, timeout=timeout, **kwargs)
    except FSTimeoutError:
        raise TimeoutError(f"no reply within {timeout:g} s") from None


def request(
    what: str,
    fs: Any,
    method: str,
    *args: Any,
    upload: UploadOptions = DEFAULT_UPLOAD,
    **kwargs: Any,
) -> Any:
    """``fs.<method>(*args, **kwargs)``: one request to an object store, retried on transient errors
    as ``upload`` says, each try bounded by ``upload.request_timeout`` on async filesystems."""
    from fsspec.asyn import AsyncFileSystem

    fn = getattr(fs, method)
    if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
        return with_retries(what, upload, _bounded, fn, upload.request_timeout, *args, **kwargs)
    return with_retries(what, upload, fn, *args, **kwargs)


def s3_request(what: str, fs: Any, method: str, options: UploadOptions, **kwargs: Any) -> Any:
    """One S3 API call (botocore's ``method``), retried and bounded like :func:`request`."""
    from fsspec.asyn import sync

    call = partial(_bounded, partial(sync, fs.loop, fs._call_s3), options.request_timeout)
    return with_retries(what, options, call, method, **kwargs)
