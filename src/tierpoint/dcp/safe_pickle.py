"""Load a torch DCP ``.metadata`` pickle without running anything the file asks for.

torch writes a checkpoint's ``.metadata`` with ``pickle.dump(Metadata(...))``; ``pickle.load`` on it
would call any function the file names. ``safe_loads(data, what)`` instead runs the pickle machine
with an allow-list: the only globals a file may name are the ones torch's own writers put there
(found by disassembling files written by ``dcp.save`` with DTensor, ShardedTensor, bytes, int, str
and nested states), and none of them resolves to a torch class or function. Each resolves to a
stand-in:

- the DCP dataclasses (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
  ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, the
  filesystem writer's ``_StorageInfo`` and ``_StoragePrefix``, and the save-plan classes ``SavePlan``,
  ``WriteItem``, ``TensorWriteData`` and ``BytesIOWriteData`` that NVRx's cached planning stores in
  ``Metadata.all_local_plans``) become private record classes that only keep the state the
  pickle hands them; a ``BUILD`` aimed at a record class itself (to patch a class) fails;
- ``torch.Size``, the memory-format enum, ``torch.serialization._get_layout`` and ``pathlib`` paths
  become small functions that check their arguments and return inert values;
- dtypes resolve to the ``torch.dtype`` objects themselves (immutable, not callable), and
  ``WriteItemType`` to a function returning one of its three members.

Every other global (``os.system``, ``builtins.eval``, ``getattr``, ``functools.partial``, torch's
tensor rebuild functions, ``torch.load``, ...) stops the load with :class:`CorruptCheckpointError`
naming the file and the global, before anything is called. After the pickle machine stops, the
records are checked field by field (types, known field names, non-negative sizes, chunks inside their
tensor, storage file names that are plain names, non-negative offsets and lengths, no duplicates) and
only then turned into real torch objects by this module's own code.

Call order: ``safe_loads(data, what)`` -> ``Metadata``. ``what`` names the source in errors.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
from collections.abc import Callable
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ..errors import CorruptCheckpointError

MAX_DEPTH = 64
"""Deepest nesting of plain containers accepted in ``planner_data``."""
MAX_DIMS = 64
MAX_INT = (1 << 63) - 1
"""Largest offset, length or index accepted (a file offset must fit an ``off_t``)."""
MAX_TILING_CELLS = 1 << 22
"""Most cells the chunk-tiling check may draw beyond one per chunk (see ``_chunks_tile``)."""

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
MAX_PLANS = 1 << 20
"""Most local plans accepted in ``Metadata.all_local_plans`` (one per rank)."""


class CorruptDCPError(CorruptCheckpointError):
    """A DCP checkpoint file (``path``) is malformed, truncated, hostile or missing (``reason``).

    Unlike its base class it survives pickling, which torch DCP needs: it gathers every rank's
    exception with ``all_gather_object`` and raises them together as a ``CheckpointException``.
    """

    def __reduce__(self) -> tuple[type, tuple[Any, str]]:
        return type(self), (self.path, self.reason)


class _Refused(Exception):
    """The pickle asked for something outside the allow-list (raised from inside the pickle machine)."""


class _Record:
    """Stand-in for one torch DCP dataclass instance: keeps the state BUILD gives it, nothing else."""

    __slots__ = ("state",)
    real: type

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _record_class(real: type) -> type[_Record]:
    return type(f"_{real.__name__}Record", (_Record,), {"__slots__": (), "real": real})


_RECORDS: dict[type, type[_Record]] = {
    cls: _record_class(cls)
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _StorageInfo,
        _StoragePrefix,
        SavePlan,
        WriteItem,
        TensorWriteData,
        BytesIOWriteData,
    )
}


def _size(dims: Any = ()) -> torch.Size:
    if type(dims) not in (tuple, list) or len(dims) > MAX_DIMS:
        raise _Refused(f"torch.Size of {type(dims).__name__} (want a short tuple of ints)")
    for d in dims:
        if type(d) is not int or d < 0:
            raise _Refused(f"torch.Size with a negative or non-int entry: {brief(dims)}")
    return torch.Size(dims)


class _MemFormatCode(int):
    """The value of torch's ``_MEM_FORMAT_ENCODING`` enum, kept as an int until conversion."""


_MEMORY_FORMATS = {
    0: torch.contiguous_format,
    1: torch.channels_last,
    2: torch.preserve_format,
}


def _mem_format(value: Any) -> _MemFormatCode:
    if type(value) is not int or value not in _MEMORY_FORMATS:
        raise _Refused(f"unknown memory format code {brief(value, 40)}")
    return _MemFormatCode(value)


_LAYOUTS = {
    f"torch.{name}": obj for name, obj in vars(torch).items() if isinstance(obj, torch.layout)
}


def _layout(name: Any) -> torch.layout:
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise _Refused(f"unknown layout {brief(name, 40)}")
    return _LAYOUTS[name]


def _path_of(flavour: type) -> Callable[..., str]:
    def build(*parts: Any) -> str:
        if not all(isinstance(p, str) for p in parts):
            raise _Refused("a path made of something other than strings")
        return str(flavour(*parts))

    return build


def _write_item_type(value: Any) -> WriteItemType:
    if type(value) is not int or value not in {t.value for t in WriteItemType}:
        raise _Refused(f"unknown WriteItemType {brief(value, 40)}")
    return WriteItemType(value)


_ALLOWED: dict[tuple[str, str], Any] = {
    (cls.__module__, cls.__name__): rec for cls, rec in _RECORDS.items()
}
_ALLOWED.update(
    {
        (_PLANNER_MODULE, "WriteItemType"): _write_item_type,
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): _mem_format,
        ("torch", "Size"): _size,
        ("torch.serialization", "_get_layout"): _layout,
        # StorageMeta.checkpoint_id is the path the writer was given, often a pathlib.Path.
        ("pathlib", "PosixPath"): _path_of(PurePosixPath),
        ("pathlib", "PurePosixPath"): _path_of(PurePosixPath),
        ("pathlib", "WindowsPath"): _path_of(PureWindowsPath),
        ("pathlib", "PureWindowsPath"): _path_of(PureWindowsPath),
    }
)
_ALLOWED.update(
    {("torch", name): obj for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)}
)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except (KeyError, TypeError):
            raise _Refused(f"forbidden global {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("forbidden persistent id (a .metadata file has none)")


def safe_loads(data: bytes, what: str, *, rank_local: bool = False) -> Metadata:
    """The ``Metadata`` pickled in ``data`` (the bytes of a DCP ``.metadata`` file named ``what``).

    Raises :class:`CorruptCheckpointError` (naming ``what`` and the reason) for anything that is not a
    well-formed DCP metadata pickle built only from allowed globals; nothing named by the file is
    ever called. The chunks of each tensor must cover it exactly once, except in a rank-local
    ``__<rank>.metadata`` (``rank_local=True``), which lists only that rank's chunks.
    """
    if not data:
        raise CorruptDCPError(what, "empty file (no DCP metadata)")
    stream = io.BytesIO(data)
    try:
        root = _Unpickler(stream).load()
    except _Refused as e:
        raise CorruptDCPError(what, str(e)) from None
    except MemoryError:
        raise CorruptDCPError(what, "the pickle claims an impossibly large object") from None
    except Exception as e:  # noqa: BLE001 - the pickle machine only ran stand-ins; all are format errors
        raise CorruptDCPError(what, f"not a DCP metadata pickle ({e!r:.200})") from None
    if stream.tell() != len(data):
        raise CorruptDCPError(
            what, f"{len(data) - stream.tell()} stray bytes after the end of the pickle"
        )
    try:
        return _Converter(whole_tensors=not rank_local).metadata(root)
    except _Bad as e:
        raise CorruptDCPError(what, str(e)) from None


# ------------------------------------------------------------------------------ records -> torch


class _Bad(Exception):
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


def _int(value: Any, field: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise _Bad(f"{field} is {brief(value, 40)}, want an int in [0, 2**63)")
    return value


def _opt_str(value: Any, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _Bad(f"{field} is {type(value).__name__}, want a string or None")
    return value


_FIELDS = {real: frozenset(f.name for f in dataclasses.fields(real)) for real in _RECORDS}
_FIELDS[Metadata] |= {"all_local_plans"}  # an instance attribute NVRx's cached planning sets


class _Converter:
    """Checks the records and builds torch objects. ``where`` arguments name the field in errors;
    callers pass cheap pieces (the fqn) and messages are only formatted on failure.
    ``whole_tensors``: each tensor's chunks must tile it."""

    def __init__(self, *, whole_tensors: bool = True) -> None:
        self.whole_tensors = whole_tensors

    def _state(self, obj: Any, real: type, where: str) -> dict[str, Any]:
        if type(obj) is not _RECORDS[real]:
            raise _Bad(f"{where} is {_describe(obj)}, want {real.__name__}")
        state = getattr(obj, "state", None)
        if state is None:
            return {}
        if type(state) is dict and state.keys() <= _FIELDS[real]:
            return state
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise _Bad(f"{where}: state of {real.__name__} is {type(state).__name__}")
        unknown = sorted(set(state) - _FIELDS[real])
        raise _Bad(f"{where}: unknown {real.__name__} fields {brief(unknown)}")

    def metadata(self, obj: Any) -> Metadata:
        state = self._state(obj, Metadata, "the pickled object")
        sdm_in = state.get("state_dict_metadata")
        if type(sdm_in) is not dict:
            raise _Bad("state_dict_metadata is missing or not a dict")
        sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, md in sdm_in.items():
            if type(fqn) is not str:
                raise _Bad(f"state_dict_metadata key {brief(fqn)} is not a string")
            sdm[fqn] = self.storage_md(md, fqn)
        storage_data = state.get("storage_data")
        if storage_data is not None:
            storage_data = self.storage_data(storage_data, sdm)
        storage_meta = state.get("storage_meta")
        if storage_meta is not None:
            storage_meta = self.storage_meta(storage_meta)
        md = Metadata(
            state_dict_metadata=sdm,
            planner_data=self.plain(state.get("planner_data"), "planner_data"),
            storage_data=storage_data,
            storage_meta=storage_meta,
            version=_opt_str(state.get("version"), "version"),
        )
        plans = state.get("all_local_plans")
        if plans is not None:
            if type(plans) is not list or len(plans) > MAX_PLANS:
                raise _Bad(f"all_local_plans is {_describe(plans)}, want a list of SavePlans")
            md.all_local_plans = [self.save_plan(p, sdm, i) for i, p in enumerate(plans)]  # type: ignore[attr-defined]
        return md

    def save_plan(
        self, obj: Any, sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata], i: int
    ) -> SavePlan:
        """One rank's ``SavePlan`` of ``all_local_plans``: every item names an entry of ``sdm``."""
        where = f"all_local_plans[{i}]"
        state = self._state(obj, SavePlan, where)
        items = state.get("items", [])
        if type(items) is not list:
            raise _Bad(f"{where}.items is {_describe(items)}, want a list")
        storage = state.get("storage_data")
        if type(storage) is _RECORDS[_StoragePrefix]:
            prefix = self._state(storage, _StoragePrefix, f"{where}.storage_data").get("prefix")
            if not isinstance(prefix, str) or file_name_problem(prefix + "x"):
                raise _Bad(f"{where}.storage_data: prefix {brief(prefix)} is not a name prefix")
            storage = _StoragePrefix(prefix)
        else:
            storage = self.plain(storage, f"{where}.storage_data")
        usable = state.get("usable", True)
        if type(usable) is not bool:
            raise _Bad(f"{where}.usable must be a bool")
        return SavePlan(
            items=[
                self.write_item(item, sdm, f"{where}.items[{j}]") for j, item in enumerate(items)
            ],
            storage_data=storage,
            planner_data=self.plain(state.get("planner_data"), f"{where}.planner_data"),
            usable=usable,
        )

    def write_item(
        self, obj: Any, sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata], where: str
    ) -> WriteItem:
        state = self._state(obj, WriteItem, where)
        kind = state.get("type")
        if type(kind) is not WriteItemType:
            raise _Bad(f"{where}.type is {_describe(kind)}, want a WriteItemType")
        index = self.index(state.get("index"), sdm)
        tensor_data = state.get("tensor_data")
        if tensor_data is not None:
            md = sdm[index.fqn]
            if type(md) is not TensorStorageMetadata:
                raise _Bad(f"{where}: tensor data for the bytes item {index.fqn!r}")
            fields = self._state(tensor_data, TensorWriteData, f"{where}.tensor_data")
            if fields.get("size") != md.size:
                raise _Bad(f"{where}.tensor_data.size differs from {index.fqn!r}'s {list(md.size)}")
            tensor_data = TensorWriteData(
                chunk=self.chunk(fields.get("chunk"), md.size, index.fqn, 0),
                properties=self.properties(fields.get("properties"), index.fqn),
                size=md.size,
            )
        bytes_io = state.get("bytes_io_data")
        if bytes_io is not None:
            nbytes = self._state(bytes_io, BytesIOWriteData, f"{where}.bytes_io_data").get("nbytes")
            bytes_io = BytesIOWriteData(nbytes=_int(nbytes, f"{where}.bytes_io_data.nbytes"))
        return WriteItem(index=index, type=kind, bytes_io_data=bytes_io, tensor_data=tensor_data)

    def storage_md(self, obj: Any, fqn: str) -> TensorStorageMetadata | BytesStorageMetadata:
        if type(obj) is _RECORDS[BytesStorageMetadata]:
            self._state(obj, BytesStorageMetadata, f"state_dict_metadata[{fqn!r}]")
            return BytesStorageMetadata()
        state = self._state(obj, TensorStorageMetadata, f"state_dict_metadata[{fqn!r}]")
        size = state.get("size")
        if type(size) is not torch.Size:
            raise _Bad(f"state_dict_metadata[{fqn!r}].size is {_describe(size)}, want torch.Size")
        chunks_in = state.get("chunks")
        if type(chunks_in) is not list:
            raise _Bad(
                f"state_dict_metadata[{fqn!r}].chunks is {_describe(chunks_in)}, want a list"
            )
        chunks = [self.chunk(c, size, fqn, i) for i, c in enumerate(chunks_in)]
        if self.whole_tensors and not _chunks_tile(size, chunks):
            raise _Bad(
                f"state_dict_metadata[{brief(fqn)}]: its {len(chunks)} chunks do not cover the"
                f" {list(size)} tensor exactly once (missing or overlapping chunks)"
            )
        return TensorStorageMetadata(
            properties=self.properties(state.get("properties"), fqn), size=size, chunks=chunks
        )

    def chunk(self, obj: Any, size: torch.Size, fqn: str, i: int) -> ChunkStorageMetadata:
        where = f"state_dict_metadata[{fqn!r}].chunks[{i}]"
        state = self._state(obj, ChunkStorageMetadata, where)
        offsets, sizes = state.get("offsets"), state.get("sizes")
        if type(offsets) is not torch.Size or type(sizes) is not torch.Size:
            raise _Bad(f"{where}: offsets and sizes must be torch.Size")
        if not len(offsets) == len(sizes) == len(size):
            raise _Bad(f"{where}: {len(offsets)}/{len(sizes)} dims for a {len(size)}-dim tensor")
        for o, n, d in zip(offsets, sizes, size):
            if o + n > d:
                raise _Bad(
                    f"{where}: chunk at {list(offsets)} of {list(sizes)} exceeds {list(size)}"
                )
        return ChunkStorageMetadata(offsets=offsets, sizes=sizes)

    def properties(self, obj: Any, fqn: str) -> TensorProperties:
        where = f"state_dict_metadata[{fqn!r}].properties"
        if type(obj) is not _RECORDS[TensorProperties]:
            raise _Bad(f"{where} is {_describe(obj)}, want TensorProperties")
        state = getattr(obj, "state", None)
        if type(state) is not tuple or len(state) != 5:
            raise _Bad(f"{where}: state is {_describe(state)}, want a 5-tuple")
        dtype, layout, requires_grad, mem_code, pin_memory = state
        if type(dtype) is not torch.dtype or type(layout) is not torch.layout:
            raise _Bad(
                f"{where}: dtype {brief(dtype, 40)} / layout {brief(layout, 40)} of the wrong type"
            )
        if type(mem_code) is not _MemFormatCode:
            raise _Bad(f"{where}: memory format {brief(mem_code, 40)} is not a memory format code")
        if type(requires_grad) is not bool or type(pin_memory) is not bool:
            raise _Bad(f"{where}: requires_grad / pin_memory must be bools")
        return TensorProperties(
            dtype=dtype,
            layout=layout,
            requires_grad=requires_grad,
            memory_format=_MEMORY_FORMATS[int(mem_code)],
            pin_memory=pin_memory,
        )

    def storage_data(
        self, obj: Any, sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    ) -> dict[MetadataIndex, _StorageInfo]:
        if type(obj) is not dict:
            raise _Bad(f"storage_data is {_describe(obj)}, want a dict")
        out: dict[MetadataIndex, _StorageInfo] = {}
        for key, value in obj.items():
            index = self.index(key, sdm)
            if index in out:
                raise _Bad(f"storage_data holds {index.fqn!r} at {index.offset} twice")
            out[index] = self.storage_info(value, index.fqn)
        _check_disjoint(out)
        return out

    def index(
        self, obj: Any, sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    ) -> MetadataIndex:
        state = self._state(obj, MetadataIndex, "a storage_data key")
        fqn, offset, index = state.get("fqn"), state.get("offset"), state.get("index")
        md = sdm.get(fqn) if type(fqn) is str else None
        if md is None:
            raise _Bad(f"storage_data names {brief(fqn)}, which state_dict_metadata lacks")
        if type(md) is TensorStorageMetadata:
            if type(offset) is not torch.Size or len(offset) != len(md.size):
                raise _Bad(
                    f"storage_data key {fqn!r}: offset {brief(offset)} does not fit"
                    f" a {len(md.size)}-dim tensor"
                )
        elif offset is not None:
            raise _Bad(f"storage_data key {fqn!r}: a bytes item with a tensor offset")
        if index is not None:
            _int(index, f"storage_data key {fqn!r}.index")
        return MetadataIndex(fqn=fqn, offset=offset, index=index)

    def storage_info(self, obj: Any, fqn: str) -> _StorageInfo:
        state = self._state(obj, _StorageInfo, f"storage_data[{fqn!r}]")
        transforms = state.get("transform_descriptors")
        if transforms is not None and (
            type(transforms) is not list or not all(type(t) is str for t in transforms)
        ):
            raise _Bad(f"storage_data[{fqn!r}]: transform_descriptors must be a list of strings")
        name = state.get("relative_path")
        problem = file_name_problem(name)
        if problem:
            raise _Bad(f"storage_data[{fqn!r}]: {problem}")
        offset, length = state.get("offset"), state.get("length")
        if not (
            type(offset) is type(length) is int and 0 <= length and 0 <= offset <= MAX_INT - length
        ):
            _int(offset, f"storage_data[{fqn!r}].offset")
            _int(length, f"storage_data[{fqn!r}].length")
            raise _Bad(f"storage_data[{fqn!r}]: offset + length is past 2**63")
        return _StorageInfo(
            relative_path=name, offset=offset, length=length, transform_descriptors=transforms
        )

    def storage_meta(self, obj: Any) -> StorageMeta:
        state = self._state(obj, StorageMeta, "storage_meta")
        modules = state.get("modules", [])
        if type(modules) is not list or not all(type(m) is str for m in modules):
            raise _Bad("storage_meta.modules must be a list of strings")
        return StorageMeta(
            checkpoint_id=_opt_str(state.get("checkpoint_id"), "storage_meta.checkpoint_id"),
            save_id=_opt_str(state.get("save_id"), "storage_meta.save_id"),
            load_id=_opt_str(state.get("load_id"), "storage_meta.load_id"),
            modules=modules,
        )

    def plain(self, obj: Any, where: str) -> Any:
        """``obj`` if it is plain data (None, bool, int, float, str, bytes, and lists, tuples and
        dicts of those, acyclic, at most MAX_DEPTH deep), else raise ``_Bad``. A container shared
        by several parents is checked once."""
        _height(obj, where, 0, set(), {})
        return obj


def _height(obj: Any, where: str, depth: int, active: set[int], heights: dict[int, int]) -> int:
    """How deep the plain containers in ``obj`` nest (0 for a scalar); ``heights`` remembers the
    containers already measured, so memo-shared containers cost once, not once per path."""
    kind = type(obj)
    if obj is None or kind in _SCALARS:
        return 0
    if kind not in (list, tuple, dict):
        raise _Bad(f"{where} holds {_describe(obj)}, want plain data")
    known = heights.get(id(obj))
    if known is None:
        if depth >= MAX_DEPTH or id(obj) in active:
            raise _Bad(f"{where} nests too deep or refers to itself")
        active.add(id(obj))
        children = [v for kv in obj.items() for v in kv] if kind is dict else obj
        known = 1 + max(
            (_height(v, where, depth + 1, active, heights) for v in children), default=0
        )
        active.discard(id(obj))
        heights[id(obj)] = known
    if depth + known > MAX_DEPTH:
        raise _Bad(f"{where} nests too deep or refers to itself")
    return known


_SCALARS = frozenset((bool, int, float, str, bytes))


def _check_disjoint(storage: dict[MetadataIndex, _StorageInfo]) -> None:
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
                raise _Bad(
                    f"storage_data: items of {brief(fqns)} overlap in {brief(name)}"
                    f" (bytes [{a}, {end}) and from {b})"
                )


def _chunks_tile(size: torch.Size, chunks: list[ChunkStorageMetadata]) -> bool:
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


def brief(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters, computed without walking
    into nested containers or printing huge ints (a full repr of hostile data can hang, recurse too
    deep or raise)."""
    if type(value) in (list, tuple, torch.Size):
        inner = ", ".join(_brief_scalar(v, limit) for v in value[:16])
        inner += ", ..." if len(value) > 16 else ""
        text = {list: "[{}]", tuple: "({})", torch.Size: "torch.Size([{}])"}[type(value)]
        return text.format(inner)[:limit]
    return _brief_scalar(value, limit)[:limit]


def _brief_scalar(value: Any, limit: int) -> str:
    kind = type(value)
    if kind is int and value.bit_length() > 64:
        return f"<int of {value.bit_length()} bits>"
    if kind in (str, bytes):
        return repr(value[:limit])
    if value is None or kind in (bool, int, float, torch.dtype, torch.layout):
        return repr(value)
    return f"<{kind.__name__}>"


def _describe(obj: Any) -> str:
    if isinstance(obj, _Record):
        return f"a {type(obj).real.__name__}"
    return f"{type(obj).__name__} {obj!r:.60}" if obj is None else type(obj).__name__
