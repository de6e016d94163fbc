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

from ..errors import CheckpointingError
from ..files import Views


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
    file and the reason (``ENOSPC`` and the like)."""
    if isinstance(e, CheckpointingError):
        return e
    err = CheckpointingError(f"{action} {os.fspath(url)} failed: {reason(e)}")
    err.path = os.fspath(url)  # type: ignore[attr-defined]
    return err
