"""The rules a DCP ``.metadata`` keeps across its fields, checked before anything is built
from it: plain data bounded and acyclic, each tensor's chunks tiling it exactly once, no two
storage items sharing bytes of a file, storage file names that are plain names.

Call order: :mod:`tierpoint.dcp.metadata_check` calls these while it walks the records; each
rule raises :class:`BadField` (the message names the field) or returns the answer.

Invariants: hostile sizes cannot make a check hang or exhaust memory (:data:`MAX_DEPTH`,
:data:`MAX_TILING_CELLS`); values are quoted only through
:func:`~tierpoint.dcp.restricted_pickle.brief`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from .metadata_globals import Record
from .restricted_pickle import brief

MAX_DEPTH = 64
"""Deepest nesting of plain containers accepted in ``planner_data``."""
MAX_TILING_CELLS = 1 << 22
"""Most cells the chunk-tiling check may draw beyond one per chunk (see ``chunks_tile``)."""


class BadField(Exception):
    """A structurally wrong field; the message says which."""


def file_name_problem(name: Any) -> str | None:
    """Why ``name`` is not a plain file name inside the checkpoint directory (None if it is)."""
    if not isinstance(name, str) or not name:
        return f"storage file name {brief(name)} is not a non-empty string"
    if name in (".", "..") or any(c in name for c in "/\\\0:"):
        return f"storage file name {brief(name)} is not a plain name in the checkpoint directory"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return f"storage file name {brief(name)} is not valid UTF-8"
    return None


def check_plain(obj: Any, where: str) -> None:
    """Refuse ``obj`` (:class:`BadField`) unless it is plain data: None, bool, int, float, str,
    bytes, and lists, tuples and dicts of those, acyclic, at most :data:`MAX_DEPTH` deep. A
    container shared by several parents is checked once."""
    _height(obj, where, 0, set(), {})


def _height(obj: Any, where: str, depth: int, active: set[int], heights: dict[int, int]) -> int:
    """How deep the plain containers in ``obj`` nest (0 for a scalar); ``heights`` remembers the
    containers already measured, so memo-shared containers cost once, not once per path."""
    kind = type(obj)
    if obj is None or kind in _SCALARS:
        return 0
    if kind not in (list, tuple, dict):
        raise BadField(f"{where} holds {describe(obj)}, want plain data")
    known = heights.get(id(obj))
    if known is None:
        if depth >= MAX_DEPTH or id(obj) in active:
            raise BadField(f"{where} nests too deep or refers to itself")
        active.add(id(obj))
        children = [v for kv in obj.items() for v in kv] if kind is dict else obj
        known = 1 + max(
            (_height(v, where, depth + 1, active, heights) for v in children), default=0
        )
        active.discard(id(obj))
        heights[id(obj)] = known
    if depth + known > MAX_DEPTH:
        raise BadField(f"{where} nests too deep or refers to itself")
    return known


_SCALARS = frozenset((bool, int, float, str, bytes))


def check_disjoint(storage: dict[MetadataIndex, _StorageInfo]) -> None:
    """No two items may share bytes of a file (a writer never stores anything twice)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for info in storage.values():
        if info.length:
            spans.setdefault(info.relative_path, []).append(
                (info.offset, info.offset + info.length)
            )
    for name, pairs in spans.items():
        pairs.sort()
        for (a, end), (b, _) in zip(pairs, pairs[1:]):
            if b < end:
                fqns = sorted(
                    {i.fqn for i, info in storage.items() if info.relative_path == name}
                    & {i.fqn for i, info in storage.items() if info.offset in (a, b)}
                )
                raise BadField(
                    f"storage_data: items of {brief(fqns)} overlap in {brief(name)}"
                    f" (bytes [{a}, {end}) and from {b})"
                )


def chunks_tile(size: torch.Size, chunks: list[ChunkStorageMetadata]) -> bool:
    """Whether ``chunks`` (each inside the tensor) cover a tensor of ``size`` exactly once."""
    boxes = [c for c in chunks if all(c.sizes)]
    if sum(math.prod(c.sizes) for c in boxes) != math.prod(size):
        return False
    if len(boxes) < 2:
        return True
    # The volumes add up, so the chunks tile the tensor iff no two overlap. Cutting every dim at
    # every chunk boundary makes each chunk a block of whole cells; no cell may be drawn twice.
    starts = np.array([c.offsets for c in boxes], dtype=np.int64)
    ends = starts + np.array([c.sizes for c in boxes], dtype=np.int64)
    cuts = [np.unique(np.concatenate((starts[:, d], ends[:, d]))) for d in range(len(size))]
    first = np.stack([np.searchsorted(c, starts[:, d]) for d, c in enumerate(cuts)], axis=1)
    last = np.stack([np.searchsorted(c, ends[:, d]) for d, c in enumerate(cuts)], axis=1)
    if (last - first == 1).all():  # the usual grid: one cell per chunk, so no cell may repeat
        return len(np.unique(first, axis=0)) == len(boxes)
    shape = [len(c) - 1 for c in cuts]
    if math.prod(shape) > len(boxes) + MAX_TILING_CELLS:
        return False
    drawn = np.zeros(shape, dtype=np.int32)
    for lo, hi in zip(first.tolist(), last.tolist()):
        drawn[tuple(map(slice, lo, hi))] += 1
    return int(drawn.max()) == 1


def describe(obj: Any) -> str:
    if isinstance(obj, Record):
        return f"a {type(obj).real.__name__}"
    return f"{type(obj).__name__} {obj!r:.60}" if obj is None else type(obj).__name__
