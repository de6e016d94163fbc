"""Laying out a part file: which tensor goes where, and the header that describes them.

Call order: ``plan = plan_part(flat, extra)`` (checks that every tensor can be saved, reads no tensor
data), then a writer (:mod:`tierpoint.fileformat.writing`) fills the data section in
``plan.file_order`` and writes ``plan.header(checksums)``. A :class:`PartPlan` is JSON-able
(:meth:`PartPlan.to_json`, which is also how it pickles), so a worker process can seal a part planned
by the training process.
A saver planning the same layout again and again passes its last plan, ``plan_part(flat, extra,
like=last)``: when the tensors' paths, dtypes, shapes and devices are unchanged, the layout and the
header's layout-only JSON are reused (a save of a state of ~1000 tensors otherwise spends a few
milliseconds of the training process's time on them).

Invariants: tensors are laid out without gaps (safetensors needs none), each aligned to its element
size and the large ones to :data:`DATA_ALIGNMENT`; the header's size is fixed by the plan alone (the
checksum fields have a fixed width), so the data can be written before the checksums are known; a
plan whose header readers would refuse is refused here, before anything is written.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointingError, UnsupportedStateError
from ..tree import FlatState
from . import header
from .header import (
    CHECKSUM_KEY,
    DATA_ALIGNMENT,
    DTYPES,
    FORMAT_VERSION,
    MAX_DIMS,
    NATIVE_CODES,
    ZERO_SUM,
    padded,
    sum_field,
)
from .tensor_bytes import checksum


def _check_savable(t: torch.Tensor, path: str) -> None:
    if t.is_quantized or t.device.type == "meta":
        raise UnsupportedStateError(path, f"{t.device.type} / quantized tensors cannot be saved")
    if str(t.dtype).removeprefix("torch.") not in DTYPES:
        raise UnsupportedStateError(path, f"dtype {t.dtype} is not supported")
    if t.dim() > MAX_DIMS:  # readers refuse more: saving it would lose the checkpoint
        raise UnsupportedStateError(
            path, f"tensors of more than {MAX_DIMS} dimensions cannot be saved"
        )
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise CheckpointingError("tierpoint part files need a little-endian host")


def _unique_names(paths: Sequence[str]) -> list[str]:
    names: list[str] = []
    used: set[str] = {"__metadata__"}
    for i, p in enumerate(paths):
        name = p or f"tensor{i}"
        while name in used:  # `while`: "a~2" may itself be another tensor's path
            name = f"{name}~{i}"
        used.add(name)
        names.append(name)
    return names


@dataclass(frozen=True)
class PartPlan:
    """Everything about a part file except its tensor bytes and checksums (JSON-able, for workers).

    Lists are in skeleton order; ``offsets`` are relative to the data section, larger element sizes
    first so that every tensor is aligned to its element size.
    """

    skeleton: Any
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    devices: list[str]
    offsets: list[tuple[int, int]]
    data_size: int
    extra: dict[str, Any]
    _header_size: int | None = field(default=None, init=False, repr=False, compare=False)
    _layout: tuple | None = field(default=None, init=False, repr=False, compare=False)
    """What the layout was planned from (see :func:`plan_part`'s ``like``)."""
    _layout_json: dict[str, str] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """JSON of the header that only the layout decides, made once, shared by the plans of a layout."""
    _skeleton_json: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def file_order(self) -> list[int]:
        return sorted(range(len(self.names)), key=lambda i: self.offsets[i])

    def header(self, sums: Sequence[str]) -> bytes:
        """The padded header (without the length prefix), its own checksum filled in."""
        body = self._header_json(sums, ZERO_SUM)
        return padded(body.replace(sum_field(ZERO_SUM), sum_field(checksum(padded(body))), 1))

    def header_size(self) -> int:
        """Bytes of the padded header: fixed by the plan (checksum fields have a fixed width)."""
        if self._header_size is None:
            size = len(padded(self._header_json(None, ZERO_SUM)))
            if (
                size > header.MAX_HEADER_BYTES
            ):  # readers refuse more: saving it would lose the checkpoint
                raise UnsupportedStateError(
                    "",
                    f"the part file header would take {size} bytes, over the limit of "
                    f"{header.MAX_HEADER_BYTES}: store large non-tensor data (long lists...) as tensors",
                )
            object.__setattr__(self, "_header_size", size)  # computed once per plan
        return self._header_size

    def data_start(self) -> int:
        """File offset of the first tensor byte (a multiple of :data:`DATA_ALIGNMENT`)."""
        return 8 + self.header_size()

    def file_size(self) -> int:
        return self.data_start() + self.data_size

    def _header_json(self, sums: Sequence[str] | None, header_sum: str) -> bytes:
        """The header's JSON; ``sums`` None: placeholders (:data:`ZERO_SUM`), for its size. Put
        together from pieces, each as ``json.dumps`` writes it, so the bytes are those of dumping
        ``{"__metadata__": {"format", "tierpoint": <the inner document>, checksum}, **entries}``
        whole; the pieces only the layout decides are made once per layout."""
        inner = (
            f'{{"version":{_dumps(FORMAT_VERSION)},"skeleton":{self._skeleton_text()},'
            f'"extra":{_dumps(self.extra)},"tensors":{self._records_json(sums)}}}'
        )
        meta = (
            f'{{"format":"tierpoint","tierpoint":{_dumps(inner)},'
            f'"{CHECKSUM_KEY}":{_dumps(header_sum)}}}'
        )
        return f'{{"__metadata__":{meta}{self._entries_json()}}}'.encode()

    def _records_json(self, sums: Sequence[str] | None) -> str:
        if sums is None and "records" in self._layout_json:
            return self._layout_json["records"]
        records = [
            [name, self.dtypes[i], self.shapes[i], ZERO_SUM if sums is None else sums[i], device]
            for i, (name, device) in enumerate(zip(self.names, self.devices))
        ]
        made = _dumps(records)
        if sums is None:
            self._layout_json["records"] = made
        return made

    def _entries_json(self) -> str:
        """The safetensors entries that follow ``__metadata__`` (with their leading comma)."""
        if "entries" not in self._layout_json:
            entries: dict[str, Any] = {}
            for i, name in enumerate(self.names):
                begin, end = self.offsets[i]
                code = NATIVE_CODES.get(DTYPES[self.dtypes[i]])
                shape = self.shapes[i] if code else [end - begin]
                entries[name] = {
                    "dtype": code or "U8",
                    "shape": shape,
                    "data_offsets": [begin, end],
                }
            self._layout_json["entries"] = f",{_dumps(entries)[1:-1]}" if entries else ""
        return self._layout_json["entries"]

    @property
    def layout_key(self) -> tuple | None:
        """Equal for plans of the same tensor layout (paths, dtypes, shapes, devices; the very same
        object for plans made ``like`` one another): a key for what the layout alone decides (the
        views of the tensors' places in staging memory). None for a plan read from JSON."""
        return self._layout

    def same_layout_as(self, other: PartPlan) -> bool:
        """Planned from tensors of the same paths, dtypes, shapes and devices (so with the same
        offsets): at once for a plan made ``like`` the other."""
        return self._layout is not None and (
            self._layout is other._layout or self._layout == other._layout
        )

    def _skeleton_text(self) -> str:
        if self._skeleton_json is None:
            object.__setattr__(self, "_skeleton_json", _dumps(self.skeleton))
        assert self._skeleton_json is not None
        return self._skeleton_json

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickled (for a worker process) as :meth:`to_json`."""
        return PartPlan.from_json, (self.to_json(),)

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON data: its skeleton and its layout lists as JSON text (made for the
        header anyway, and once per layout), which pickle copies whole, where thousands of small
        lists would each cost the sending training process time and objects."""
        if "layout" not in self._layout_json:
            layout = [self.names, self.dtypes, self.shapes, self.devices, self.offsets]
            self._layout_json["layout"] = _dumps(layout)
        return {
            "skeleton_json": self._skeleton_text(),
            "layout_json": self._layout_json["layout"],
            "data_size": self.data_size,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PartPlan:
        names, dtypes, shapes, devices, offsets = json.loads(doc["layout_json"])
        plan = cls(
            skeleton=json.loads(doc["skeleton_json"]),
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            devices=devices,
            offsets=[tuple(o) for o in offsets],
            data_size=doc["data_size"],
            extra=doc["extra"],
        )
        object.__setattr__(plan, "_skeleton_json", doc["skeleton_json"])
        return plan


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def plan_part(
    flat: FlatState, extra: Mapping[str, Any] | None = None, like: PartPlan | None = None
) -> PartPlan:
    """Lay out a flattened state as a part file (validates dtypes; reads no tensor data).
    ``like``: an earlier plan, whose layout is reused when ``flat``'s tensors have the same paths,
    dtypes, shapes and devices (checked here)."""
    if like is not None and _same_layout(flat, like._layout):
        plan = PartPlan(
            skeleton=flat.skeleton,
            names=like.names,
            dtypes=like.dtypes,
            shapes=like.shapes,
            devices=like.devices,
            offsets=like.offsets,
            data_size=like.data_size,
            extra=dict(extra or {}),
        )
        object.__setattr__(plan, "_layout", like._layout)
        object.__setattr__(plan, "_layout_json", like._layout_json)
        return plan
    for t, p in zip(flat.tensors, flat.paths):
        _check_savable(t, p)
    sizes = [t.numel() * t.element_size() for t in flat.tensors]
    # Tensors whose size is a multiple of 64 bytes go first: each of them then starts on a 64-byte
    # boundary (fast copies into staging memory). The rest (typically small) follow by descending
    # element size, which keeps each aligned to its own element size. No gaps: safetensors needs none.
    order = sorted(
        range(len(sizes)),
        key=lambda i: (sizes[i] % DATA_ALIGNMENT != 0, -flat.tensors[i].element_size()),
    )
    offsets: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    cursor = 0
    for i in order:
        offsets[i] = (cursor, cursor + sizes[i])
        cursor += sizes[i]
    plan = PartPlan(
        skeleton=flat.skeleton,
        names=_unique_names(flat.paths),
        dtypes=[str(t.dtype).removeprefix("torch.") for t in flat.tensors],
        shapes=[list(t.shape) for t in flat.tensors],
        devices=[str(t.device) for t in flat.tensors],
        offsets=offsets,
        data_size=cursor,
        extra=dict(extra or {}),
    )
    tensors = flat.tensors
    layout = (
        list(flat.paths),
        [t.dtype for t in tensors],
        [t.shape for t in tensors],
        [t.device for t in tensors],
    )
    object.__setattr__(plan, "_layout", layout)
    return plan


def _same_layout(flat: FlatState, layout: tuple | None) -> bool:
    """``flat``'s tensors have the paths, dtypes, shapes and devices of ``layout`` (a plan's).
    Compared tensor by tensor, so that each shape read is dropped at once: a steady save then
    leaves nothing behind for Python's garbage collector to count."""
    if layout is None:
        return False
    paths, dtypes, shapes, devices = layout
    tensors = flat.tensors
    return (
        len(tensors) == len(shapes)
        and flat.paths == paths
        and all(
            t.dtype is d and t.device == v and t.shape == s
            for t, d, s, v in zip(tensors, dtypes, shapes, devices)
        )
    )
