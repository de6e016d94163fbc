"""Naming in :mod:`tierpoint.storage`: which paths and URLs name what, and how they are joined.

A location is a local path, a ``file://`` URL (both local) or an fsspec URL (``s3://bucket/key``,
...). Call order: :func:`checkpoint_path` once on what a caller passed, then :func:`is_local` to
pick the store, :func:`local_path` to get a local file system path, :func:`join` and
:func:`basename` to name entries.

Invariants: pure string functions (no I/O); local paths are joined with ``os.path``, URLs with
``/`` separators.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

from ..errors import CheckpointingError


def checkpoint_path(value: Any, argument: str = "path") -> str:
    """``value`` as a path or URL string; anything else is a clear error naming ``argument``."""
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and path:
            return path
    hint = (
        " (get_latest_complete_checkpoint returns None when no checkpoint exists)"
        if value is None
        else ""
    )
    raise CheckpointingError(
        f"{argument} must be a path or URL string (not empty), got {type(value).__name__}{hint}"
    )


def is_local(url: str | os.PathLike) -> bool:
    """Whether ``url`` names a local path (plain path or ``file://``)."""
    text = os.fspath(url)
    return "://" not in text or text.startswith("file://")


def local_path(url: str | os.PathLike) -> str:
    """The file system path of a local ``url`` (``file://`` removed)."""
    text = os.fspath(url)
    return text[len("file://") :] if text.startswith("file://") else text


def join(url: str | os.PathLike, *names: str) -> str:
    """``url`` with ``names`` appended (``/`` separators for URLs)."""
    text = os.fspath(url)
    if is_local(text):
        return os.path.join(text, *names)
    return posixpath.join(text.rstrip("/"), *names)


def basename(url: str | os.PathLike) -> str:
    """The last name of ``url`` (a trailing ``/`` ignored)."""
    return posixpath.basename(os.fspath(url).rstrip("/"))
