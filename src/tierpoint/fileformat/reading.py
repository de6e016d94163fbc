"""Reading and verifying part files: every byte checked against the header before it is trusted.

Call order: ``read(path)`` (the state back) or ``read_flat(path)`` (header and tensors, into given
targets, or mapped copy-on-write with ``mmap=True``); ``read_header(path)`` for a cheap structural
check; ``verify(path)`` for a full check without keeping tensors; :class:`PartVerifier` to check a
file while its bytes arrive from a peer.

Invariants: only regular files are opened (a FIFO or device is refused, never waited on); with
``verify`` (the default) a tensor whose bytes do not match its checksum raises
:class:`CorruptCheckpointError` before the caller sees any tensor, and given targets are written only
after verification; files whose pages are mapped by live tensors are registered (:func:`is_mapped`)
so that no writer reuses their pages.
"""

from __future__ import annotations

import mmap as mmap_module
import os
import stat
import warnings
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from ..errors import CheckpointingError, CorruptCheckpointError, UnsupportedStateError
from ..tree import SkeletonError, unflatten
from .header import PartHeader, TensorRecord, decode_header, header_length
from .tensor_bytes import (
    HASH_CHUNK,
    IO_CHUNK,
    ChunkHasher,
    byte_view,
    checksum,
    mapped_checksums,
)


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
            raise CorruptCheckpointError(path, "not a regular file")
        return open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _read_header_from(f: Any, path: str) -> PartHeader:
    file_size = os.fstat(f.fileno()).st_size
    n = header_length(f.read(8), file_size, path)
    raw = f.read(n)
    if len(raw) != n:
        raise CorruptCheckpointError(path, "truncated while reading the header")
    return decode_header(raw, file_size, path)


def _read_exact(f: Any, view: memoryview, path: str, name: str) -> None:
    while len(view):
        n = f.readinto(view[:IO_CHUNK])
        if not n:
            raise CorruptCheckpointError(path, f"truncated while reading tensor {name!r}")
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
    fresh memory, the fastest load from a RAM disk. Each tensor has its own storage over its bytes of
    the mapping (the mapping lives until every tensor is freed), and the file is registered so that tierpoint never rewrites it in place (see :func:`is_mapped`).
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
    (see :class:`ChunkHasher`)."""
    records = header.records
    order = sorted(range(len(records)), key=lambda i: records[i].begin)
    hashers = {i: xxhash.xxh3_64() for i in order}
    chunks = ChunkHasher()
    try:
        f.seek(header.data_start)
        for i in order:
            view = byte_view(tensors[i])
            for offset in range(0, len(view), HASH_CHUNK):
                piece = view[offset : offset + HASH_CHUNK]
                _read_exact(f, piece, header.path, records[i].name)
                if verify:
                    chunks.update(hashers[i], piece)
        chunks.drain()
    finally:
        chunks.close()
    if verify:
        _check_sums(
            header.path, [records[i] for i in order], [hashers[i].hexdigest() for i in order]
        )


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
    out = []
    for rec in header.records:
        if rec.end == rec.begin:
            out.append(torch.empty(rec.shape, dtype=rec.dtype))
            continue
        # One storage per tensor, over exactly its bytes: a view into one storage of the whole file
        # would be saved whole by torch.save and crashes torch.set_rng_state (it ignores offsets).
        raw = torch.frombuffer(
            mapping,
            dtype=torch.uint8,
            count=rec.end - rec.begin,
            offset=header.data_start + rec.begin,
        )
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
    _check_sums(header.path, records, sums)


def _check_sums(path: str, records: Sequence[TensorRecord], sums: Sequence[str]) -> None:
    """Raise for the first record whose checksum is not the one computed (same order)."""
    for rec, got in zip(records, sums):
        if got != rec.checksum:
            raise CorruptCheckpointError(path, f"checksum mismatch in tensor {rec.name!r}")


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
    header: PartHeader,
    tensors: list[torch.Tensor],
    *,
    allow_pickle: bool = False,
    build_dtensors: bool = True,
) -> Any:
    try:
        return unflatten(
            header.skeleton, tensors, allow_pickle=allow_pickle, build_dtensors=build_dtensors
        )
    except SkeletonError as e:
        raise CorruptCheckpointError(header.path, f"bad state skeleton: {e}") from None


class PartVerifier:
    """Checks a part file while its bytes arrive in order, e.g. bucket by bucket from a peer.

    ``data`` is the whole file's memory (filled front to back); after each arrival call
    ``advance(available)`` with how many leading bytes are now final: the header is checked as soon
    as it is complete, and each tensor's checksum is computed over the bytes that arrived, so by the
    time the last byte lands only that last piece is left to hash. ``finish()`` (after
    ``advance(len(data))``) raises :class:`CorruptCheckpointError` unless header and every tensor
    checksum hold, and returns the header. The checks of :func:`verify` but the skeleton, which
    whoever loads the file rebuilds (and checks) anyway.
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
            n = header_length(bytes(self._data[:8]), len(self._data), self.path)
            if self._available < 8 + n:
                return
            self._header = decode_header(bytes(self._data[8 : 8 + n]), len(self._data), self.path)
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
                raise CorruptCheckpointError(self.path, f"checksum mismatch in tensor {rec.name!r}")
            self._pending.pop()
            self._hasher.reset()
            if self._pending:
                self._hashed_to = start + self._pending[-1].begin

    def finish(self) -> PartHeader:
        self.advance(len(self._data))
        if self._header is None:  # pragma: no cover - advance(len) parses the header or raises
            raise CorruptCheckpointError(self.path, "header never arrived")
        return self._header


def verify(path: str | os.PathLike) -> PartHeader:
    """Check a part file completely (header, every tensor checksum, and that the state skeleton
    rebuilds) without keeping its tensors.

    Hashes a read-only mapping of the file on two threads (no copy into process memory). Pickled
    objects in the skeleton are not unpickled (a file holding them passes; loading it then needs
    ``allow_pickle=True``).
    """
    path = str(path)
    with _open_part(path) as f:
        header = _read_header_from(f, path)
        spans = [(rec.begin, rec.end) for rec in header.records]
        sums = mapped_checksums(f.fileno(), header.file_size, header.data_start, spans)
    _check_sums(path, header.records, sums)
    _check_skeleton(header)
    return header


def _check_skeleton(header: PartHeader) -> None:
    """Rebuild the state over one-element stand-ins for the tensors: a skeleton a load would refuse
    raises :class:`CorruptCheckpointError` here. Pickled objects are left unread."""
    with warnings.catch_warnings():  # complex32 stand-ins warn that the dtype is experimental
        warnings.simplefilter("ignore", UserWarning)
        stand_ins = [torch.empty((), dtype=r.dtype).expand(r.shape) for r in header.records]
    try:
        unflatten_checked(header, stand_ins, build_dtensors=False)  # any rank's part, any process
    except UnsupportedStateError:
        pass
