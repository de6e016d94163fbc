"""The local store: files on this machine's file systems, written by direct system calls, durable.

Call order: as for any :class:`~tierpoint.storage.store.Store`; :mod:`tierpoint.storage` picks this
store for plain paths and ``file://`` URLs.

Invariants:
- A write is durable when it returns: the file is fsynced (unless the caller asks otherwise and
  syncs later), and so is the directory that names it after a create, rename or remove. Large files
  that are fsynced anyway bypass the page cache on disk file systems (:mod:`.direct`).
- :meth:`LocalStore.publish` writes a ``.tmp`` file, fsyncs it and renames it over the target, so
  a reader sees the old content or the new; a publish that fails leaves no ``.tmp`` file.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from .. import files
from ..files import Views
from . import direct
from .store import Store
from .urls import local_path


def _write_local(path: str, views: Views, fsync: bool) -> int:
    """Create (or truncate) ``path`` holding ``views`` back to back; the byte count."""
    if fsync and direct.suitable(path, views):
        written = direct.write_file(path, views)
        if written is not None:
            return written
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        total = files.write_views(fd, views)
        if fsync:
            os.fsync(fd)
        return total
    finally:
        os.close(fd)


def _sync_parent(path: str) -> None:
    files.fsync_dir(os.path.dirname(os.path.abspath(path)))


class LocalStore(Store):
    """Local paths and ``file://`` URLs."""

    def makedirs(self, url: str) -> None:
        path = os.path.abspath(local_path(url))
        missing = []
        while path and not os.path.isdir(path):
            missing.append(path)
            path = os.path.dirname(path)
        for p in reversed(missing):
            try:
                os.mkdir(p)
            except FileExistsError:
                if not os.path.isdir(p):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", p) from None
            files.fsync_dir(os.path.dirname(p))

    def write_file(self, url: str, views: Views, fsync: bool) -> int:
        return _write_local(local_path(url), views, fsync)

    def publish(self, url: str, data: bytes) -> None:
        path = local_path(url)
        files.write_whole(path, lambda tmp: _write_local(tmp, [data], fsync=True), f"{path}.tmp")

    def touch(self, url: str) -> None:
        path = local_path(url)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        _sync_parent(path)

    def remove(self, url: str, missing_ok: bool, sync_dir: bool) -> bool:
        path = local_path(url)
        try:
            os.unlink(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
            return False
        if sync_dir:
            _sync_parent(path)
        return True

    def remove_files(self, directory: str, names: Sequence[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(local_path(directory), name))
            except FileNotFoundError:
                pass
        files.fsync_dir(local_path(directory))

    def remove_dir_if_empty(self, url: str) -> None:
        try:
            os.rmdir(local_path(url))
            _sync_parent(local_path(url))
        except OSError:
            pass

    def listdir(self, url: str) -> list[str]:
        try:
            return sorted(os.listdir(local_path(url)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:  # a link loop leads nowhere, as a dangling link does
            if e.errno == errno.ELOOP:
                return []
            raise

    def isdir(self, url: str) -> bool:
        return os.path.isdir(local_path(url))

    def exists(self, url: str) -> bool:
        return os.path.exists(local_path(url))

    def read_bytes(self, url: str) -> bytes:
        with open(local_path(url), "rb") as f:
            return f.read()

    def fsync_dir(self, url: str) -> None:
        files.fsync_dir(local_path(url))
