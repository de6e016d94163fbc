"""The allow-list of a DCP ``.metadata`` pickle: the globals torch's writers put there, each
mapped to an inert stand-in.

The globals were found by disassembling files written by ``dcp.save`` with DTensor, ShardedTensor,
bytes, int, str and nested states; none resolves to a torch class or function:

- the DCP dataclasses (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
  ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, the
  filesystem writer's ``_StorageInfo`` and ``_StoragePrefix``, and the save-plan classes
  ``SavePlan``, ``WriteItem``, ``TensorWriteData`` and ``BytesIOWriteData`` that NVRx's cached
  planning stores in ``Metadata.all_local_plans``) become private record classes
  (:data:`RECORDS`) that only keep the state the pickle hands them; a ``BUILD`` aimed at a record
  class itself (to patch a class) fails; older torch releases named ``TensorProperties`` (and its
  memory-format enum) in ``torch.distributed._shard.sharded_tensor.metadata``: the same stand-ins;
- ``torch.Size``, the memory-format enum, ``torch.serialization._get_layout`` and ``pathlib``
  paths become small functions that check their arguments and return inert values;
- dtypes resolve to the ``torch.dtype`` objects themselves, and ``WriteItemType`` to a function
  returning one of its three members.

Call order: :data:`METADATA_PICKLE` is the :class:`~tierpoint.dcp.restricted_pickle.AllowList`
that :func:`tierpoint.dcp.safe_pickle.safe_loads` loads with; a refusal raises :class:`Refused`.
:mod:`tierpoint.dcp.metadata_check` then checks the records and builds the torch objects.

Invariants: a stand-in never calls into torch beyond building a ``torch.Size`` of checked ints;
every other global stops the load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner

from .restricted_pickle import DTYPES, MAX_DIMS, AllowList, brief

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
_SHARD_MODULE = "torch.distributed._shard.sharded_tensor.metadata"
"""Where older torch releases' DCP metadata took ``TensorProperties`` from (torch still loads them)."""


class Refused(Exception):
    """The pickle asked for something outside the allow-list (raised from inside the pickle machine)."""


class Record:
    """Stand-in for one torch DCP dataclass instance: keeps the state BUILD gives it, nothing else."""

    __slots__ = ("state",)
    real: type

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _record_class(real: type) -> type[Record]:
    return type(f"_{real.__name__}Record", (Record,), {"__slots__": (), "real": real})


RECORDS: dict[type, type[Record]] = {
    cls: _record_class(cls)
    for module, names in (
        (metadata, "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata"),
        (metadata, "TensorProperties MetadataIndex StorageMeta"),
        (filesystem, "_StorageInfo _StoragePrefix"),
        (planner, "SavePlan WriteItem TensorWriteData BytesIOWriteData"),
    )
    for cls in (getattr(module, name) for name in names.split())
}
"""Each DCP dataclass -> its record class."""


def _size(dims: Any = ()) -> torch.Size:
    if type(dims) not in (tuple, list) or len(dims) > MAX_DIMS:
        raise Refused(f"torch.Size of {type(dims).__name__} (want a short tuple of ints)")
    for d in dims:
        if type(d) is not int or d < 0:
            raise Refused(f"torch.Size with a negative or non-int entry: {brief(dims)}")
    return torch.Size(dims)


class MemFormatCode(int):
    """The value of torch's ``_MEM_FORMAT_ENCODING`` enum, kept as an int until conversion."""


MEMORY_FORMATS = {
    0: torch.contiguous_format,
    1: torch.channels_last,
    2: torch.preserve_format,
}
"""Each memory format code -> the memory format."""


def _mem_format(value: Any) -> MemFormatCode:
    if type(value) is not int or value not in MEMORY_FORMATS:
        raise Refused(f"unknown memory format code {brief(value, 40)}")
    return MemFormatCode(value)


_LAYOUTS = {
    f"torch.{name}": obj for name, obj in vars(torch).items() if isinstance(obj, torch.layout)
}


def _layout(name: Any) -> torch.layout:
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise Refused(f"unknown layout {brief(name, 40)}")
    return _LAYOUTS[name]


def _path_of(flavour: type) -> Callable[..., str]:
    def build(*parts: Any) -> str:
        if not all(isinstance(p, str) for p in parts):
            raise Refused("a path made of something other than strings")
        return str(flavour(*parts))

    return build


def _write_item_type(value: Any) -> planner.WriteItemType:
    if type(value) is not int or value not in {t.value for t in planner.WriteItemType}:
        raise Refused(f"unknown WriteItemType {brief(value, 40)}")
    return planner.WriteItemType(value)


_ALLOWED: dict[tuple[str, str], Any] = {
    (cls.__module__, cls.__name__): rec for cls, rec in RECORDS.items()
}
_ALLOWED.update(
    {
        (_PLANNER_MODULE, "WriteItemType"): _write_item_type,
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): _mem_format,
        # Files of older torch releases: the same state (a tuple), the class in its older home.
        (_SHARD_MODULE, "TensorProperties"): RECORDS[metadata.TensorProperties],
        (_SHARD_MODULE, "MEM_FORMAT_ENCODING"): _mem_format,
        ("torch", "Size"): _size,
        ("torch.serialization", "_get_layout"): _layout,
        # StorageMeta.checkpoint_id is the path the writer was given, often a pathlib.Path.
        ("pathlib", "PosixPath"): _path_of(PurePosixPath),
        ("pathlib", "PurePosixPath"): _path_of(PurePosixPath),
        ("pathlib", "WindowsPath"): _path_of(PureWindowsPath),
        ("pathlib", "PureWindowsPath"): _path_of(PureWindowsPath),
    }
)
_ALLOWED.update(DTYPES)

METADATA_PICKLE = AllowList(
    globals=_ALLOWED,
    refuse=Refused,
    no_persistent="forbidden persistent id (a .metadata file has none)",
)
"""What a ``.metadata`` pickle may name; it may hold no persistent id."""
