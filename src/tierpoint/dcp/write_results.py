"""One rank's write results of a DCP save, kept in the form the commit sends them.

Call order (inside :class:`~tierpoint.dcp.writer.Writer`): once the non-tensor values are
serialized (their sizes vary from save to save), :func:`results_for` gives the save's
:class:`Results`; the worker hashes :meth:`Results.ranges` of each data file; the commit
(:mod:`tierpoint.dcp.commit`) sends :attr:`Results.rows` and compares :attr:`Results.digest` with
the last commit's; :func:`decode` makes torch's ``WriteResult`` objects where they are asked for
(torch's own ``save`` flow, and the coordinator's ``.metadata``).

Invariants: rows name the data files without the save's token, so that they depend only on the
plan, the file layout and the sizes of the serialized values: a save of an unchanged layout gets
the very same :class:`Results` as the last one. Nothing is built per save, and nothing stays alive
through a save for Python's garbage collector to count (for a state of 1150 tensors, about 3,500
objects a save otherwise, promoted to the oldest generation while the save runs and so bringing on
full collections of the training process). Rows are tuples (shared, read-only).
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from .file_plan import RankFiles, add_token, remove_token
from .plan_data import PlanMemo

Row = tuple
"""``(fqn, chunk offset or None, index, size, data file without token, file offset, length)``: one
item's write result, as JSON carries it (a list there)."""


@dataclass(frozen=True)
class Results:
    """One rank's write results for one plan, file layout and serialized values' sizes."""

    rows: tuple[Row, ...]
    file_ranges: dict[str, list[tuple[int, int]]]
    """``(offset, length)`` of every item in each data file (named without token), in file order."""

    @functools.cached_property
    def digest(self) -> str:
        """xxh3-128 of the rows' JSON (what a commit remembers of them), computed once."""
        return digest(self.rows)

    def ranges(self, token: str) -> dict[str, list[tuple[int, int]]]:
        """:attr:`file_ranges` by the data files' names for the save ``token``."""
        return {add_token(name, token): r for name, r in self.file_ranges.items()}


def digest(rows: object) -> str:
    """xxh3-128 of ``rows`` as JSON (tuples and lists alike)."""
    return xxhash.xxh3_128_hexdigest(json.dumps(rows).encode())


_RESULTS: PlanMemo[Results] = PlanMemo()


def results_for(
    plan: SavePlan, files: RankFiles, byte_sizes: dict[int, int], token: str
) -> Results:
    """The write results of ``plan`` laid out as ``files`` (named for the save ``token``), given
    the size of each serialized value by item; the same object while all of that is unchanged."""
    key = (files.key, tuple(byte_sizes.items()))
    return _RESULTS.get(plan, key, lambda: _results(plan, files, byte_sizes, token))


def _results(plan: SavePlan, files: RankFiles, byte_sizes: dict[int, int], token: str) -> Results:
    rows: list[Row] = []
    ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def add(item: int, name: str, offset: int, length: int) -> None:
        idx = plan.items[item].index
        chunk = list(idx.offset) if idx.offset is not None else None
        rows.append((idx.fqn, chunk, idx.index, length, name, offset, length))
        ranges[name].append((offset, length))

    for f in files.files:
        name = remove_token(f.name, token)
        for slot in f.tensors:
            add(slot.item, name, slot.offset, slot.template.length)
        offset = f.tensor_bytes
        for i in f.byte_items:
            add(i, name, offset, byte_sizes[i])
            offset += byte_sizes[i]
    return Results(tuple(rows), {name: sorted(r) for name, r in ranges.items()})


def decode(rows: object, token: str) -> list[WriteResult]:
    """torch's ``WriteResult`` of every row (from :attr:`Results.rows` or their JSON), the data
    files named for the save ``token``."""
    return [
        WriteResult(index=index, size_in_bytes=size, storage_data=place)
        for index, size, place in decoded(rows, token)
    ]


def decoded(rows: object, token: str) -> Iterator[tuple[MetadataIndex, int, _StorageInfo]]:
    """``(index, size, place)`` of every row, the data files named for the save ``token`` (one
    name string per file, which a pickle then holds once)."""
    names: dict[str, str] = {}
    for fqn, offset, index, size, path, file_offset, length in rows:  # type: ignore[attr-defined]
        name = names.get(path)
        if name is None:
            name = names[path] = add_token(path, token)
        yield MetadataIndex(fqn, offset, index), size, _StorageInfo(name, file_offset, length)
