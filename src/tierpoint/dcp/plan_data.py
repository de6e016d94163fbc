"""The data of a planned DCP save on one rank: the tensors and serialized values the planner
resolves for this rank's items, and the file layouts of recent plans.

Call order (inside :class:`~tierpoint.dcp.writer.Writer`): :func:`files_for` lays out the files of
a final local plan (memoised with :class:`PlanMemo`: a cached central plan is the same object at
every save); writing then resolves each item's data (:func:`planned_tensors`,
:func:`resolve_bytes`, or the views a synchronous save writes: :func:`file_contents`) and sizes the
serialized values (:func:`byte_sizes`) for the write results.

Invariants: a planned tensor item resolves to a tensor and a planned bytes item to bytes, else a
:class:`~tierpoint.errors.CheckpointingError` names the item; nothing here copies a tensor's bytes
(:func:`byte_view` is a view).
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from ..errors import CheckpointingError
from ..fileformat.tensor_bytes import cpu_contiguous
from .file_plan import RankFiles, file_views, plan_files

T = TypeVar("T")


class PlanMemo(Generic[T]):
    """Values worked out from a plan (and a key), kept for the last few plans: a cached central
    plan (or global metadata) is the same object at every save. Held with the plan itself, so a
    recycled ``id`` never answers for another plan. Thread-safe (an overlapped snapshot runs on the
    queue's thread)."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._items: OrderedDict[tuple, tuple[object, T]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, plan: object, key: Hashable, make: Callable[[], T]) -> T:
        """The value for ``plan`` and ``key``: ``make()`` the first time."""
        full = (id(plan), key)
        with self._lock:
            hit = self._items.get(full)
            if hit is not None and hit[0] is plan:
                self._items.move_to_end(full)
                return hit[1]
        value = make()
        with self._lock:
            self._items[full] = (plan, value)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


_FILES: PlanMemo[RankFiles] = PlanMemo()


def files_for(plan: SavePlan, prefix: str, thread_count: int) -> RankFiles:
    """``plan_files`` memoised on the plan object (a cached central plan is the same object)."""
    return _FILES.get(plan, thread_count, lambda: plan_files(plan, prefix, thread_count))


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def planned_tensors(plan: SavePlan, planner: SavePlanner) -> list[torch.Tensor | None]:
    """The tensor of each plan item as the planner resolves it (``None`` for a bytes item), not
    detached: the snapshot copies without autograd (a detached alias would be one more object per
    tensor and save); a synchronous write detaches what it views as bytes."""
    out: list[torch.Tensor | None] = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            out.append(None)
            continue
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise CheckpointingError(f"{item.index.fqn}: planned a tensor, got {type(data)}")
        out.append(data)
    return out


def resolve_bytes(plan: SavePlan, planner: SavePlanner, files: RankFiles) -> list[list[bytes]]:
    """The serialized non-tensor values, per file."""
    out: list[list[bytes]] = []
    for f in files.files:
        records = []
        for i in f.byte_items:
            data = planner.resolve_data(plan.items[i])
            if isinstance(data, io.BytesIO):
                records.append(data.getvalue())
            elif isinstance(data, (bytes, bytearray)):
                records.append(bytes(data))
            else:
                raise CheckpointingError(
                    f"{plan.items[i].index.fqn}: planned bytes, got {type(data)}"
                )
        out.append(records)
    return out


def file_contents(
    plan: SavePlan, planner: SavePlanner, files: RankFiles, byte_records: list[list[bytes]]
) -> list[tuple[str, list]]:
    """``(name, the views of its contents)`` per file of a synchronous save: the live tensors (made
    contiguous on the CPU where they are not), then the serialized values."""
    contents = []
    tensors = planned_tensors(plan, planner)
    for k, f in enumerate(files.files):
        data = []
        for slot in f.tensors:
            t = tensors[slot.item]
            assert t is not None  # a tensor slot holds a tensor item
            data.append(cpu_contiguous(t.detach()))  # viewed as bytes: no autograd
        views = file_views(f, [byte_view(t) for t in data])
        contents.append((f.name, [*views, *byte_records[k]]))
    return contents


def byte_sizes(files: RankFiles, byte_records: list[list[bytes]]) -> dict[int, int]:
    """The size of every serialized value, by item index."""
    return {
        i: len(b)
        for f, records in zip(files.files, byte_records)
        for i, b in zip(f.byte_items, records)
    }
