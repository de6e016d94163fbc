"""Paths and URLs over one small API: local files (direct system calls, fsynced) or any fsspec URL.

Every function takes a local path, a ``file://`` URL or an fsspec URL (``s3://bucket/key``, ...) plus
optional ``storage_options`` (passed to fsspec, e.g. ``{"endpoint_url": ...}`` for s3fs). Each one
asks :func:`store` for the :class:`Store` that serves the URL (:mod:`.local` or :mod:`.remote`) and
reports any failure as :func:`failure` does. The package's floor: it imports nothing of tierpoint
but :mod:`tierpoint.errors` and :mod:`tierpoint.files`.

Modules: :mod:`.urls` names paths and URLs, :mod:`.store` is the seam, :mod:`.local` and
:mod:`.remote` implement it, :mod:`.retries` tries object-store requests, :mod:`.direct` writes
large local files past the page cache.

Call order for a checkpoint directory: :func:`makedirs`, :func:`touch` a marker, :func:`write_file`
each data file, :func:`publish` the commit file last, :func:`remove` the marker. Readers use
:func:`listdir`, :func:`exists`, :func:`read_bytes`.

Invariants:
- Local writes are durable when the call returns: files are fsynced, and so is the directory that
  names them (after create, rename and remove). Large files that are fsynced anyway bypass the page
  cache on disk file systems (:mod:`.direct`).
- :func:`publish` is atomic: a reader sees the old content or the new, never a part (local: tmp file,
  fsync, rename; object stores: one PUT).
- Large uploads to S3 are multipart, parts sent in parallel and each retried on transient errors
  (bounded attempts with backoff); a failed upload is aborted, leaving no object behind.
- Every object-store request is tried :class:`UploadOptions` ``attempts`` times, each try bounded by
  the client's connect and read timeouts and by ``request_timeout``: a server that stops answering
  is an error, not a hang.
- Listings never come from fsspec's listing cache, so a rank sees what the store holds now.
- Every failure is a :class:`~tierpoint.errors.CheckpointingError` naming the path and the reason;
  an object store that did not answer after every try raises its subclass
  :class:`~tierpoint.errors.StorageUnavailableError` (nothing is known about the object).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .. import files
from ..errors import CheckpointingError
from ..files import Views
from .local import LocalStore
from .remote import RemoteStore, check_bucket, filesystem
from .retries import DEFAULT_UPLOAD, UploadOptions, request
from .retries import with_retries as _with_retries  # noqa: F401 - tests call it
from .store import Store, failure
from .urls import basename, checkpoint_path, is_local, join, local_path, options_dict

__all__ = [
    "DEFAULT_UPLOAD",
    "LocalStore",
    "RemoteStore",
    "Store",
    "UploadOptions",
    "Views",
    "basename",
    "check_bucket",
    "checkpoint_path",
    "exists",
    "failure",
    "filesystem",
    "fsync_dir",
    "is_local",
    "isdir",
    "join",
    "listdir",
    "local_path",
    "makedirs",
    "options_dict",
    "publish",
    "read_bytes",
    "remove",
    "remove_dir_if_empty",
    "remove_files",
    "request",
    "store",
    "touch",
    "write_file",
    "write_files_parallel",
]

_LOCAL = LocalStore()
_T = TypeVar("_T")


def store(
    url: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> Store:
    """The store that serves ``url``: local files, or the fsspec filesystem of its scheme."""
    return _LOCAL if is_local(url) else RemoteStore(storage_options, upload)


def _on_store(
    action: str,
    url: str | os.PathLike,
    storage_options: Mapping[str, Any] | None,
    upload: UploadOptions,
    call: Callable[[Store, str], _T],
) -> _T:
    """``call(store, url)`` with the store that serves ``url``; any failure raised as
    :func:`failure` of ``action`` on ``url``."""
    at = os.fspath(url)
    try:
        return call(store(at, storage_options, upload), at)
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure(action, url, e) from e


def makedirs(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> None:
    """Create a directory and its parents (durably, for local paths); a no-op on object stores."""
    _on_store(
        "creating directory", url, storage_options, DEFAULT_UPLOAD, lambda s, at: s.makedirs(at)
    )


def write_file(
    url: str | os.PathLike,
    views: Views,
    *,
    storage_options: Mapping[str, Any] | None = None,
    fsync: bool = True,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> int:
    """Write ``views`` back to back as the whole content of ``url``; returns the byte count.

    Local files are written in place and fsynced (the caller fsyncs the directory once after a batch
    of files, see :func:`fsync_dir`); object-store files appear only when complete.
    """
    return _on_store(
        "writing", url, storage_options, upload, lambda s, at: s.write_file(at, views, fsync)
    )


def publish(
    url: str | os.PathLike,
    data: bytes,
    *,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> None:
    """Atomically make ``url`` hold ``data`` (local: tmp, fsync, rename, fsync dir; else one PUT)."""
    _on_store("publishing", url, storage_options, upload, lambda s, at: s.publish(at, data))


def touch(
    url: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> None:
    """Create an empty file (a marker), durably."""
    _on_store("creating", url, storage_options, upload, lambda s, at: s.touch(at))


def remove(
    url: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    missing_ok: bool = True,
    sync_dir: bool = True,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> bool:
    """Remove a file; returns whether it existed. Local removals are made durable unless
    ``sync_dir`` is false; remote ones are retried as ``upload`` says."""
    return _on_store(
        "removing", url, storage_options, upload, lambda s, at: s.remove(at, missing_ok, sync_dir)
    )


def remove_files(
    directory: str | os.PathLike,
    names: Sequence[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> None:
    """Remove the files ``names`` of ``directory`` (missing ones are fine): locally with one
    directory sync for all, on an object store in one bulk request (retried as ``upload`` says)."""
    if not names:
        return
    action = f"removing {len(names)} files in"
    _on_store(action, directory, storage_options, upload, lambda s, at: s.remove_files(at, names))


def remove_dir_if_empty(
    url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Remove an empty local directory (quietly keeps a non-empty one); no-op on object stores."""
    store(url, storage_options).remove_dir_if_empty(os.fspath(url))


def listdir(
    url: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> list[str]:
    """Names directly under ``url`` (files and directories); empty when it does not exist. Remote
    listings are retried as ``upload`` says."""
    return _on_store("listing", url, storage_options, upload, lambda s, at: s.listdir(at))


def isdir(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``url`` is a directory."""
    return _on_store("inspecting", url, storage_options, DEFAULT_UPLOAD, lambda s, at: s.isdir(at))


def exists(
    url: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> bool:
    """Whether ``url`` exists (remote checks are retried as ``upload`` says)."""
    return _on_store("inspecting", url, storage_options, upload, lambda s, at: s.exists(at))


def read_bytes(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole content of ``url``."""
    return _on_store(
        "reading", url, storage_options, DEFAULT_UPLOAD, lambda s, at: s.read_bytes(at)
    )


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries durable (local paths only; a no-op for URLs)."""
    store(path).fsync_dir(os.fspath(path))


def write_files_parallel(
    jobs: Sequence[tuple[str, Views]],
    *,
    threads: int,
    storage_options: Mapping[str, Any] | None = None,
    fsync: bool = True,
    upload: UploadOptions = DEFAULT_UPLOAD,
    timeout: float | None = None,
) -> list[int]:
    """Write several files on ``threads`` threads (each file whole by one thread, through
    :func:`write_file`), then fsync the directories that name them. Raises the first failure
    (naming its file); waits at most ``timeout`` seconds."""
    if not jobs:
        return []
    results: list[int] = [0] * len(jobs)
    errors: list[BaseException] = []
    lock = threading.Lock()
    pending = list(enumerate(jobs))

    def run() -> None:
        while True:
            with lock:
                if not pending or errors:
                    return
                i, (url, views) = pending.pop(0)
            try:
                results[i] = write_file(
                    url, views, storage_options=storage_options, fsync=fsync, upload=upload
                )
            except BaseException as e:  # noqa: BLE001 - raised by the caller below
                with lock:
                    errors.append(e)
                return

    workers = [
        threading.Thread(target=run, name=f"tierpoint-write-{k}", daemon=True)
        for k in range(max(1, min(threads, len(jobs))))
    ]
    for w in workers:
        w.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for w in workers:
        w.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if w.is_alive():
            raise CheckpointingError(
                f"writing {len(jobs)} files did not finish within {timeout:g} s"
            )
    if errors:
        raise errors[0]
    if fsync:
        for d in sorted({os.path.dirname(local_path(u)) for u, _ in jobs if is_local(u)}):
            try:
                files.fsync_dir(d or ".")
            except OSError as e:
                raise failure("syncing directory", d, e) from e
    return results
