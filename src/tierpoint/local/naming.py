"""Names and places of local part files.

Layout: ``root/<session_id>/<holder rank>/iter_<7-digit iteration>_<origin rank>_local.safetensors``.
The origin rank is the rank whose state the file holds; it differs from the holder only for replicas.
A file being written carries the ``.dirty`` suffix; an expired file kept for reuse is a ``spare_<n>.free``.
Beside each holder's directory, ``<holder rank>.node`` names the node it was last saved from
(:mod:`.left_behind`).

A file version (inode, size, mtime) identifies what a name pointed to at one moment: the manager's
scan cache and its fetches compare versions to tell a new file from the old one.

Invariant: names are parsed strictly (``parse_part_name`` returns ``None`` for anything else), and
session ids cannot escape the root (no separators, no ``..``).
"""

from __future__ import annotations

import numbers
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import fileformat, storage
from ..errors import CheckpointingError, CorruptCheckpointError
from ..files import DIRTY_SUFFIX

EXTENSION = ".safetensors"
_PART_RE = re.compile(r"iter_([0-9]{7,})_([0-9]+)_local" + re.escape(EXTENSION))
_SPARE_RE = re.compile(r"spare_([0-9]+)\.free")
_SESSION_RE = re.compile(r"[A-Za-z0-9_.\-]*")
NO_CHECKPOINT = -1
"""What ``find_latest`` returns when no iteration is complete."""
MAX_WORLD_SIZE = 1 << 24
"""Larger world sizes in a part's metadata are refused as corrupt (a forged one could exhaust memory)."""


class CkptID(NamedTuple):
    """Identifies one rank's part of one checkpoint (the NVRx tuple layout)."""

    iteration: int
    rank: int
    session_id: str


def default_root() -> Path:
    """``/dev/shm/tierpoint-<uid>`` where a RAM disk exists, else the temp directory.

    Both are shared by every user of the machine, so the root, where it exists, must be this
    user's own directory (not a link): one another user made first could have its entries swapped
    for theirs. :class:`CheckpointingError` otherwise."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    root = base / f"tierpoint-{os.getuid()}"
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return root
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = (
            "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else "not a directory"
            if not stat.S_ISDIR(st.st_mode)
            else f"owned by uid {st.st_uid}"
        )
        raise CheckpointingError(
            f"the default local tier root {root} is {what}, not this user's (uid {os.getuid()}) "
            "directory: another user may have made it. Remove it, or pass a root of your own"
        )
    return root


def local_root(value: object) -> str:
    """The root a caller named, as a local path: a URL (the local tier lives on this node's RAM
    disk or SSD) or anything that is not a path is a clear error."""
    text = storage.checkpoint_path(value, "root_local_ckpt_dir")
    if not storage.is_local(text):
        raise CheckpointingError(
            f"root_local_ckpt_dir must be a local path (a RAM disk or a local SSD), got {text!r}: "
            "object stores hold the persistent tier"
        )
    return storage.local_path(text)


def validate_session_id(session_id: str) -> str:
    if (
        not isinstance(session_id, str)
        or not _SESSION_RE.fullmatch(session_id)
        or session_id in (".", "..")
    ):
        raise CheckpointingError(
            f"invalid session_id {session_id!r}: use letters, digits, '_', '-' and '.', without separators or '..'"
        )
    return session_id


def check_iteration(iteration: object) -> int:
    """``iteration`` as an int: any non-negative integer (numpy's too), never a bool or a float."""
    if isinstance(iteration, (bool, np.bool_)) or not isinstance(iteration, numbers.Integral):
        raise CheckpointingError(
            f"iteration must be a non-negative integer, got {type(iteration).__name__} {iteration!r}"
        )
    if iteration < 0:
        raise CheckpointingError(f"iteration must be a non-negative integer, got {iteration!r}")
    return int(iteration)


def part_name(iteration: int, origin_rank: int) -> str:
    return f"iter_{iteration:07d}_{origin_rank}_local{EXTENSION}"


def parse_part_name(name: str) -> tuple[int, int] | None:
    """``(iteration, origin rank)`` for a committed part file name, else ``None``."""
    m = _PART_RE.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_dirty_name(name: str) -> bool:
    return name.endswith(DIRTY_SUFFIX) and parse_part_name(name[: -len(DIRTY_SUFFIX)]) is not None


def is_spare_name(name: str) -> bool:
    return _SPARE_RE.fullmatch(name) is not None


def spare_name(n: int) -> str:
    return f"spare_{n}.free"


def metadata_names(meta: dict, iteration: int, rank: int) -> bool:
    """Whether a part's header metadata names ``iteration`` and ``rank`` (as integers: ``true``
    or ``1.0`` in a crafted header is not rank 1)."""
    found = (meta.get("iteration"), meta.get("rank"))
    return all(type(v) is int for v in found) and found == (iteration, rank)


def part_world_size(path: str | os.PathLike, iteration: int, origin: int) -> int:
    """The world size a part file was saved with, once its header is valid and its metadata agrees
    with its name; :class:`CorruptCheckpointError` otherwise."""
    return part_metadata(path, iteration, origin)["world_size"]


def part_metadata(path: str | os.PathLike, iteration: int, origin: int) -> dict:
    """A part file's header metadata, once its header is valid and its metadata agrees with its
    name and names a valid world size; :class:`CorruptCheckpointError` otherwise."""
    meta = fileformat.read_header(path).extra
    if not metadata_names(meta, iteration, origin):
        raise CorruptCheckpointError(str(path), "file name disagrees with its metadata")
    world = meta.get("world_size")
    if type(world) is not int or not 1 <= world <= MAX_WORLD_SIZE:
        raise CorruptCheckpointError(str(path), f"bad world size in metadata: {str(world)[:40]}")
    return meta


def file_version(st: os.stat_result) -> tuple[int, int, int]:
    """What identifies one version of a file: inode, size, mtime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def version_of(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """The file's :func:`file_version`, or ``None`` when it cannot be seen."""
    try:
        return file_version(os.stat(path))
    except OSError:
        return None
