"""Moving whole files between ranks over torch.distributed: bucketed, verified, committed atomically.

Used by peer replication (a part file goes to the members of its clique), by recovery (a lost part
comes back from a holder) and by the retrieval of node-local DCP objects.

Call order: every rank of the group calls :func:`move_files` with the same list of
:class:`FileMove` (computed alike everywhere, or planned on one rank and broadcast). A rank sends the
files it is the source of and receives the ones it is the destination of; the others return at once.

Protocol: for move ``i`` the source first sends a small header (the size, or -1: cannot send), then
the bytes in buckets of at most ``bucket_bytes``, then (``digest=True``) a trailer with the xxh3-64
of the bytes, computed while gloo sends. Every send and receive is posted non-blocking before
anything is waited for, so any pattern (pairs swapping files, rings, one source serving many)
completes without deadlock; every wait is bounded by ``timeout``. Buckets go straight from a mapping
of the source file into a mapping of the destination's dirty file: no intermediate copies, no memory
beyond the files themselves. The receiver checks each bucket as it lands (running digest, or the
caller's :class:`ReceiveCheck`), so verification overlaps the transfer instead of following it.

Invariants:
- A received file becomes visible only verified: written as ``<dst>.dirty``, checked against the
  sender's digest and/or the caller's check, fsynced, renamed to ``dst``, directory fsynced.
- Any failure (peer gone, timeout, mismatch, full disk) removes the dirty file and raises a
  :class:`CheckpointingError` naming the file and the peer; it never leaves a partial file visible.
  It fails that move only: the other moves are still posted and waited for, so a peer gone does
  not leave the healthy ones waiting for their files until the timeout.
- Tags never repeat within a process and group (a sequence per group that all ranks advance alike,
  one step per call), so a receive left over from a timed-out call can never match a later call's
  data; its destination mapping is kept alive (never unmapped) for the same reason. Calls on
  different groups may run at the same time on different threads (e.g. a background restore).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import xxhash

from .errors import CheckpointingError, CoordinationTimeoutError, CorruptCheckpointError
from .files import dirty_name, fsync_dir, reserve
from .files import unlink_quietly as _unlink

logger = logging.getLogger("tierpoint")

DEFAULT_BUCKET_BYTES = 64 << 20
_TAGS_PER_CALL = 1 << 20
_calls: dict[Any, itertools.count] = {}  # group -> call sequence
_calls_lock = threading.Lock()
_abandoned: list[Any] = []  # mappings a timed-out receive may still write into


@dataclass(frozen=True)
class FileMove:
    """Copy ``src_path`` on global rank ``src`` to ``dst_path`` on global rank ``dst``."""

    src: int
    dst: int
    src_path: str
    dst_path: str


@dataclass(frozen=True)
class MoveStats:
    """What this rank sent and received in one :func:`move_files` call."""

    sent_bytes: int
    received_bytes: int
    seconds: float


def _digest(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view) - (1 << 63)  # fits an int64


class ReceiveCheck(Protocol):
    """Checks a file while it arrives; made by ``verify(move, data)`` when its receive is posted."""

    def advance(self, available: int) -> None:
        """The first ``available`` bytes of ``data`` are final; raise to reject the file."""

    def finish(self) -> Any:
        """Everything arrived; raise to reject the file."""


class _DigestCheck:
    """Running xxh3-64 of the arriving bytes, compared with the sender's trailer at the end."""

    def __init__(self, move: FileMove, data: memoryview) -> None:
        self.move, self._data = move, data
        self._hasher = xxhash.xxh3_64()
        self._done = 0
        self.trailer = torch.zeros(1, dtype=torch.int64)

    def advance(self, available: int) -> None:
        if available > self._done:
            self._hasher.update(self._data[self._done : available])
            self._done = available

    def finish(self) -> None:
        self.advance(len(self._data))
        if self._hasher.intdigest() - (1 << 63) != int(self.trailer[0]):
            raise CorruptCheckpointError(
                self.move.dst_path,
                f"bytes received from rank {self.move.src} do not match its checksum",
            )


class _Tags:
    """Message tags of one call: below 2**31, disjoint from the previous 2047 calls' tags.

    A move's trailer uses the bucket tag after its last bucket."""

    def __init__(self, call: int, moves: int) -> None:
        self.base = (call % 2048) * _TAGS_PER_CALL
        self.moves = moves
        self.per_move = (_TAGS_PER_CALL - moves) // max(moves, 1)

    def header(self, move: int) -> int:
        return self.base + move

    def trailer(self, move: int, buckets: int) -> int:
        return self.bucket(move, buckets)

    def bucket(self, move: int, bucket: int) -> int:
        if bucket >= self.per_move:
            raise CheckpointingError(
                f"too many buckets for one file ({bucket + 1}); raise bucket_bytes"
            )
        return self.base + self.moves + move * self.per_move + bucket


def _map(path: str, nbytes: int, writable: bool) -> tuple[mmap.mmap | None, torch.Tensor]:
    """A shared mapping of ``path`` as a byte tensor, its pages faulted in up front (one populate
    instead of a page fault per 4 KiB while gloo moves the bytes)."""
    if nbytes == 0:
        return None, torch.empty(0, dtype=torch.uint8)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only source: only ever sent from
        return m, torch.frombuffer(m, dtype=torch.uint8)


_Mapping = tuple["mmap.mmap | None", torch.Tensor]


class _OneShotMappings:
    """Each file mapped for one call and unmapped after it (no :class:`MappingCache` given)."""

    def map(self, path: str, nbytes: int, writable: bool) -> _Mapping:
        return _map(path, nbytes, writable)

    def done(self, entry: _Mapping) -> None:
        if entry[0] is not None:
            entry[0].close()

    forget = done

    def abandon(self, entries: Iterable[_Mapping]) -> None:
        _abandoned.extend(entries)


class MappingCache:
    """Mappings kept from one :func:`move_files` call to the next, for files that come back.

    Checkpoint files circulate (an expired replica becomes a spare, the spare receives the next
    replica or is rewritten as the next own part), so mapping and populating 256 MiB anew every save
    is work thrown away. Entries are keyed by the file's (device, inode), always shared and writable
    (so one mapping serves sending and receiving), and re-checked against the file's size on every
    use. A mapping keeps a deleted file's pages alive: the owner calls :meth:`retain` with the files
    that still exist after it removes some, and :meth:`close` when done. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor]] = {}

    def map(self, path: str, nbytes: int, writable: bool) -> _Mapping:
        if nbytes == 0:
            return _map(path, 0, writable)
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            hit = self._maps.pop(key, None)
            if hit is not None and len(hit[0]) == nbytes == st.st_size:
                self._maps[key] = hit
                return hit
            if hit is not None:
                hit[0].close()
            entry = _map(path, nbytes, writable=True)
            self._maps[key] = entry  # type: ignore[assignment]
            return entry

    def done(self, entry: _Mapping) -> None:
        pass

    def forget(self, entry: _Mapping) -> None:
        """Unmap a file that is being deleted."""
        with self._lock:
            for key in [k for k, v in self._maps.items() if v[0] is entry[0]]:
                del self._maps[key]
        if entry[0] is not None:
            entry[0].close()

    def abandon(self, entries: Iterable[_Mapping]) -> None:
        """A receive into these may still be in flight: never hand them out (or unmap them) again."""
        gone = {id(e[0]) for e in entries}
        with self._lock:
            for key in [k for k, v in self._maps.items() if id(v[0]) in gone]:
                _abandoned.append(self._maps.pop(key))

    def retain(self, paths: Iterable[str | os.PathLike]) -> None:
        """Unmap every file that is not one of ``paths``."""
        keep = set()
        for path in paths:
            try:
                st = os.stat(path)
            except OSError:
                continue
            keep.add((st.st_dev, st.st_ino))
        with self._lock:
            for key in [k for k in self._maps if k not in keep]:
                self._maps.pop(key)[0].close()

    def close(self) -> None:
        self.retain(())

    def __len__(self) -> int:
        return len(self._maps)


def _failure(e: BaseException, what: str) -> CheckpointingError:
    """What a gloo error while ``what`` means to the caller (a timeout, or a peer gone)."""
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else "no detail"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CoordinationTimeoutError(f"{what}: timed out ({text})")
    return CheckpointingError(f"{what}: failed, the peer is probably gone ({text})")


def _post(send: bool, tensor: torch.Tensor, peer: int, group: Any, tag: int, what: str) -> Any:
    """``isend`` / ``irecv``; a peer already gone may fail it at once, not only at the wait."""
    try:
        if send:
            return dist.isend(tensor, peer, group=group, tag=tag)
        return dist.irecv(tensor, peer, group=group, tag=tag)
    except (RuntimeError, dist.DistError) as e:
        raise _failure(e, what) from e


def _wait(work: Any, what: str, deadline: float) -> None:
    """Wait for one posted send or receive, at most until ``deadline``."""
    left = max(0.001, deadline - time.monotonic())
    try:
        ok = work.wait(timeout=timedelta(seconds=left))
    except (RuntimeError, dist.DistError) as e:
        raise _failure(e, what) from e
    if ok is False:
        raise CoordinationTimeoutError(f"{what}: timed out")


def move_files(
    moves: Sequence[FileMove],
    group: Any = None,
    *,
    timeout: float = 300.0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    digest: bool = True,
    verify: Callable[[FileMove, memoryview], ReceiveCheck] | None = None,
    unavailable: str | None = None,
    reuse: Callable[[FileMove], str | None] | None = None,
    mappings: MappingCache | None = None,
) -> MoveStats:
    """Carry out ``moves`` (identical list on every rank of ``group``); see the module docstring.

    Args:
        group: a gloo process group spanning the ranks named in ``moves`` (default: the default group).
        timeout: seconds the whole call may take on this rank.
        bucket_bytes: largest single message.
        digest: the source hashes each file and the destination checks the hash.
        verify: ``verify(move, data)`` for each file this rank receives, ``data`` being the memory the
            file arrives in; the returned :class:`ReceiveCheck` sees each bucket land and may reject
            the file (e.g. :class:`tierpoint.fileformat.PartVerifier` checks a part file's checksums).
        unavailable: this rank cannot send its files (the reason): its destinations are told at once
            instead of waiting for the timeout, and this rank raises with that reason.
        reuse: for a file this rank receives, an existing file whose pages may be rewritten instead
            of filling a new one (renamed to the dirty name first; faster on tmpfs), or ``None``.
        mappings: keep this call's file mappings for later calls (see :class:`MappingCache`).

    Every rank completes the transfers that can complete, then raises the first failure it saw (a
    source that could not send fails its destinations without a timeout).
    """
    if bucket_bytes < 1:
        raise CheckpointingError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    with _calls_lock:
        call = next(_calls.setdefault(group, itertools.count()))
    tags = _Tags(call, len(moves))
    rank = dist.get_rank()
    start = time.monotonic()
    deadline = start + timeout
    mine = [(i, m) for i, m in enumerate(moves) if rank in (m.src, m.dst)]
    if not mine:
        return MoveStats(0, 0, 0.0)
    for _, m in mine:
        if m.src == m.dst:
            raise CheckpointingError(f"move of {m.src_path} has the same source and destination")
    mapper = mappings if mappings is not None else _OneShotMappings()
    failures: list[BaseException] = []
    if unavailable is not None:
        failures.append(CheckpointingError(unavailable))

    # A move whose send or receive failed (a peer gone, a timeout) fails alone: the others go on,
    # so that a healthy peer is not left waiting for its file until the timeout.
    failed: dict[int, CheckpointingError] = {}

    def post(i: int, send: bool, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        try:
            return _post(send, tensor, peer, group, tag, what)
        except CheckpointingError as e:
            failed.setdefault(i, e)
            return None

    def wait(pending: list[tuple[int, Any, str]]) -> None:
        for i, work, what in pending:
            try:
                _wait(work, what, deadline)
            except CheckpointingError as e:
                failed.setdefault(i, e)

    # Phase 1: sizes (-1: the source cannot send).
    sources: dict[int, tuple[mmap.mmap | None, torch.Tensor]] = {}
    headers: dict[int, torch.Tensor] = {}
    works: list[tuple[int, Any, str]] = []
    try:
        for i, m in mine:
            header = headers[i] = torch.full((1,), -1, dtype=torch.int64)
            if m.src == rank:
                if unavailable is None:
                    try:
                        nbytes = os.path.getsize(m.src_path)
                        sources[i] = mapper.map(m.src_path, nbytes, writable=False)
                        header[0] = nbytes
                    except OSError as e:
                        failures.append(CheckpointingError(f"cannot send {m.src_path}: {e}"))
                what = f"sending {m.src_path} to rank {m.dst}"
                work = post(i, True, header, m.dst, tags.header(i), what)
            else:
                what = f"receiving {m.dst_path} from rank {m.src}"
                work = post(i, False, header, m.src, tags.header(i), what)
            if work is not None:
                works.append((i, work, what))
        wait(works)
    except BaseException:
        mapper.abandon(sources.values())
        raise

    # Phase 2: the bytes of every move whose source could send, checked as they land.
    targets: dict[int, _Target] = {}
    checks: dict[int, list[ReceiveCheck]] = {}
    # (move, its receive work, how many leading bytes are final once it completes, description)
    arrivals: list[tuple[int, Any, int, str]] = []
    works = []
    sent = received = 0
    try:
        for i, m in mine:
            if i in failed:
                continue
            nbytes = int(headers[i][0])
            if nbytes < 0:
                if m.dst == rank:
                    failures.append(
                        CheckpointingError(
                            f"rank {m.src} could not send {m.src_path} (wanted for {m.dst_path})"
                        )
                    )
                continue
            buckets = range(0, nbytes, bucket_bytes)
            if m.src == rank:
                what = f"sending {m.src_path} to rank {m.dst}"
                data = sources[i][1]
                for b, begin in enumerate(buckets):
                    chunk = data[begin : begin + bucket_bytes]
                    work = post(i, True, chunk, m.dst, tags.bucket(i, b), what)
                    if work is None:
                        break
                    works.append((i, work, what))
                sent += nbytes
                continue
            what = f"receiving {m.dst_path} from rank {m.src}"
            trailer = torch.zeros(1, dtype=torch.int64)  # the digest; a scratch one when draining
            try:
                spare = reuse(m) if reuse else None
                target = targets[i] = _open_target(m.dst_path, nbytes, spare, mapper)
                view = target.tensor
                checks[i] = []
                if digest:
                    digest_check = _DigestCheck(m, target.memory)
                    trailer = digest_check.trailer
                    checks[i].append(digest_check)
                if verify is not None:
                    checks[i].append(verify(m, target.memory))
            except OSError as e:  # e.g. a full disk: drain the bytes so the source is not stuck
                failures.append(CheckpointingError(f"cannot write {m.dst_path}: {e}"))
                view = None
                scratch = torch.empty(min(nbytes, bucket_bytes), dtype=torch.uint8)
            for b, begin in enumerate(buckets):
                end = min(nbytes, begin + bucket_bytes)
                chunk = view[begin:end] if view is not None else scratch[: end - begin]
                work = post(i, False, chunk, m.src, tags.bucket(i, b), what)
                if work is None:
                    break
                arrivals.append((i, work, end, what))
            if digest and i not in failed:
                work = post(i, False, trailer, m.src, tags.trailer(i, len(buckets)), what)
                if work is not None:
                    works.append((i, work, what))
            received += nbytes
        if digest:  # hashed while gloo sends the buckets
            for i, m in mine:
                if i in sources and int(headers[i][0]) >= 0 and i not in failed:
                    m_map = sources[i][0]
                    trailer = torch.tensor([_digest(memoryview(m_map)) if m_map else _digest(b"")])
                    buckets = range(0, int(headers[i][0]), bucket_bytes)
                    what = f"sending {m.src_path} to rank {m.dst}"
                    work = post(i, True, trailer, m.dst, tags.trailer(i, len(buckets)), what)
                    if work is not None:
                        works.append((i, work, what))
        for i, work, end, what in arrivals:
            if i in failed:
                continue
            wait([(i, work, what)])
            if i in failed:
                continue
            for check in checks.get(i, ()):
                try:
                    check.advance(end)
                except CheckpointingError as e:
                    failures.append(e)
                    checks[i] = [_Rejected(e)]
                    break
        wait(works)
        for i, m in mine:
            if i in targets and i not in failed:
                try:
                    _commit(m, targets.pop(i), checks.get(i, ()), mapper)
                except (OSError, CheckpointingError) as e:
                    if not any(isinstance(c, _Rejected) for c in checks.get(i, ())):
                        failures.append(e)
    except BaseException as e:
        mapper.abandon(sources.values())
        for target in targets.values():
            _unlink(target.dirty)
        mapper.abandon((t.mapping, t.tensor) for t in targets.values())
        if isinstance(e, OSError):
            raise CheckpointingError(f"file transfer failed: {e}") from e
        raise
    # What a failed move's sends or receives still hold may yet be read or written by gloo.
    for target in targets.values():  # only failed moves' targets are left
        _unlink(target.dirty)
    mapper.abandon((t.mapping, t.tensor) for t in targets.values())
    mapper.abandon(entry for i, entry in sources.items() if i in failed)
    for i, entry in sources.items():
        if i not in failed:
            mapper.done(entry)
    failures.extend(failed[i] for i in sorted(failed))
    if failures:
        first = failures[0]
        if isinstance(first, OSError):
            raise CheckpointingError(f"file transfer failed: {first}") from first
        raise first
    seconds = time.monotonic() - start
    logger.debug("move_files: sent %d and received %d bytes in %.3f s", sent, received, seconds)
    return MoveStats(sent, received, seconds)


class _Rejected:
    """Stands in for the checks of a file already rejected while arriving: its commit fails."""

    def __init__(self, error: CheckpointingError) -> None:
        self.error = error

    def advance(self, available: int) -> None:
        pass

    def finish(self) -> None:
        raise self.error


@dataclass
class _Target:
    """A file being received: its mapping, the same bytes as a tensor and a memoryview, its path."""

    mapping: mmap.mmap | None
    tensor: torch.Tensor
    dirty: Path
    memory: memoryview

    def close(self, mapper: _OneShotMappings | MappingCache, keep: bool = True) -> None:
        self.memory.release()
        entry = (self.mapping, self.tensor)
        if keep:
            mapper.done(entry)
        else:
            mapper.forget(entry)


def _open_target(
    dst_path: str, nbytes: int, spare: str | None, mapper: _OneShotMappings | MappingCache
) -> _Target:
    """The dirty file a received file is written into, sized and mapped."""
    dirty = dirty_name(dst_path)
    dirty.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if spare is not None:
        os.replace(spare, dirty)
    fd = os.open(dirty, os.O_RDWR | os.O_CREAT | (0 if spare else os.O_TRUNC), 0o600)
    try:
        reserve(fd, nbytes)  # ENOSPC now, not as SIGBUS while receiving
    except OSError:
        os.close(fd)
        _unlink(dirty)
        raise
    os.close(fd)
    m_map, view = mapper.map(str(dirty), nbytes, writable=True)
    return _Target(m_map, view, dirty, memoryview(m_map) if m_map is not None else memoryview(b""))


def _commit(
    move: FileMove,
    target: _Target,
    checks: Sequence[ReceiveCheck],
    mapper: _OneShotMappings | MappingCache,
) -> None:
    """Finish the checks, then make the file durable and visible (fsync covers the mapped writes)."""
    dirty = target.dirty
    try:
        for check in checks:
            check.finish()
        target.close(mapper)
        fd = os.open(dirty, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(dirty, move.dst_path)
        fsync_dir(Path(move.dst_path).parent)
    except BaseException:
        _unlink(dirty)
        try:
            target.close(mapper, keep=False)
        except (BufferError, ValueError):  # pragma: no cover - a view still in use: left to the GC
            pass
        raise
