"""The part file's header: the limits, the dtype table, and decoding that trusts nothing it reads.

Call order: :func:`header_length` on the first 8 bytes, then :func:`decode_header` on the JSON
that follows; both raise :class:`CorruptCheckpointError` naming the file and the reason. The header
is written by :meth:`tierpoint.fileformat.plan.PartPlan.header`.

Invariants: the header is size-capped and parsed as JSON without pickle (duplicate keys refused); its
own checksum is checked before anything else in it is used; every record's dtype, shape and offsets
are validated against the file's size (no overlaps, no gaps, nothing past the end) before any tensor
is allocated; the safetensors entries must describe the same bytes tierpoint's records do.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from .tensor_bytes import checksum

FORMAT_VERSION = 1
DATA_ALIGNMENT = 64
"""The tensor data starts at a multiple of this offset; tensors are ordered so each is aligned."""
MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit: a larger header would not open with ``safe_open``."""
MAX_DIMS = 64
CHECKSUM_KEY = "tierpoint_header_xxh3"
ZERO_SUM = "0" * 16

# torch dtype -> safetensors code, for dtypes safetensors stores natively.
NATIVE_CODES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}


for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        NATIVE_CODES[getattr(torch, _name)] = _code


# Every torch dtype a part file may hold, by the name written in records.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


for _bad in (
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
):
    DTYPES.pop(_bad, None)


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives in a part file (offsets relative to the data section)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    checksum: str
    device: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class PartHeader:
    """A validated part-file header."""

    path: str
    data_start: int
    file_size: int
    records: tuple[TensorRecord, ...]
    skeleton: Any
    extra: dict[str, Any]
    version: int

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start


def padded(header: bytes) -> bytes:
    pad = (-(8 + len(header))) % DATA_ALIGNMENT
    return header + b" " * pad


def sum_field(value: str) -> bytes:
    return f'"{CHECKSUM_KEY}":"{value}"'.encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _parse_json(data: bytes | str, what: str, path: str) -> Any:
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise CorruptCheckpointError(path, f"{what} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(path, f"{what} is not valid JSON ({e})") from None


def header_length(prefix: bytes, file_size: int, path: str) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file's size."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(
            path, f"truncated: {file_size} bytes is too short to hold a header"
        )
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            path, f"header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes"
        )
    if 8 + n > file_size:
        raise CorruptCheckpointError(
            path, f"truncated: header claims {n} bytes but the file has {file_size}"
        )
    return n


def decode_header(raw: bytes, file_size: int, path: str) -> PartHeader:
    """Parse and check the JSON header (``raw``, without the length prefix) of a file of ``file_size``."""
    n = len(raw)
    header = _parse_json(raw, "header", path)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != "tierpoint":
        raise CorruptCheckpointError(path, "not a tierpoint part file (no tierpoint __metadata__)")
    stored_sum = meta.get(CHECKSUM_KEY)
    if not isinstance(stored_sum, str) or len(stored_sum) != 16:
        raise CorruptCheckpointError(path, "header checksum is missing")
    field = sum_field(stored_sum)
    if raw.count(field) != 1:
        raise CorruptCheckpointError(path, "header checksum field is malformed")
    if checksum(raw.replace(field, sum_field(ZERO_SUM))) != stored_sum:
        raise CorruptCheckpointError(
            path, "header checksum mismatch (the header was modified or damaged)"
        )
    inner = meta.get("tierpoint")
    if not isinstance(inner, str):
        raise CorruptCheckpointError(path, "tierpoint metadata is missing")
    doc = _parse_json(inner, "tierpoint metadata", path)
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(path, "tierpoint metadata is not a JSON object")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise CorruptCheckpointError(
            path, f"unsupported format version {version!r} (this tierpoint reads {FORMAT_VERSION})"
        )
    if "skeleton" not in doc:
        raise CorruptCheckpointError(path, "the state skeleton is missing")
    data_start = 8 + n
    records = _validate_records(doc.get("tensors"), header, file_size - data_start, path)
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise CorruptCheckpointError(path, "extra metadata is not a JSON object")
    return PartHeader(path, data_start, file_size, records, doc.get("skeleton"), extra, version)


def _is_device(name: Any) -> bool:
    """Whether ``name`` is a device string torch accepts (restoring a tensor's device parses it)."""
    if not isinstance(name, str) or len(name) > 64:
        return False
    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        return False
    return True


def _validate_records(
    raw_records: Any, entries: dict[str, Any], data_size: int, path: str
) -> tuple[TensorRecord, ...]:
    if not isinstance(raw_records, list):
        raise CorruptCheckpointError(path, "tensor records are missing")
    if len(raw_records) != len(entries):
        raise CorruptCheckpointError(
            path, f"{len(raw_records)} tensor records but {len(entries)} header entries"
        )
    records = []
    names: set[str] = set()
    for rec in raw_records:
        if not (isinstance(rec, list) and len(rec) == 5):
            raise CorruptCheckpointError(path, f"malformed tensor record {str(rec)[:80]!r}")
        name, dtype_name, shape, sum_hex, device = rec
        entry = entries.get(name) if isinstance(name, str) else None
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(path, f"tensor {str(name)[:80]!r} has no header entry")
        if name in names:  # else another entry would go unchecked
            raise CorruptCheckpointError(path, f"tensor {name!r} has two records")
        names.add(name)
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise CorruptCheckpointError(
                path, f"tensor {name!r} has unknown dtype {str(dtype_name)[:40]!r}"
            )
        if not (
            isinstance(shape, list)
            and len(shape) <= MAX_DIMS
            and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise CorruptCheckpointError(
                path, f"tensor {name!r} has an invalid shape {str(shape)[:80]}"
            )
        offsets = entry.get("data_offsets")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        ):
            raise CorruptCheckpointError(path, f"tensor {name!r} has invalid data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise CorruptCheckpointError(
                path, f"tensor {name!r} lies outside the file (bytes {begin}..{end} of {data_size})"
            )
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise CorruptCheckpointError(
                path,
                f"tensor {name!r}: shape {shape} x {dtype} needs {expected} bytes, entry has {end - begin}",
            )
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:  # e.g. [0, 2**63]
            raise CorruptCheckpointError(
                path, f"tensor {name!r} has an invalid shape {str(shape)[:80]} (too large)"
            )
        code = NATIVE_CODES.get(dtype, "U8")
        if entry.get("dtype") != code:
            raise CorruptCheckpointError(
                path,
                f"tensor {name!r}: header dtype {entry.get('dtype')!r} disagrees with {dtype_name}",
            )
        if entry.get("shape") != (shape if dtype in NATIVE_CODES else [expected]):
            raise CorruptCheckpointError(  # safetensors would read another tensor than tierpoint does
                path,
                f"tensor {name!r}: header shape {str(entry.get('shape'))[:80]} disagrees with {shape}",
            )
        if not (isinstance(sum_hex, str) and len(sum_hex) == 16) or not _is_device(device):
            raise CorruptCheckpointError(
                path, f"tensor {name!r} has a malformed checksum or device"
            )
        records.append(TensorRecord(name, dtype, tuple(shape), begin, end, sum_hex, device))
    cursor = 0
    for r in sorted(records, key=lambda r: (r.begin, r.end)):
        if r.begin != cursor:
            kind = "overlaps another tensor" if r.begin < cursor else "leaves a gap before it"
            raise CorruptCheckpointError(
                path, f"tensor {r.name!r} {kind} (offset {r.begin}, expected {cursor})"
            )
        cursor = r.end
    if cursor != data_size:
        if cursor < data_size:
            raise CorruptCheckpointError(
                path, f"file has {data_size - cursor} unexpected bytes after the last tensor"
            )
        raise CorruptCheckpointError(
            path, "truncated tensor data"
        )  # pragma: no cover - caught per tensor above
    return tuple(records)
