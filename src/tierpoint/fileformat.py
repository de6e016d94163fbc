"""The part file: one rank's share of one checkpoint, pickle-free, checksummed, safetensors-compatible.

Layout (the safetensors layout, so ``safetensors.safe_open`` reads the tensors)::

    [u64 little-endian N][N bytes of JSON header, space-padded][tensor bytes, back to back]

The JSON header maps each tensor name to ``{"dtype", "shape", "data_offsets"}`` and carries
``"__metadata__"``, a str -> str map holding:

- ``"format": "tierpoint"`` and ``"tierpoint"``: a JSON document with the format ``version``, the state
  ``skeleton`` (see :mod:`tierpoint.tree`), caller ``extra`` metadata, and one record per tensor
  ``[name, torch dtype, shape, xxh3-64 hex of its bytes, device it was saved from]``;
- ``"tierpoint_header_xxh3"``: xxh3-64 of the header bytes with this value set to sixteen ``0``.

Dtypes safetensors lacks (complex, float8 variants other than e4m3fn/e5m2, ...) are written as ``U8``
entries of shape ``[nbytes]``; their true dtype and shape are in the record, and reading restores them
exactly. Tensor bytes are stored little-endian in the tensor's own memory order (C-contiguous).

Call order: ``write(path, state)`` or ``write_flat(path, flat)``; ``read(path)`` / ``read_flat(path)``;
``read_header(path)`` for a cheap structural check.

Invariants:
- A file becomes visible under its final name only complete: written to a dirty name, fsynced,
  renamed, directory fsynced.
- Nothing read from a file is trusted: the header is size-capped, parsed without pickle, checked against
  its checksum, and every offset, dtype and shape is validated against the file's size before anything
  is allocated. Every failure is a :class:`CorruptCheckpointError` naming the file and the reason.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import sys
import time
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from .errors import CheckpointingError, CorruptCheckpointError, UnsupportedStateError
from .tree import FlatState, SkeletonError, flatten, unflatten

FORMAT_VERSION = 1
DATA_ALIGNMENT = 64
"""The tensor data starts at a multiple of this offset; tensors are ordered so each is aligned."""
MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit: a larger header would not open with ``safe_open``."""
MAX_DIMS = 64
CHECKSUM_KEY = "tierpoint_header_xxh3"
_ZERO_SUM = "0" * 16
_IO_CHUNK = 1 << 30
_SMALL_TENSOR = 1 << 20

# torch dtype -> safetensors code, for dtypes safetensors stores natively.
_NATIVE_CODES: dict[torch.dtype, str] = {
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
        _NATIVE_CODES[getattr(torch, _name)] = _code

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


@dataclass(frozen=True)
class WriteResult:
    path: str
    nbytes: int
    seconds: float


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    flat = t.as_strided((t.numel(),), (1,))  # not reshape: it keeps a size-1 dim's odd stride
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


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


def _prepare(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the same bytes (a copy only where unavoidable)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


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


def _padded(header: bytes) -> bytes:
    pad = (-(8 + len(header))) % DATA_ALIGNMENT
    return header + b" " * pad


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.write(fd, view[:_IO_CHUNK])
        view = view[n:]


def _write_data(fd: int, views: Sequence[memoryview]) -> None:
    """Write the views back to back: small ones gathered into one writev, large ones straight."""
    batch: list[memoryview] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            written = os.writev(fd, batch)
            if written != batch_bytes:  # rare partial writev: finish byte by byte of what is left
                _write_all(fd, memoryview(b"".join(bytes(v) for v in batch))[written:])
            batch, batch_bytes = [], 0

    for v in views:
        if len(v) >= _SMALL_TENSOR:
            flush()
            _write_all(fd, v)
        else:
            batch.append(v)
            batch_bytes += len(v)
            if len(batch) >= 512 or batch_bytes >= _SMALL_TENSOR:
                flush()
    flush()


_HASH_CHUNK = 4 << 20


class _ChunkHasher:
    """Hashes chunks on one background thread, in submission order, while the caller moves the next
    chunk: each chunk is hashed just after it was copied (still in the CPU cache), and the two
    cores share the work when both are free."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierpoint-hash")
        self._pending: list[Future[None]] = []

    def update(self, hasher: Any, piece: memoryview) -> None:
        self._pending.append(self._pool.submit(hasher.update, piece))
        if len(self._pending) > 64:
            self._pending.pop(0).result()

    def drain(self) -> None:
        for fut in self._pending:
            fut.result()
        self._pending.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _write_and_hash(fd: int, views: Sequence[memoryview]) -> list[str]:
    """Write the views back to back and return their checksums (see :class:`_ChunkHasher`); small
    views are gathered into few writes."""
    hashers = [xxhash.xxh3_64() for _ in views]
    chunks = _ChunkHasher()
    try:
        small: list[memoryview] = []
        for v, hasher in zip(views, hashers):
            if len(v) < _SMALL_TENSOR:
                small.append(v)
                hasher.update(v)
                continue
            _write_data(fd, small)
            small = []
            for offset in range(0, len(v), _HASH_CHUNK):
                piece = v[offset : offset + _HASH_CHUNK]
                _write_all(fd, piece)
                chunks.update(hasher, piece)
        _write_data(fd, small)
        chunks.drain()
    finally:
        chunks.close()
    return [h.hexdigest() for h in hashers]


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dirty_name(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".dirty")


def write(
    path: str | os.PathLike,
    state: Any,
    *,
    allow_pickle: bool = False,
    extra: Mapping[str, Any] | None = None,
    recycle: str | os.PathLike | None = None,
    dirty_path: str | os.PathLike | None = None,
    fsync: bool = True,
) -> WriteResult:
    """Write ``state`` (any nested dict/list/tuple of tensors and plain values) as a part file."""
    return write_flat(
        path,
        flatten(state, allow_pickle=allow_pickle),
        extra=extra,
        recycle=recycle,
        dirty_path=dirty_path,
        fsync=fsync,
    )


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

    @property
    def file_order(self) -> list[int]:
        return sorted(range(len(self.names)), key=lambda i: self.offsets[i])

    def header(self, sums: Sequence[str]) -> bytes:
        """The padded header (without the length prefix), its own checksum filled in."""
        body = self._header_json(sums, _ZERO_SUM)
        return _padded(body.replace(_sum_field(_ZERO_SUM), _sum_field(checksum(_padded(body))), 1))

    def header_size(self) -> int:
        """Bytes of the padded header: fixed by the plan (checksum fields have a fixed width)."""
        if self._header_size is None:
            size = len(_padded(self._header_json([_ZERO_SUM] * len(self.names), _ZERO_SUM)))
            if size > MAX_HEADER_BYTES:  # readers refuse more: saving it would lose the checkpoint
                raise UnsupportedStateError(
                    "",
                    f"the part file header would take {size} bytes, over the limit of "
                    f"{MAX_HEADER_BYTES}: store large non-tensor data (long lists...) as tensors",
                )
            object.__setattr__(self, "_header_size", size)  # computed once per plan
        return self._header_size

    def data_start(self) -> int:
        """File offset of the first tensor byte (a multiple of :data:`DATA_ALIGNMENT`)."""
        return 8 + self.header_size()

    def file_size(self) -> int:
        return self.data_start() + self.data_size

    def _header_json(self, sums: Sequence[str], header_sum: str) -> bytes:
        entries: dict[str, Any] = {}
        records = []
        for i, name in enumerate(self.names):
            begin, end = self.offsets[i]
            code = _NATIVE_CODES.get(DTYPES[self.dtypes[i]])
            shape = self.shapes[i] if code else [end - begin]
            entries[name] = {"dtype": code or "U8", "shape": shape, "data_offsets": [begin, end]}
            records.append([name, self.dtypes[i], self.shapes[i], sums[i], self.devices[i]])
        doc = {
            "version": FORMAT_VERSION,
            "skeleton": self.skeleton,
            "extra": self.extra,
            "tensors": records,
        }
        inner = json.dumps(doc, separators=(",", ":"), allow_nan=False)
        meta = {"format": "tierpoint", "tierpoint": inner, CHECKSUM_KEY: header_sum}
        return json.dumps(
            {"__metadata__": meta, **entries}, separators=(",", ":"), allow_nan=False
        ).encode()

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PartPlan:
        return cls(**{**doc, "offsets": [tuple(o) for o in doc["offsets"]]})


def plan_part(flat: FlatState, extra: Mapping[str, Any] | None = None) -> PartPlan:
    """Lay out a flattened state as a part file (validates dtypes; reads no tensor data)."""
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
    return PartPlan(
        skeleton=flat.skeleton,
        names=_unique_names(flat.paths),
        dtypes=[str(t.dtype).removeprefix("torch.") for t in flat.tensors],
        shapes=[list(t.shape) for t in flat.tensors],
        devices=[str(t.device) for t in flat.tensors],
        offsets=offsets,
        data_size=cursor,
        extra=dict(extra or {}),
    )


def write_flat(
    path: str | os.PathLike,
    flat: FlatState,
    *,
    extra: Mapping[str, Any] | None = None,
    plan: PartPlan | None = None,
    recycle: str | os.PathLike | None = None,
    dirty_path: str | os.PathLike | None = None,
    fsync: bool = True,
) -> WriteResult:
    """Write a flattened state to ``path`` through a dirty name (see module invariants).

    ``plan`` is ``plan_part(flat, extra)`` when the caller already made it (``extra`` is then unused).
    ``recycle`` names an expired part file whose pages are reused for this one (rewriting an existing
    tmpfs file is several times faster than filling a new one); the caller guarantees nothing needs it.
    """
    plan = plan if plan is not None else plan_part(flat, extra)
    views = [byte_view(_prepare(t)) for t in flat.tensors]
    return write_planned(path, plan, views, recycle=recycle, dirty_path=dirty_path, fsync=fsync)


def write_planned(
    path: str | os.PathLike,
    plan: PartPlan,
    views: Sequence[memoryview],
    *,
    recycle: str | os.PathLike | None = None,
    dirty_path: str | os.PathLike | None = None,
    fsync: bool = True,
    checksums: Sequence[str] | None = None,
) -> WriteResult:
    """Write a planned part: ``views`` are each tensor's bytes (skeleton order), e.g. slices of a
    staging buffer laid out as planned; ``checksums`` (same order), when the caller computed them
    from these very bytes already, spare the hashing pass."""
    start = time.perf_counter()
    path = Path(path)
    dirty = Path(dirty_path) if dirty_path is not None else dirty_name(path)
    order = plan.file_order
    if _recycled_as(recycle, dirty):
        fd = os.open(dirty, os.O_WRONLY)
    else:
        fd = os.open(dirty, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.lseek(fd, plan.data_start(), os.SEEK_SET)
        if checksums is not None:
            _check_count(checksums, plan)
            _write_data(fd, [views[i] for i in order])
            sums = list(checksums)
        else:
            ordered = _write_and_hash(fd, [views[i] for i in order])
            sums = [""] * len(views)
            for i, h in zip(order, ordered):
                sums[i] = h
        os.ftruncate(fd, plan.file_size())
    except BaseException:
        os.close(fd)
        _unlink_quietly(dirty)
        raise
    return _seal(fd, dirty, path, plan, sums, fsync, start)


def _recycled_as(recycle: str | os.PathLike | None, dirty: Path) -> bool:
    """Rename an expired file to ``dirty`` so that its pages are reused; False when there is none
    (or its pages are mapped copy-on-write by loaded tensors)."""
    if recycle is None or not os.path.exists(recycle) or is_mapped(recycle):
        return False
    os.replace(recycle, dirty)
    return True


def prepare_planned(
    dirty_path: str | os.PathLike, plan: PartPlan, recycle: str | os.PathLike | None = None
) -> int:
    """Make ``dirty_path`` a file of the planned part's size whose data section a caller then fills
    in place (through a shared mapping) before :func:`seal_planned`; returns the file size.

    ``recycle`` names an expired file whose pages are reused. Space is reserved here, so a full
    disk fails now with ENOSPC instead of as SIGBUS while the mapping is written.
    """
    dirty = Path(dirty_path)
    total = plan.file_size()
    _recycled_as(recycle, dirty)
    fd = os.open(dirty, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve(fd, total)
    except BaseException:
        _unlink_quietly(dirty)
        raise
    finally:
        os.close(fd)
    return total


def reserve(fd: int, nbytes: int) -> None:
    """Make the open file ``nbytes`` long with its space allocated, so that filling it through a
    mapping cannot fail later (ENOSPC now instead of SIGBUS then). A longer file is cut; one of the
    right size is taken as allocated already (a recycled spare was a complete file): reserving
    256 MiB that exist again costs 15-90 ms on tmpfs here."""
    size = os.fstat(fd).st_size
    if size > nbytes:
        os.ftruncate(fd, nbytes)
    elif size < nbytes:
        os.posix_fallocate(fd, 0, nbytes)


def seal_planned(
    path: str | os.PathLike,
    plan: PartPlan,
    *,
    dirty_path: str | os.PathLike | None = None,
    fsync: bool = True,
    checksums: Sequence[str] | None = None,
) -> WriteResult:
    """Finish a part whose data section was written in place (see :func:`prepare_planned`): hash it
    unless ``checksums`` are given, write the header, fsync and rename the dirty file to ``path``."""
    start = time.perf_counter()
    path = Path(path)
    dirty = Path(dirty_path) if dirty_path is not None else dirty_name(path)
    fd = os.open(dirty, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != plan.file_size():
            raise CheckpointingError(f"{dirty}: not the planned size; was it prepared?")
        if checksums is not None:
            _check_count(checksums, plan)
            sums = list(checksums)
        else:
            sums = _hash_planned(fd, plan)
    except BaseException:
        os.close(fd)
        _unlink_quietly(dirty)
        raise
    return _seal(fd, dirty, path, plan, sums, fsync, start)


def _hash_planned(fd: int, plan: PartPlan) -> list[str]:
    """Each planned tensor's checksum, read through a mapping of the file (no copy)."""
    return _mapped_checksums(fd, plan.file_size(), plan.data_start(), plan.offsets)


def _mapped_checksums(
    fd: int, file_size: int, data_start: int, ranges: Sequence[tuple[int, int]]
) -> list[str]:
    """The checksum of each ``(begin, end)`` range of a file's data section, hashed from a read-only
    mapping on two threads (no copy into process memory)."""
    import mmap as mmap_module

    if file_size == 0:
        return [checksum(b"") for _ in ranges]
    mapping = mmap_module.mmap(
        fd,
        file_size,
        flags=mmap_module.MAP_SHARED | getattr(mmap_module, "MAP_POPULATE", 0),
        prot=mmap_module.PROT_READ,
    )

    def digest(span: tuple[int, int]) -> str:
        with memoryview(mapping) as whole:
            with whole[data_start + span[0] : data_start + span[1]] as part:
                return checksum(part)

    try:
        with ThreadPoolExecutor(2, thread_name_prefix="tierpoint-verify") as pool:
            return list(pool.map(digest, ranges))
    finally:
        mapping.close()


def _check_count(checksums: Sequence[str], plan: PartPlan) -> None:
    if len(checksums) != len(plan.offsets):
        raise CheckpointingError(
            f"{len(checksums)} checksums given for {len(plan.offsets)} tensors"
        )


def _seal(
    fd: int,
    dirty: Path,
    path: Path,
    plan: PartPlan,
    sums: Sequence[str],
    fsync: bool,
    start: float,
) -> WriteResult:
    """Write the header of a part whose data is in place, fsync, close ``fd``, rename to ``path``."""
    try:
        header = plan.header(sums)
        if len(header) != plan.header_size():  # pragma: no cover - fixed-width checksum fields
            raise CheckpointingError("internal error: header length changed while writing")
        os.pwrite(fd, struct.pack("<Q", len(header)) + header, 0)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(dirty)
        raise
    os.close(fd)
    os.replace(dirty, path)
    if fsync:
        fsync_dir(path.parent)
    return WriteResult(str(path), plan.file_size(), time.perf_counter() - start)


def _sum_field(value: str) -> bytes:
    return f'"{CHECKSUM_KEY}":"{value}"'.encode()


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# ----------------------------------------------------------------------------------------- reading


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


def _fail(path: str, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(path, reason)


def read_header(path: str | os.PathLike) -> PartHeader:
    """Read and validate the header of a part file (no tensor data is read)."""
    with _open_part(str(path)) as f:
        return _read_header_from(f, str(path))


def _open_part(path: str) -> Any:
    """Open a part file for reading; anything but a regular file is refused. ``O_NONBLOCK``: opening
    a FIFO would wait for a writer forever (on a regular file the flag changes nothing)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _fail(path, "not a regular file")
        return open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _read_header_from(f: Any, path: str) -> PartHeader:
    file_size = os.fstat(f.fileno()).st_size
    n = _header_length(f.read(8), file_size, path)
    raw = f.read(n)
    if len(raw) != n:
        raise _fail(path, "truncated while reading the header")
    return _decode_header(raw, file_size, path)


def _header_length(prefix: bytes, file_size: int, path: str) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file's size."""
    if len(prefix) < 8:
        raise _fail(path, f"truncated: {file_size} bytes is too short to hold a header")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if 8 + n > file_size:
        raise _fail(path, f"truncated: header claims {n} bytes but the file has {file_size}")
    return n


def _decode_header(raw: bytes, file_size: int, path: str) -> PartHeader:
    """Parse and check the JSON header (``raw``, without the length prefix) of a file of ``file_size``."""
    n = len(raw)
    header = _parse_json(raw, "header", path)
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != "tierpoint":
        raise _fail(path, "not a tierpoint part file (no tierpoint __metadata__)")
    stored_sum = meta.get(CHECKSUM_KEY)
    if not isinstance(stored_sum, str) or len(stored_sum) != 16:
        raise _fail(path, "header checksum is missing")
    field = _sum_field(stored_sum)
    if raw.count(field) != 1:
        raise _fail(path, "header checksum field is malformed")
    if checksum(raw.replace(field, _sum_field(_ZERO_SUM))) != stored_sum:
        raise _fail(path, "header checksum mismatch (the header was modified or damaged)")
    inner = meta.get("tierpoint")
    if not isinstance(inner, str):
        raise _fail(path, "tierpoint metadata is missing")
    doc = _parse_json(inner, "tierpoint metadata", path)
    if not isinstance(doc, dict):
        raise _fail(path, "tierpoint metadata is not a JSON object")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise _fail(
            path, f"unsupported format version {version!r} (this tierpoint reads {FORMAT_VERSION})"
        )
    if "skeleton" not in doc:
        raise _fail(path, "the state skeleton is missing")
    data_start = 8 + n
    records = _validate_records(doc.get("tensors"), header, file_size - data_start, path)
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise _fail(path, "extra metadata is not a JSON object")
    return PartHeader(path, data_start, file_size, records, doc.get("skeleton"), extra, version)


def _validate_records(
    raw_records: Any, entries: dict[str, Any], data_size: int, path: str
) -> tuple[TensorRecord, ...]:
    if not isinstance(raw_records, list):
        raise _fail(path, "tensor records are missing")
    if len(raw_records) != len(entries):
        raise _fail(path, f"{len(raw_records)} tensor records but {len(entries)} header entries")
    records = []
    names: set[str] = set()
    for rec in raw_records:
        if not (isinstance(rec, list) and len(rec) == 5):
            raise _fail(path, f"malformed tensor record {str(rec)[:80]!r}")
        name, dtype_name, shape, sum_hex, device = rec
        entry = entries.get(name) if isinstance(name, str) else None
        if not isinstance(entry, dict):
            raise _fail(path, f"tensor {str(name)[:80]!r} has no header entry")
        if name in names:  # else another entry would go unchecked
            raise _fail(path, f"tensor {name!r} has two records")
        names.add(name)
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise _fail(path, f"tensor {name!r} has unknown dtype {str(dtype_name)[:40]!r}")
        if not (
            isinstance(shape, list)
            and len(shape) <= MAX_DIMS
            and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise _fail(path, f"tensor {name!r} has an invalid shape {str(shape)[:80]}")
        offsets = entry.get("data_offsets")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        ):
            raise _fail(path, f"tensor {name!r} has invalid data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise _fail(
                path, f"tensor {name!r} lies outside the file (bytes {begin}..{end} of {data_size})"
            )
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise _fail(
                path,
                f"tensor {name!r}: shape {shape} x {dtype} needs {expected} bytes, entry has {end - begin}",
            )
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:  # e.g. [0, 2**63]
            raise _fail(path, f"tensor {name!r} has an invalid shape {str(shape)[:80]} (too large)")
        code = _NATIVE_CODES.get(dtype, "U8")
        if entry.get("dtype") != code:
            raise _fail(
                path,
                f"tensor {name!r}: header dtype {entry.get('dtype')!r} disagrees with {dtype_name}",
            )
        if entry.get("shape") != (shape if dtype in _NATIVE_CODES else [expected]):
            raise _fail(  # safetensors would read another tensor than tierpoint does
                path,
                f"tensor {name!r}: header shape {str(entry.get('shape'))[:80]} disagrees with {shape}",
            )
        if not (isinstance(sum_hex, str) and len(sum_hex) == 16) or not isinstance(device, str):
            raise _fail(path, f"tensor {name!r} has a malformed checksum or device")
        records.append(TensorRecord(name, dtype, tuple(shape), begin, end, sum_hex, device))
    cursor = 0
    for r in sorted(records, key=lambda r: (r.begin, r.end)):
        if r.begin != cursor:
            kind = "overlaps another tensor" if r.begin < cursor else "leaves a gap before it"
            raise _fail(path, f"tensor {r.name!r} {kind} (offset {r.begin}, expected {cursor})")
        cursor = r.end
    if cursor != data_size:
        if cursor < data_size:
            raise _fail(
                path, f"file has {data_size - cursor} unexpected bytes after the last tensor"
            )
        raise _fail(path, "truncated tensor data")  # pragma: no cover - caught per tensor above
    return tuple(records)


def _read_exact(f: Any, view: memoryview, path: str, name: str) -> None:
    while len(view):
        n = f.readinto(view[:_IO_CHUNK])
        if not n:
            raise _fail(path, f"truncated while reading tensor {name!r}")
        view = view[n:]


def read_flat(
    path: str | os.PathLike,
    *,
    verify: bool = True,
    targets: Sequence[torch.Tensor | None] | None = None,
    mmap: bool = False,
) -> tuple[PartHeader, list[torch.Tensor]]:
    """Read a part file's tensors (CPU), in skeleton order.

    ``targets`` (optional, skeleton order) are tensors to read into: each must match the stored dtype and
    shape; contiguous CPU targets are filled in place with no extra copy. ``None`` entries are allocated.

    ``mmap=True`` (without targets) maps the file copy-on-write instead of reading it: no copy and no
    fresh memory, the fastest load from a RAM disk. The tensors then share one storage with the mapping,
    and the file is registered so that tierpoint never rewrites it in place (see :func:`is_mapped`).
    """
    path = str(path)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    with _open_part(path) as f:
        header = _read_header_from(f, path)
        if mmap and targets is None:
            tensors = _map_tensors(f, header)
            if verify:
                _verify_tensors(header, tensors)
        else:
            tensors, copies = _plan_targets(header, targets)
            _read_tensors(f, header, tensors, verify)
    for target, staged in copies:
        with torch.no_grad():
            target.copy_(staged)
    if targets is not None:
        tensors = [t if t is not None else tensors[i] for i, t in enumerate(targets)]
    return header, tensors


def _plan_targets(
    header: PartHeader, targets: Sequence[torch.Tensor | None] | None
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The CPU tensors to read into, and the (target, staged) copies to make after verification."""
    records, path = header.records, header.path
    if targets is not None and len(targets) != len(records):
        raise CheckpointingError(f"{path}: {len(targets)} targets given for {len(records)} tensors")
    out: list[torch.Tensor] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, rec in enumerate(records):
        target = targets[i] if targets is not None else None
        if target is None:
            out.append(torch.empty(rec.shape, dtype=rec.dtype))
            continue
        if target.dtype != rec.dtype or tuple(target.shape) != rec.shape:
            raise CheckpointingError(
                f"{path}: tensor {rec.name!r} is stored as {rec.dtype} {list(rec.shape)}, "
                f"target is {target.dtype} {list(target.shape)}"
            )
        if target.device.type == "cpu" and target.is_contiguous() and not target.requires_grad:
            out.append(target)
        else:
            staged = torch.empty(rec.shape, dtype=rec.dtype)
            copies.append((target, staged))
            out.append(staged)
    return out, copies


def _read_tensors(f: Any, header: PartHeader, tensors: list[torch.Tensor], verify: bool) -> None:
    """Read every tensor in file order; with ``verify``, each chunk is hashed right after it was read
    (see :class:`_ChunkHasher`)."""
    records = header.records
    order = sorted(range(len(records)), key=lambda i: records[i].begin)
    hashers = {i: xxhash.xxh3_64() for i in order}
    chunks = _ChunkHasher()
    try:
        f.seek(header.data_start)
        for i in order:
            view = byte_view(tensors[i])
            for offset in range(0, len(view), _HASH_CHUNK):
                piece = view[offset : offset + _HASH_CHUNK]
                _read_exact(f, piece, header.path, records[i].name)
                if verify:
                    chunks.update(hashers[i], piece)
        chunks.drain()
    finally:
        chunks.close()
    if verify:
        for i in order:
            if hashers[i].hexdigest() != records[i].checksum:
                raise _fail(header.path, f"checksum mismatch in tensor {records[i].name!r}")


_mapped_inodes: Counter[tuple[int, int]] = Counter()
"""Live copy-on-write mappings per file (device, inode); an entry goes when its tensors are freed."""


def is_mapped(path: str | os.PathLike) -> bool:
    """Whether tensors of a ``read_flat(mmap=True)`` mapping of this file are alive in this process
    (then it must not be rewritten in place)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return _mapped_inodes[(st.st_dev, st.st_ino)] > 0


def _unmapped(key: tuple[int, int]) -> None:
    _mapped_inodes[key] -= 1
    if _mapped_inodes[key] <= 0:
        del _mapped_inodes[key]


def _map_tensors(f: Any, header: PartHeader) -> list[torch.Tensor]:
    import mmap as mmap_module

    st = os.fstat(f.fileno())
    mapping = mmap_module.mmap(
        f.fileno(),
        header.file_size,
        flags=mmap_module.MAP_PRIVATE,
        prot=mmap_module.PROT_READ | mmap_module.PROT_WRITE,
    )
    key = (st.st_dev, st.st_ino)
    _mapped_inodes[key] += 1
    weakref.finalize(mapping, _unmapped, key)
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    out = []
    for rec in header.records:
        raw = base[header.data_start + rec.begin : header.data_start + rec.end]
        try:
            out.append(raw.view(rec.dtype).view(rec.shape))
        except RuntimeError:  # dtypes without a byte view (sub-byte shells): copy out instead
            t = torch.empty(rec.shape, dtype=rec.dtype)
            byte_view(t)[:] = memoryview(raw.numpy())
            out.append(t)
    return out


def _verify_tensors(header: PartHeader, tensors: Sequence[torch.Tensor]) -> None:
    """Check every tensor against its recorded checksum, on two threads (xxhash releases the GIL)."""
    records = header.records
    with ThreadPoolExecutor(2, thread_name_prefix="tierpoint-verify") as pool:
        sums = list(pool.map(lambda t: checksum(byte_view(t)), tensors))
    for rec, got in zip(records, sums):
        if got != rec.checksum:
            raise _fail(header.path, f"checksum mismatch in tensor {rec.name!r}")


def read(
    path: str | os.PathLike,
    *,
    verify: bool = True,
    allow_pickle: bool = False,
    targets: Sequence[torch.Tensor | None] | None = None,
) -> Any:
    """Read a part file back into the state that was written (CPU tensors)."""
    header, tensors = read_flat(path, verify=verify, targets=targets)
    return unflatten_checked(header, tensors, allow_pickle=allow_pickle)


def unflatten_checked(
    header: PartHeader, tensors: list[torch.Tensor], *, allow_pickle: bool = False
) -> Any:
    try:
        return unflatten(header.skeleton, tensors, allow_pickle=allow_pickle)
    except SkeletonError as e:
        raise CorruptCheckpointError(header.path, f"bad state skeleton: {e}") from None


class PartVerifier:
    """Checks a part file while its bytes arrive in order, e.g. bucket by bucket from a peer.

    ``data`` is the whole file's memory (filled front to back); after each arrival call
    ``advance(available)`` with how many leading bytes are now final: the header is checked as soon
    as it is complete, and each tensor's checksum is computed over the bytes that arrived, so by the
    time the last byte lands only that last piece is left to hash. ``finish()`` (after
    ``advance(len(data))``) raises :class:`CorruptCheckpointError` unless header and every tensor
    checksum hold, and returns the header. The same checks as :func:`verify`.
    """

    def __init__(self, path: str | os.PathLike, data: memoryview) -> None:
        self.path = str(path)
        self._data = data
        self._available = 0
        self._header: PartHeader | None = None
        self._pending: list[TensorRecord] = []  # records not hashed to their end, by position
        self._hasher = xxhash.xxh3_64()
        self._hashed_to = 0  # absolute offset the current record's hasher has consumed

    def advance(self, available: int) -> None:
        self._available = max(self._available, min(available, len(self._data)))
        if self._header is None:
            if self._available < min(8, len(self._data)):
                return
            n = _header_length(bytes(self._data[:8]), len(self._data), self.path)
            if self._available < 8 + n:
                return
            self._header = _decode_header(bytes(self._data[8 : 8 + n]), len(self._data), self.path)
            self._pending = sorted(self._header.records, key=lambda r: r.begin, reverse=True)
            if self._pending:
                self._hashed_to = self._header.data_start + self._pending[-1].begin
        start = self._header.data_start
        while self._pending:
            rec = self._pending[-1]
            end = min(start + rec.end, self._available)
            if end > self._hashed_to:
                self._hasher.update(self._data[self._hashed_to : end])
                self._hashed_to = end
            if end < start + rec.end:
                return
            if self._hasher.hexdigest() != rec.checksum:
                raise _fail(self.path, f"checksum mismatch in tensor {rec.name!r}")
            self._pending.pop()
            self._hasher.reset()
            if self._pending:
                self._hashed_to = start + self._pending[-1].begin

    def finish(self) -> PartHeader:
        self.advance(len(self._data))
        if self._header is None:  # pragma: no cover - advance(len) parses the header or raises
            raise _fail(self.path, "header never arrived")
        return self._header


def verify(path: str | os.PathLike) -> PartHeader:
    """Check a part file completely (header and every tensor checksum) without keeping its tensors.

    Hashes a read-only mapping of the file on two threads (no copy into process memory).
    """
    path = str(path)
    with _open_part(path) as f:
        header = _read_header_from(f, path)
        if not header.records:
            return header
        spans = [(rec.begin, rec.end) for rec in header.records]
        sums = _mapped_checksums(f.fileno(), header.file_size, header.data_start, spans)
    for rec, got in zip(header.records, sums):
        if got != rec.checksum:
            raise _fail(path, f"checksum mismatch in tensor {rec.name!r}")
    return header
