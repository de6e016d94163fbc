"""Check the records a ``.metadata`` pickle left and build the torch DCP objects from them.

After the restricted unpickler (:mod:`tierpoint.dcp.restricted_pickle`) has run with the
``.metadata`` allow-list (:mod:`tierpoint.dcp.metadata_globals`), the result is a tree of record
stand-ins and plain values. :func:`check_metadata` walks it field by field (types, known field
names, non-negative sizes, chunks inside their tensor and, for a whole checkpoint, tiling it
exactly once, storage file names that are plain names, non-negative offsets and lengths, no
duplicates and the rules across fields of :mod:`tierpoint.dcp.metadata_rules`) and only then
builds the real torch objects with this module's own code.

Call order: ``check_metadata(root, whole_tensors=..., budget=...)`` -> ``Metadata``, or
:class:`BadField` naming the field and what is wrong with it.

Invariants: nothing from the pickle is called; messages quote hostile values only through
:func:`~tierpoint.dcp.restricted_pickle.brief` and are formatted only on failure; the work is
bounded by the pickle's size: a record reached through a path of its own costs at least a byte of
the pickle, so a file that reaches more records than it has bytes (``budget``) shares them (one
chunk list under every tensor, one plan for every rank) to multiply the work and the objects built
from them, and is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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

from .metadata_globals import MEMORY_FORMATS, RECORDS, MemFormatCode
from .metadata_rules import (
    BadField,
    check_disjoint,
    check_plain,
    chunks_tile,
    describe,
    file_name_problem,
)
from .restricted_pickle import MAX_INT, brief

MAX_PLANS = 1 << 20
"""Most local plans accepted in ``Metadata.all_local_plans`` (one per rank)."""


def check_metadata(root: Any, *, whole_tensors: bool = True, budget: int | None = None) -> Metadata:
    """The ``Metadata`` the records under ``root`` describe; raises :class:`BadField`.
    ``whole_tensors``: each tensor's chunks must tile it (not so in a rank-local file);
    ``budget``: the most records that may be visited (the pickle's size; None: no limit)."""
    return _Converter(whole_tensors=whole_tensors, budget=budget).metadata(root)


def _int(value: Any, field: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise BadField(f"{field} is {brief(value, 40)}, want an int in [0, 2**63)")
    return value


def _opt_str(value: Any, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise BadField(f"{field} is {type(value).__name__}, want a string or None")
    return value


_FIELDS = {real: frozenset(f.name for f in dataclasses.fields(real)) for real in RECORDS}
_FIELDS[Metadata] |= {"all_local_plans"}  # an instance attribute NVRx's cached planning sets


class _Converter:
    """Checks the records and builds torch objects. ``where`` arguments name the field in errors;
    callers pass cheap pieces (the fqn) and messages are only formatted on failure.
    ``whole_tensors``: each tensor's chunks must tile it."""

    def __init__(self, *, whole_tensors: bool = True, budget: int | None = None) -> None:
        self.whole_tensors = whole_tensors
        self.budget = budget

    def _state(self, obj: Any, real: type, where: str) -> dict[str, Any]:
        if type(obj) is not RECORDS[real]:
            raise BadField(f"{where} is {describe(obj)}, want {real.__name__}")
        if self.budget is not None:
            self.budget -= 1
            if self.budget < 0:
                raise BadField(
                    f"{where}: more records than the pickle has bytes (records shared to"
                    " multiply the work of reading it)"
                )
        state = getattr(obj, "state", None)
        if state is None:
            return {}
        if type(state) is dict and state.keys() <= _FIELDS[real]:
            return state
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise BadField(f"{where}: state of {real.__name__} is {type(state).__name__}")
        unknown = sorted(set(state) - _FIELDS[real])
        raise BadField(f"{where}: unknown {real.__name__} fields {brief(unknown)}")

    def metadata(self, obj: Any) -> Metadata:
        state = self._state(obj, Metadata, "the pickled object")
        sdm_in = state.get("state_dict_metadata")
        if type(sdm_in) is not dict:
            raise BadField("state_dict_metadata is missing or not a dict")
        sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, md in sdm_in.items():
            if type(fqn) is not str:
                raise BadField(f"state_dict_metadata key {brief(fqn)} is not a string")
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
                raise BadField(f"all_local_plans is {describe(plans)}, want a list of SavePlans")
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
            raise BadField(f"{where}.items is {describe(items)}, want a list")
        storage = state.get("storage_data")
        if type(storage) is RECORDS[_StoragePrefix]:
            prefix = self._state(storage, _StoragePrefix, f"{where}.storage_data").get("prefix")
            if not isinstance(prefix, str) or file_name_problem(prefix + "x"):
                raise BadField(f"{where}.storage_data: prefix {brief(prefix)} is not a name prefix")
            storage = _StoragePrefix(prefix)
        else:
            storage = self.plain(storage, f"{where}.storage_data")
        usable = state.get("usable", True)
        if type(usable) is not bool:
            raise BadField(f"{where}.usable must be a bool")
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
            raise BadField(f"{where}.type is {describe(kind)}, want a WriteItemType")
        index = self.index(state.get("index"), sdm)
        tensor_data = state.get("tensor_data")
        if tensor_data is not None:
            md = sdm[index.fqn]
            if type(md) is not TensorStorageMetadata:
                raise BadField(f"{where}: tensor data for the bytes item {index.fqn!r}")
            fields = self._state(tensor_data, TensorWriteData, f"{where}.tensor_data")
            if fields.get("size") != md.size:
                raise BadField(
                    f"{where}.tensor_data.size differs from {index.fqn!r}'s {list(md.size)}"
                )
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
        if type(obj) is RECORDS[BytesStorageMetadata]:
            self._state(obj, BytesStorageMetadata, f"state_dict_metadata[{fqn!r}]")
            return BytesStorageMetadata()
        state = self._state(obj, TensorStorageMetadata, f"state_dict_metadata[{fqn!r}]")
        size = state.get("size")
        if type(size) is not torch.Size:
            raise BadField(
                f"state_dict_metadata[{fqn!r}].size is {describe(size)}, want torch.Size"
            )
        chunks_in = state.get("chunks")
        if type(chunks_in) is not list:
            raise BadField(
                f"state_dict_metadata[{fqn!r}].chunks is {describe(chunks_in)}, want a list"
            )
        chunks = [self.chunk(c, size, fqn, i) for i, c in enumerate(chunks_in)]
        if self.whole_tensors and not chunks_tile(size, chunks):
            raise BadField(
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
            raise BadField(f"{where}: offsets and sizes must be torch.Size")
        if not len(offsets) == len(sizes) == len(size):
            raise BadField(
                f"{where}: {len(offsets)}/{len(sizes)} dims for a {len(size)}-dim tensor"
            )
        for o, n, d in zip(offsets, sizes, size):
            if o + n > d:
                raise BadField(
                    f"{where}: chunk at {list(offsets)} of {list(sizes)} exceeds {list(size)}"
                )
        return ChunkStorageMetadata(offsets=offsets, sizes=sizes)

    def properties(self, obj: Any, fqn: str) -> TensorProperties:
        where = f"state_dict_metadata[{fqn!r}].properties"
        if type(obj) is not RECORDS[TensorProperties]:
            raise BadField(f"{where} is {describe(obj)}, want TensorProperties")
        state = getattr(obj, "state", None)
        if type(state) is not tuple or len(state) != 5:
            raise BadField(f"{where}: state is {describe(state)}, want a 5-tuple")
        dtype, layout, requires_grad, mem_code, pin_memory = state
        if type(dtype) is not torch.dtype or type(layout) is not torch.layout:
            raise BadField(
                f"{where}: dtype {brief(dtype, 40)} / layout {brief(layout, 40)} of the wrong type"
            )
        if type(mem_code) is not MemFormatCode:
            raise BadField(
                f"{where}: memory format {brief(mem_code, 40)} is not a memory format code"
            )
        if type(requires_grad) is not bool or type(pin_memory) is not bool:
            raise BadField(f"{where}: requires_grad / pin_memory must be bools")
        return TensorProperties(
            dtype=dtype,
            layout=layout,
            requires_grad=requires_grad,
            memory_format=MEMORY_FORMATS[int(mem_code)],
            pin_memory=pin_memory,
        )

    def storage_data(
        self, obj: Any, sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    ) -> dict[MetadataIndex, _StorageInfo]:
        if type(obj) is not dict:
            raise BadField(f"storage_data is {describe(obj)}, want a dict")
        out: dict[MetadataIndex, _StorageInfo] = {}
        for key, value in obj.items():
            index = self.index(key, sdm)
            if index in out:
                raise BadField(f"storage_data holds {index.fqn!r} at {index.offset} twice")
            out[index] = self.storage_info(value, index.fqn)
        check_disjoint(out)
        return out

    def index(
        self, obj: Any, sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    ) -> MetadataIndex:
        state = self._state(obj, MetadataIndex, "a storage_data key")
        fqn, offset, index = state.get("fqn"), state.get("offset"), state.get("index")
        md = sdm.get(fqn) if type(fqn) is str else None
        if md is None:
            raise BadField(f"storage_data names {brief(fqn)}, which state_dict_metadata lacks")
        if type(md) is TensorStorageMetadata:
            if type(offset) is not torch.Size or len(offset) != len(md.size):
                raise BadField(
                    f"storage_data key {fqn!r}: offset {brief(offset)} does not fit"
                    f" a {len(md.size)}-dim tensor"
                )
        elif offset is not None:
            raise BadField(f"storage_data key {fqn!r}: a bytes item with a tensor offset")
        if index is not None:
            _int(index, f"storage_data key {fqn!r}.index")
        return MetadataIndex(fqn=fqn, offset=offset, index=index)

    def storage_info(self, obj: Any, fqn: str) -> _StorageInfo:
        state = self._state(obj, _StorageInfo, f"storage_data[{fqn!r}]")
        transforms = state.get("transform_descriptors")
        if transforms is not None and (
            type(transforms) is not list or not all(type(t) is str for t in transforms)
        ):
            raise BadField(
                f"storage_data[{fqn!r}]: transform_descriptors must be a list of strings"
            )
        name = state.get("relative_path")
        problem = file_name_problem(name)
        if problem:
            raise BadField(f"storage_data[{fqn!r}]: {problem}")
        offset, length = state.get("offset"), state.get("length")
        if not (
            type(offset) is type(length) is int and 0 <= length and 0 <= offset <= MAX_INT - length
        ):
            _int(offset, f"storage_data[{fqn!r}].offset")
            _int(length, f"storage_data[{fqn!r}].length")
            raise BadField(f"storage_data[{fqn!r}]: offset + length is past 2**63")
        return _StorageInfo(
            relative_path=name, offset=offset, length=length, transform_descriptors=transforms
        )

    def storage_meta(self, obj: Any) -> StorageMeta:
        state = self._state(obj, StorageMeta, "storage_meta")
        modules = state.get("modules", [])
        if type(modules) is not list or not all(type(m) is str for m in modules):
            raise BadField("storage_meta.modules must be a list of strings")
        return StorageMeta(
            checkpoint_id=_opt_str(state.get("checkpoint_id"), "storage_meta.checkpoint_id"),
            save_id=_opt_str(state.get("save_id"), "storage_meta.save_id"),
            load_id=_opt_str(state.get("load_id"), "storage_meta.load_id"),
            modules=modules,
        )

    def plain(self, obj: Any, where: str) -> Any:
        """``obj`` if it is plain data (see :func:`~tierpoint.dcp.metadata_rules.check_plain`)."""
        check_plain(obj, where)
        return obj
