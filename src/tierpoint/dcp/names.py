"""What the persistent tier's files and directories are called: step directories, unfinished
markers, ``.metadata``, and the checkpoint location a caller gives.

Call order: none; pure functions and constants, imported by every module of the tier that names a
file (:mod:`~tierpoint.dcp.step_dirs`, :mod:`~tierpoint.dcp.writer`, :mod:`~tierpoint.dcp.reader`,
:mod:`~tierpoint.dcp.peer_fetch`, ...), so that none of them imports another only for a name.

Invariants: a step directory is ``step-<N>`` (ML Flashpoint's ``step-<N>_ckpt`` is recognised);
rank ``r``'s marker is ``.unfinished-<r>``; ML Flashpoint's markers are siblings of their directory
named ``<dir>...unfinished`` (:data:`UNKNOWN_RANK` where the name gives no local rank). This module
does no I/O.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from .. import storage
from ..errors import CheckpointingError

STEP_PREFIX = "step-"
METADATA_NAME = ".metadata"
MARKER_PREFIX = ".unfinished-"

_STEP = re.compile(r"^step-([0-9]+)$")
_MARKER = re.compile(r"^\.unfinished-([0-9]+)$")
_FLASHPOINT_STEP = re.compile(r"^step-([0-9]+)_ckpt$")
_FLASHPOINT_MARKER = re.compile(r"^(step-[0-9]+_ckpt)(.+)unfinished$")
_LOCAL_RANK = re.compile(r"__([0-9]+)__")
UNKNOWN_RANK = -1
"""The rank recorded for an unfinished marker whose name gives none."""


def step_path(base: str | os.PathLike, step: int) -> str:
    """The directory (or URL prefix) of step ``step`` under ``base``."""
    if type(step) is not int or step < 0:
        raise CheckpointingError(f"step must be a non-negative int, got {step!r:.40}")
    return storage.join(base, f"{STEP_PREFIX}{int(step)}")


def step_of(name: str) -> int | None:
    """The step number of a ``step-<N>`` name, else ``None``."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def step_dir_of(name: str) -> int | None:
    """The step number of a ``step-<N>`` or ML Flashpoint ``step-<N>_ckpt`` name, else ``None``."""
    m = _STEP.match(name) or _FLASHPOINT_STEP.match(name)
    return int(m.group(1)) if m else None


def sibling_markers(names: Sequence[str]) -> dict[str, list[int]]:
    """ML Flashpoint's unfinished markers among the entries ``names`` of a base directory:
    ``{step directory name: [local ranks]}`` (:data:`UNKNOWN_RANK` where a name gives none)."""
    out: dict[str, set[int]] = {}
    for name in names:
        m = _FLASHPOINT_MARKER.match(name)
        if m:
            rank = _LOCAL_RANK.search(m.group(2))
            out.setdefault(m.group(1), set()).add(int(rank.group(1)) if rank else UNKNOWN_RANK)
    return {k: sorted(v) for k, v in out.items()}


def sibling_markers_of(dir_name: str, names: Iterable[str]) -> list[str]:
    """The ML Flashpoint unfinished markers of the step directory ``dir_name`` among ``names`` (its
    parent's entries), sorted; none unless ``dir_name`` is a ``step-<N>_ckpt`` name."""
    return sorted(
        n
        for n in names
        if (m := _FLASHPOINT_MARKER.match(n)) is not None and m.group(1) == dir_name
    )


def marker_name(rank: int) -> str:
    """The name of rank ``rank``'s unfinished marker inside a checkpoint directory."""
    return f"{MARKER_PREFIX}{int(rank)}"


def markers_in(names: Iterable[str]) -> list[str]:
    """The unfinished markers among ``names`` (a directory's listing), sorted."""
    return sorted(n for n in names if n.startswith(MARKER_PREFIX))


def marker_rank(name: str) -> int | None:
    """The rank of an unfinished marker's name ``.unfinished-<rank>``, else ``None``."""
    m = _MARKER.match(name)
    return int(m.group(1)) if m else None


def checkpoint_id_or_path(
    path: str | os.PathLike | None, checkpoint_id: str | os.PathLike | None, where: str
) -> Any:
    """The checkpoint location given either positionally (tierpoint's form) or as
    ``checkpoint_id=`` (torch DCP's keyword); a clear ``TypeError`` when both are given. Neither
    gives ``None``, which :func:`tierpoint.storage.checkpoint_path` then refuses with a hint (a
    ``None`` from :func:`~tierpoint.dcp.get_latest_complete_checkpoint` passed on is the usual
    cause)."""
    if path is not None and checkpoint_id is not None:
        raise TypeError(
            f"{where}: got the checkpoint location twice, positionally ({path!r:.200}) "
            f"and as checkpoint_id ({checkpoint_id!r:.200}); give one"
        )
    return path if path is not None else checkpoint_id
