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
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointingError

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/]*)")
_ONE_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")
_LOCAL_SCHEMES = ("file", "local")
_BUCKET_SCHEMES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "oci", "tos", "tosfs"}
)
"""Object stores whose URLs name a bucket (or container) first: ``s3://`` alone names none. Other
schemes may leave it empty (``memory:///run``, ``hdfs:///run`` on the default name node)."""


def checkpoint_path(value: Any, argument: str = "path") -> str:
    """``value`` as a path or URL string; anything else is a clear error naming ``argument``, and
    so is a URL no store serves: an unknown scheme, an object store's without a bucket
    (``s3://``), or a scheme followed by one slash (``s3:/bucket``, which would be a local
    directory named ``s3:``)."""
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and path:
            _check_url(path, argument)
            return path
    hint = (
        " (get_latest_complete_checkpoint returns None when no checkpoint exists)"
        if value is None
        else ""
    )
    raise CheckpointingError(
        f"{argument} must be a path or URL string (not empty), got {type(value).__name__}{hint}"
    )


def options_dict(value: Any, argument: str = "storage_options") -> dict[str, Any]:
    """``value`` (fsspec options: a mapping or ``None``) as a new dict; anything else is a clear
    error naming ``argument`` (its type only: options may hold credentials)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise CheckpointingError(
            f"{argument} must be a mapping of fsspec options (such as {{'endpoint_url': ...}}) "
            f"or None, got {type(value).__name__}"
        )
    return dict(value)


def _check_url(path: str, argument: str) -> None:
    url = _URL.match(path)
    if url is None:
        one = _ONE_SLASH.match(path)
        if one is not None and _known_scheme(one[1]):
            rest = path[one.end() - (one[1].lower() in _LOCAL_SCHEMES) :]  # file:/x: file:///x
            raise CheckpointingError(
                f"{argument} {path!r} has one slash after {one[1]}: (a local directory named "
                f"'{one[1]}:'); write {one[1]}://{rest}"
            )
        return
    scheme, location = url[1].lower(), url[2]
    if not _known_scheme(scheme):
        raise CheckpointingError(
            f"{argument} {path!r}: unknown URL scheme {scheme!r} (accepted: a local path, "
            "file://, s3:// or another fsspec protocol)"
        )
    if scheme in _BUCKET_SCHEMES and not location:
        raise CheckpointingError(f"{argument} {path!r} names no bucket or host after {scheme}://")


def _known_scheme(scheme: str) -> bool:
    """Whether fsspec has a file system for ``scheme`` (built in, or registered by a package)."""
    from fsspec.registry import known_implementations, registry

    return scheme.lower() in known_implementations or scheme.lower() in registry


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
