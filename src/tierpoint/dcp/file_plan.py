"""Where one rank's share of a DCP checkpoint goes: which ``.distcp`` file, at which offset.

Call order: ``plan_files(final_local_plan, prefix, thread_count)`` once per layout (the result depends
only on the plan, so it is reused while the plan is unchanged); the save's write results follow from
it once the non-tensor values are serialized (:mod:`tierpoint.dcp.write_results`).

File format (what torch's ``FileSystemReader`` reads): each tensor is a ``torch.save`` record (see
:mod:`tierpoint.dcp.torch_save_bytes`) starting at a 64-byte aligned offset, so its data is 64-byte
aligned in the file; gaps between records are zero bytes. Non-tensor values (``torch.save`` bytes of
the object, as torch DCP writes them) follow the tensors of the first file, back to back. Files are
named ``<prefix><k>.<token>.distcp`` (``prefix`` is ``__<rank>_`` as in torch's names; ``token`` is
new for every save, see :meth:`RankFiles.with_token`).

Invariants:
- Tensors are spread over at most ``thread_count`` files, largest first onto the least-filled file,
  so that one writer thread per file finishes at about the same time.
- The tensor section of every file is a fixed byte layout (heads, tails and padding depend only on
  dtypes and shapes): :attr:`RankFiles.staging_bytes` bytes hold all files' tensor sections back to
  back, each starting page-aligned (so the staged range of a file can go to the device as it is,
  see :mod:`tierpoint.storage.direct`); a staged copy of a file is one contiguous range.
- A save's data files carry its token in their names, so a file of an earlier save into the same
  directory never passes for one of this save's: not on a node that missed the save (node-local
  disks), not under any name ``.metadata`` refers to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ..storage import direct as direct_write
from .torch_save_bytes import RecordTemplate, aligned, record_template

SUFFIX = ".distcp"


@dataclass(frozen=True)
class TensorSlot:
    """One tensor record: plan item ``item`` (a tensor of ``dtype`` and ``shape``) at file offset
    ``offset``."""

    item: int
    offset: int
    template: RecordTemplate
    dtype: torch.dtype
    shape: torch.Size

    @property
    def data_offset(self) -> int:
        return self.offset + len(self.template.head)


@dataclass(frozen=True)
class FileSpec:
    """One ``.distcp`` file: its tensors, then the non-tensor values ``byte_items``."""

    name: str
    tensors: tuple[TensorSlot, ...]
    tensor_bytes: int
    byte_items: tuple[int, ...]
    staging_base: int


@dataclass(frozen=True)
class RankFiles:
    """All files one rank writes for one plan."""

    files: tuple[FileSpec, ...]
    staging_bytes: int
    key: tuple
    """Identifies the tensor layout: equal keys mean identical staging layouts."""

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.files]

    def views(self, staging: torch.Tensor) -> list[torch.Tensor]:
        """The place of each tensor that has bytes in ``staging`` (uint8, :attr:`staging_bytes`
        long), viewed as that tensor, in file and slot order."""
        views = []
        for f in self.files:
            for s in f.tensors:
                if s.template.nbytes:
                    at = f.staging_base + s.data_offset
                    views.append(staging[at : at + s.template.nbytes].view(s.dtype).view(s.shape))
        return views

    def with_token(self, token: str) -> RankFiles:
        """The same files named for the save ``token`` (the layout ``key`` stays the same)."""
        if not token:
            return self
        files = tuple(replace(f, name=add_token(f.name, token)) for f in self.files)
        return replace(self, files=files)


def add_token(name: str, token: str) -> str:
    """``__0_1.distcp`` -> ``__0_1.<token>.distcp``."""
    return f"{name.removesuffix(SUFFIX)}.{token}{SUFFIX}" if token else name


def remove_token(name: str, token: str) -> str:
    """The inverse of :func:`add_token` (a name without ``token`` is returned as it is)."""
    tagged = f".{token}{SUFFIX}"
    return name.removesuffix(tagged) + SUFFIX if token and name.endswith(tagged) else name


def _slot(item: int, offset: int, template: RecordTemplate, plan: SavePlan) -> TensorSlot:
    data = plan.items[item].tensor_data
    return TensorSlot(item, offset, template, data.properties.dtype, torch.Size(data.chunk.sizes))


def _template(item) -> RecordTemplate:  # noqa: ANN001 - a torch WriteItem
    data = item.tensor_data
    return record_template(data.properties.dtype, tuple(int(s) for s in data.chunk.sizes))


def plan_files(plan: SavePlan, prefix: str, thread_count: int) -> RankFiles:
    """Assign ``plan``'s items to files (see the module docstring)."""
    bins = max(1, int(thread_count))
    tensor_items = [i for i, it in enumerate(plan.items) if it.type != WriteItemType.BYTE_IO]
    byte_items = tuple(i for i, it in enumerate(plan.items) if it.type == WriteItemType.BYTE_IO)
    templates = {i: _template(plan.items[i]) for i in tensor_items}
    members: list[list[int]] = [[] for _ in range(bins)]
    fill = [0] * bins
    for i in sorted(tensor_items, key=lambda i: (-templates[i].nbytes, i)):
        b = min(range(bins), key=lambda k: (fill[k], k))
        members[b].append(i)
        fill[b] += aligned(templates[i].length)
    used = [m for m in members if m] or [[]]
    files: list[FileSpec] = []
    base = 0
    for k, items in enumerate(used):
        slots: list[TensorSlot] = []
        offset = 0
        for i in items:
            slots.append(_slot(i, offset, templates[i], plan))
            offset = aligned(offset + templates[i].length)
        end = slots[-1].offset + slots[-1].template.length if slots else 0
        files.append(
            FileSpec(f"{prefix}{k}{SUFFIX}", tuple(slots), end, byte_items if k == 0 else (), base)
        )
        base = direct_write.round_up(base + end)
    key = tuple(
        (f.name, tuple((s.offset, s.template) for s in f.tensors), f.staging_base) for f in files
    )
    return RankFiles(tuple(files), base, key)


_RECORD_OVERHEAD = 16 << 10
"""More than a torch.save record adds to a tensor's bytes (its zip entries and pickle), and more
than a file's start costs (rounded up for direct I/O)."""


def staging_bound(tensor_bytes: Sequence[int], max_files: int = 64) -> int:
    """An upper bound of :attr:`RankFiles.staging_bytes` for a plan of tensors of these sizes (or
    of some of them) in at most ``max_files`` files, without planning."""
    return sum(aligned(n) + _RECORD_OVERHEAD for n in tensor_bytes) + max_files * direct_write.ALIGN


def padding(gap: int) -> bytes:
    return bytes(gap) if gap > 0 else b""


def file_views(spec: FileSpec, data: Sequence[Any]) -> list[Any]:
    """The tensor section of ``spec`` as views: zero padding, head, ``data[k]``, tail per tensor
    (``data[k]``: a view of tensor ``k``'s bytes, or whatever stands for it)."""
    out: list[Any] = []
    pos = 0
    for slot, raw in zip(spec.tensors, data):
        if slot.offset > pos:
            out.append(padding(slot.offset - pos))
        out.append(slot.template.head)
        out.append(raw)
        out.append(slot.template.tail)
        pos = slot.offset + slot.template.length
    return out
