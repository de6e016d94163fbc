"""Find the raw bytes of one tensor inside a ``torch.save`` archive, without unpickling it.

torch DCP's filesystem writer stores each tensor item as a whole ``torch.save`` zip archive, back
to back in a ``.distcp`` file. The archive holds ``<prefix>/data.pkl`` (a tiny pickle:
``_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`` with the storage as a
persistent id ``('storage', <type>, key, location, numel)``), ``<prefix>/byteorder`` and the raw
storage bytes in ``<prefix>/data/<key>``, all stored uncompressed; the central directory at the end
says where each entry starts (local headers carry no sizes: bit 3 of their flags is set).

``locate(read_at, length, what)`` reads the central directory, the data pickle (through the
restricted unpickler of :mod:`tierpoint.dcp.restricted_pickle`, with an allow-list of its own: the
only globals it accepts are the rebuild functions, storage types, ``OrderedDict`` and dtypes, and
each resolves to a recorder, so nothing named in the file is called) and the entry headers, checks
every offset and size against ``length``, and returns a :class:`SavedTensor`: where the storage
bytes are and how the tensor views them. The caller then reads those bytes straight into its
destination.

Archives that are valid but unusual (big-endian bytes, conj/neg view bits, compressed entries) raise
:class:`NeedsTorchLoad`, which says how many bytes the entries unpack to (what ``torch.load`` would
allocate); the caller checks that, then falls back to ``torch.load(weights_only=True)`` on the item.
Anything malformed raises :class:`BadRecord` with the reason.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .restricted_pickle import DTYPES, MAX_DIMS, MAX_INT, AllowList, brief, restricted_load

MAX_ENTRIES = 64
MAX_PICKLE_BYTES = 1 << 20
TAIL_WINDOW = 8192
HEAD_WINDOW = 4096
WHOLE_ITEM = 64 * 1024
"""Items up to this size are read in one go and parsed from memory."""
MAX_DIRECTORY_BYTES = 1 << 20
"""Largest central directory accepted (a saved tensor's has a few short entries)."""

_EOCD = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")


class BadRecord(Exception):
    """The item is not a well-formed ``torch.save`` archive of one tensor; the message says why."""


class NeedsTorchLoad(Exception):
    """A valid archive this fast path does not decode; ``torch.load(weights_only=True)`` can.
    ``unpacked``: the bytes its entries declare once unpacked (``torch.load`` allocates them)."""

    def __init__(self, reason: str, unpacked: int = 0) -> None:
        super().__init__(reason)
        self.unpacked = unpacked


@dataclass(frozen=True)
class SavedTensor:
    data_offset: int
    """Offset of the storage bytes from the start of the item."""
    storage_nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    """In elements, as torch counts it."""

    def is_contiguous(self) -> bool:
        expected = 1
        for dim, stride in zip(reversed(self.size), reversed(self.stride)):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True


class _Window:
    """Serves reads of an item from a few cached byte ranges, reading through otherwise."""

    def __init__(self, read_at: Callable[[int, int], bytes], length: int) -> None:
        self.read_at = read_at
        self.length = length
        self.cached: list[tuple[int, bytes]] = []

    def cache(self, offset: int, n: int) -> None:
        self.cached.append((offset, self.read_at(offset, n)))

    def get(self, offset: int, n: int, what: str) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.length:
            raise BadRecord(
                f"{what} at [{offset}, {offset + n}) lies outside the {self.length}-byte item"
            )
        for start, data in self.cached:
            if start <= offset and offset + n <= start + len(data):
                return data[offset - start : offset - start + n]
        return self.read_at(offset, n)


@dataclass(frozen=True)
class _Entry:
    name: str
    header: int
    size: int
    method: int
    unpacked: int


def _central_directory(win: _Window) -> dict[str, _Entry]:
    tail_start = max(0, win.length - TAIL_WINDOW)
    tail = win.get(tail_start, win.length - tail_start, "archive tail")
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        raise BadRecord("no zip end-of-directory record (not a torch.save archive, or truncated)")
    _, _, _, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    if at + _EOCD.size + comment != len(tail):
        raise BadRecord("zip end-of-directory record is not at the end of the item")
    if at >= _ZIP64_LOCATOR.size and tail[at - _ZIP64_LOCATOR.size : at - 16] == b"PK\x06\x07":
        _, _, z64_offset, _ = _ZIP64_LOCATOR.unpack_from(tail, at - _ZIP64_LOCATOR.size)
        rec = win.get(z64_offset, _ZIP64_EOCD.size, "zip64 end-of-directory record")
        sig, _, _, _, _, _, _, count, cd_size, cd_offset = _ZIP64_EOCD.unpack(rec)
        if sig != b"PK\x06\x06":
            raise BadRecord("zip64 locator points at no zip64 record")
    if count > MAX_ENTRIES:
        raise BadRecord(f"{count} archive entries (a saved tensor has under {MAX_ENTRIES})")
    if cd_size > MAX_DIRECTORY_BYTES:
        raise BadRecord(f"a central directory of {cd_size} bytes (a saved tensor's is tiny)")
    data = win.get(cd_offset, cd_size, "central directory")
    entries: dict[str, _Entry] = {}
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(data):
            raise BadRecord("central directory is cut short")
        fields = _CENTRAL.unpack_from(data, pos)
        sig, method = fields[0], fields[4]
        csize, usize = fields[8], fields[9]
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        header = fields[16]
        if sig != b"PK\x01\x02":
            raise BadRecord("central directory entry has a bad signature")
        end = pos + _CENTRAL.size + name_len + extra_len + comment_len
        if end > len(data):
            raise BadRecord("central directory entry is cut short")
        name = data[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len].decode("utf-8", "replace")
        extra = data[pos + _CENTRAL.size + name_len : pos + _CENTRAL.size + name_len + extra_len]
        usize, csize, header = _zip64_sizes(extra, usize, csize, header)
        if method == 0 and csize != usize:
            raise BadRecord(f"entry {name!r}: stored entry with differing sizes")
        if name in entries:
            raise BadRecord(f"entry {name!r} appears twice")
        entries[name] = _Entry(name, header, csize, method, usize)
        pos = end
    return entries


def _zip64_sizes(extra: bytes, usize: int, csize: int, header: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<2H", extra, pos)
        if pos + 4 + size > len(extra):
            raise BadRecord("malformed extra field in the central directory")
        if tag == 1:
            values = list(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if header == 0xFFFFFFFF and values:
                header = values.pop(0)
        pos += 4 + size
    return usize, csize, header


def _entry_data_offset(win: _Window, entry: _Entry) -> int:
    local = win.get(entry.header, _LOCAL.size, f"local header of {entry.name!r}")
    fields = _LOCAL.unpack(local)
    if fields[0] != b"PK\x03\x04":
        raise BadRecord(f"entry {entry.name!r}: bad local header signature")
    start = entry.header + _LOCAL.size + fields[9] + fields[10]
    if start + entry.size > win.length:
        raise BadRecord(
            f"entry {entry.name!r} needs bytes up to {start + entry.size}, item has {win.length}"
        )
    return start


# ------------------------------------------------------------------------------ the data pickle

_TYPED_STORAGES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _StorageType(NamedTuple):
    """Shared by every load: a tuple, so that no pickle opcode (``BUILD``) can change it."""

    dtype: torch.dtype | None
    """None for an untyped storage (numel counts bytes; the dtype comes with the rebuild call)."""


@dataclass(frozen=True)
class _StorageRef:
    stype: _StorageType
    key: str
    numel: int


@dataclass(frozen=True)
class _Rebuild:
    version: int
    args: tuple


def _rebuild(version: int) -> Callable[..., _Rebuild]:
    def record(*args: Any) -> _Rebuild:
        return _Rebuild(version, args)

    return record


def _ordered_dict(*args: Any) -> dict:
    if args:
        raise BadRecord("backward hooks in a saved tensor")
    return {}


_DATA_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild(2),
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild(3),
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("torch", "UntypedStorage"): _StorageType(None),
    ("collections", "OrderedDict"): _ordered_dict,
}
_DATA_GLOBALS.update({("torch", n): _StorageType(d) for n, d in _TYPED_STORAGES.items()})
_DATA_GLOBALS.update(DTYPES)


def _storage_ref(pid: Any) -> _StorageRef:
    """The persistent id ``('storage', <type>, key, location, numel)`` of the tensor's storage."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise BadRecord(f"unexpected persistent id {brief(pid)}")
    _, stype, key, _location, numel = pid
    if type(stype) is not _StorageType or not isinstance(key, str):
        raise BadRecord(f"unexpected storage reference {brief(pid)}")
    if type(numel) is not int or not 0 <= numel <= MAX_INT:
        raise BadRecord(f"storage size {brief(numel, 40)} is not an int in [0, 2**63)")
    return _StorageRef(stype, key, numel)


_DATA_PICKLE = AllowList(
    globals=_DATA_GLOBALS,
    refuse=BadRecord,
    where=" in the tensor's data.pkl",
    persistent=_storage_ref,
)
"""What a tensor's ``data.pkl`` may name: the rebuild recorders, storage types, dtypes."""


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > MAX_DIMS:
        raise BadRecord(f"{what} is {type(value).__name__}, want a tuple of ints")
    if not all(type(v) is int and 0 <= v <= MAX_INT for v in value):
        raise BadRecord(f"{what} {brief(value)} holds a negative, huge or non-int entry")
    return value


def _parse_data_pickle(data: bytes) -> tuple[_StorageRef, int, tuple, tuple, torch.dtype]:
    try:
        root, _ = restricted_load(data, _DATA_PICKLE)
    except (BadRecord, NeedsTorchLoad):
        raise
    except Exception as e:  # noqa: BLE001 - only recorders ran; any failure is a format error
        raise BadRecord(f"unreadable data.pkl ({e!r:.120})") from None
    if type(root) is not _Rebuild:
        raise BadRecord(f"data.pkl holds {type(root).__name__}, not one tensor")
    args = root.args
    nfixed = 6 if root.version == 2 else 7
    if len(args) not in (nfixed, nfixed + 1):
        raise BadRecord(f"rebuild call with {len(args)} arguments")
    storage, offset, size, stride, _requires_grad, hooks = args[:6]
    if type(storage) is not _StorageRef:
        raise BadRecord("the tensor's storage is not a storage reference")
    if type(offset) is not int or not 0 <= offset <= MAX_INT:
        raise BadRecord(f"storage offset {brief(offset, 40)} is not an int in [0, 2**63)")
    if hooks != {}:
        raise BadRecord("backward hooks in a saved tensor")
    if len(args) == nfixed + 1 and args[-1]:
        raise NeedsTorchLoad(f"tensor metadata {brief(args[-1], 60)} (conj/neg bits)")
    if root.version == 3:
        dtype = args[6]
        if not isinstance(dtype, torch.dtype) or storage.stype.dtype is not None:
            raise BadRecord("rebuild v3 without an untyped storage and a dtype")
    else:
        dtype = storage.stype.dtype
        if dtype is None:
            raise BadRecord("rebuild v2 with an untyped storage")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise BadRecord(f"size {size} and stride {stride} differ in rank")
    return storage, offset, size, stride, dtype


def locate(read_at: Callable[[int, int], bytes], length: int) -> SavedTensor:
    """Where the tensor's bytes are in a ``length``-byte item read by ``read_at(offset, n)``.

    ``read_at`` must return exactly ``n`` bytes (or raise). Raises :class:`BadRecord` or
    :class:`NeedsTorchLoad`.
    """
    win = _Window(read_at, length)
    if length <= WHOLE_ITEM:
        win.cache(0, length)
    else:
        win.cache(0, HEAD_WINDOW)
        win.cache(length - TAIL_WINDOW, TAIL_WINDOW)
    entries = _central_directory(win)
    try:
        return _find(win, entries)
    except NeedsTorchLoad as e:
        e.unpacked = sum(entry.unpacked for entry in entries.values())
        raise


def _find(win: _Window, entries: dict[str, _Entry]) -> SavedTensor:
    pickles = [n for n in entries if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise BadRecord("no single <prefix>/data.pkl entry in the archive")
    prefix = pickles[0][: -len("data.pkl")]
    if any(e.method != 0 for e in entries.values()):
        raise NeedsTorchLoad("compressed archive entries")
    pkl = entries[pickles[0]]
    if pkl.size > MAX_PICKLE_BYTES:
        raise BadRecord(f"data.pkl of {pkl.size} bytes (a tensor's is tiny)")
    pkl_data = win.get(_entry_data_offset(win, pkl), pkl.size, "data.pkl")
    storage, offset, size, stride, dtype = _parse_data_pickle(pkl_data)
    order = entries.get(prefix + "byteorder")
    if order is not None:
        value = win.get(_entry_data_offset(win, order), min(order.size, 16), "byteorder")
        if value == b"big":
            raise NeedsTorchLoad("big-endian tensor bytes")
        if value != b"little":
            raise BadRecord(f"unknown byte order {value!r}")
    entry = entries.get(f"{prefix}data/{storage.key}")
    if entry is None:
        raise BadRecord(f"storage {storage.key!r} has no data entry")
    itemsize = dtype.itemsize
    nbytes = storage.numel if storage.stype.dtype is None else storage.numel * itemsize
    if nbytes != entry.size or nbytes % itemsize:
        raise BadRecord(f"storage holds {entry.size} bytes, its header says {nbytes}")
    numel = 1
    for d in size:
        numel *= d
    if numel:
        last = offset + sum((d - 1) * s for d, s in zip(size, stride))
        if (last + 1) * itemsize > nbytes:
            raise BadRecord(
                f"tensor view {size}/{stride}+{offset} overruns its {nbytes}-byte storage"
            )
    return SavedTensor(
        data_offset=_entry_data_offset(win, entry),
        storage_nbytes=nbytes,
        dtype=dtype,
        size=size,
        stride=stride,
        storage_offset=offset,
    )
