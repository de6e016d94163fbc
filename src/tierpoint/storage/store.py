"""The storage seam: what a store (local files, an object store) does, and how its failures read.

:class:`Store` is the one interface behind :mod:`tierpoint.storage`'s functions, like torch DCP's
``FileSystemBase``: :class:`~tierpoint.storage.local.LocalStore` and
:class:`~tierpoint.storage.remote.RemoteStore` implement it, and
:func:`tierpoint.storage.store` picks one for a URL. Its verbs take the caller's URL (a store
resolves it) and raise whatever the file system or client raised; the package's functions turn that
into :func:`failure`.

Call order for a checkpoint directory: :meth:`Store.makedirs`, :meth:`Store.touch` a marker,
:meth:`Store.write_file` each data file, :meth:`Store.publish` the commit file last,
:meth:`Store.remove` the marker. Readers use :meth:`Store.listdir`, :meth:`Store.exists`,
:meth:`Store.read_bytes`.

Invariants every store keeps: a write is durable (local) or complete (object stores) when it
returns; :meth:`Store.publish` is atomic; listings show what the store holds now.
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

from ..errors import CheckpointingError, StorageUnavailableError
from ..files import Views
from .urls import is_local


class Store(ABC):
    """One kind of storage; every verb takes a URL (or path) that this store serves."""

    @abstractmethod
    def makedirs(self, url: str) -> None:
        """Create a directory and its parents (a no-op where directories are implicit)."""

    @abstractmethod
    def write_file(self, url: str, views: Views, fsync: bool) -> int:
        """Make ``views``, back to back, the whole content of ``url``; returns the byte count."""

    @abstractmethod
    def publish(self, url: str, data: bytes) -> None:
        """Atomically make ``url`` hold ``data``: a reader sees the old content or the new."""

    @abstractmethod
    def touch(self, url: str) -> None:
        """Create an empty file (a marker), durably."""

    @abstractmethod
    def remove(self, url: str, missing_ok: bool, sync_dir: bool) -> bool:
        """Remove a file; returns whether it existed."""

    @abstractmethod
    def remove_files(self, directory: str, names: Sequence[str]) -> None:
        """Remove the files ``names`` of ``directory``; missing ones are fine."""

    @abstractmethod
    def remove_dir_if_empty(self, url: str) -> None:
        """Remove an empty directory; quietly keep a non-empty one."""

    @abstractmethod
    def listdir(self, url: str) -> list[str]:
        """Names directly under ``url``, sorted; empty when it does not exist."""

    @abstractmethod
    def isdir(self, url: str) -> bool:
        """Whether ``url`` is a directory."""

    @abstractmethod
    def exists(self, url: str) -> bool:
        """Whether ``url`` exists."""

    @abstractmethod
    def read_bytes(self, url: str) -> bytes:
        """The whole content of ``url``."""

    @abstractmethod
    def fsync_dir(self, url: str) -> None:
        """Make a directory's entries durable (a no-op where nothing needs it)."""


def reason(e: BaseException) -> str:
    """``e`` in a few words, with the errno's name (``ENOSPC``) where there is one."""
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        return f"{e.strerror or e} [{name}]"
    return f"{type(e).__name__}: {e}"


def failure(action: str, url: str | os.PathLike, e: BaseException) -> CheckpointingError:
    """The error to raise when ``action`` ("writing", ...) on ``url`` failed with ``e``: names the
    file and the reason (``ENOSPC`` and the like); a :class:`StorageUnavailableError` when an object
    store did not answer (``e`` is :func:`transient`: its retries were spent)."""
    if isinstance(e, CheckpointingError):
        return e
    at = os.fspath(url)
    if not is_local(at) and transient(e):
        err: CheckpointingError = StorageUnavailableError(
            f"{action} {at} failed: the store did not answer ({reason(e)})"
        )
    else:
        err = CheckpointingError(f"{action} {at} failed: {reason(e)}")
    err.path = at  # type: ignore[attr-defined]
    return err


def transient(e: BaseException) -> bool:
    """Whether an object-store error is worth retrying."""
    if isinstance(e, (PermissionError, FileNotFoundError, IsADirectoryError, ValueError)):
        return False
    status, code = _http_status(e)
    if status is not None and 400 <= status < 500:
        return status in (408, 429) or code in _RETRIED_CLIENT_ERRORS
    if isinstance(e, (OSError, ConnectionError, TimeoutError)):
        return True
    if {c.__name__ for c in type(e).__mro__} & _TRANSIENT_CLASSES:
        return True
    name = type(e).__name__
    return any(k in name for k in ("Timeout", "Connection", "Throttl", "Endpoint", "Payload"))


def _http_status(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and S3 error code of the reply behind ``e`` (s3fs keeps botocore's error as
    the cause of the one it raises), or ``(None, None)``: no reply came."""
    seen: BaseException | None = e
    for _ in range(4):
        if seen is None:
            break
        reply = getattr(seen, "response", None)
        if isinstance(reply, dict):
            status = reply.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return (int(status) if status else None), reply.get("Error", {}).get("Code")
        seen = seen.__cause__ or seen.__context__
    return None, None


_RETRIED_CLIENT_ERRORS = {
    "RequestTimeout",
    "IncompleteBody",
    "BadDigest",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "OperationAborted",
}
"""4xx replies that a later try may not get (the body was cut short or damaged on the way, the
store throttles); any other 4xx will be answered again and fails at once."""

_TRANSIENT_CLASSES = {"HTTPClientError", "IncompleteRead", "ResponseParserError"}
"""Client errors s3fs itself retries (botocore's HTTPClientError covers a reply cut short); the
client tierpoint uses leaves every retry to :func:`with_retries`."""
