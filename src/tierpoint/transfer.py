"""Moving whole files between ranks over torch.distributed: bucketed, verified, committed atomically.

Used by peer replication (a part file goes to the members of its clique), by recovery (a lost part
comes back from a holder) and by the retrieval of node-local DCP objects.

Call order: every rank of the group calls :func:`move_files` with the same list of
:class:`FileMove` (computed alike everywhere, or planned on one rank and broadcast). A rank sends the
files it is the source of and receives the ones it is the destination of; the others return at once.

Protocol: for move ``i`` the source first sends a small header (size, and an xxh3-64 digest of the
bytes when ``digest=True``), then the bytes in buckets of at most ``bucket_bytes``. Every send and
receive is posted non-blocking before anything is waited for, so any pattern (pairs swapping files,
rings, one source serving many) completes without deadlock; every wait is bounded by ``timeout``.
Buckets go straight from a mapping of the source file into a mapping of the destination's dirty
file: no intermediate copies, no memory beyond the files themselves.

Invariants:
- A received file becomes visible only verified: written as ``<dst>.dirty``, checked against the
  sender's digest and/or the ``verify(path)`` callback, fsynced, renamed to ``dst``, directory fsynced.
- Any failure (peer gone, timeout, mismatch, full disk) removes the dirty file and raises a
  :class:`CheckpointingError` naming the file and the peer; it never leaves a partial file visible.
- Tags never repeat within a process (a per-process sequence that all ranks advance alike, one step
  per call), so a receive left over from a timed-out call can never match a later call's data; its
  destination mapping is kept alive (never unmapped) for the same reason.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from .errors import CheckpointingError, CoordinationTimeoutError, CorruptCheckpointError
from .fileformat import dirty_name, fsync_dir

logger = logging.getLogger("tierpoint")

DEFAULT_BUCKET_BYTES = 64 << 20
_HEADER_WORDS = 2  # size, digest
_TAGS_PER_CALL = 1 << 20
_calls = itertools.count()
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


class _Tags:
    """Message tags of one call: below 2**31, disjoint from the previous 2047 calls' tags."""

    def __init__(self, call: int, moves: int) -> None:
        self.base = (call % 2048) * _TAGS_PER_CALL
        self.moves = moves
        self.per_move = (_TAGS_PER_CALL - moves) // max(moves, 1)

    def header(self, move: int) -> int:
        return self.base + move

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


def _wait(works: list[tuple[Any, str]], deadline: float) -> None:
    for work, what in works:
        left = max(0.001, deadline - time.monotonic())
        try:
            ok = work.wait(timeout=timedelta(seconds=left))
        except (RuntimeError, dist.DistError) as e:
            text = str(e).strip().splitlines()[0][:300] if str(e).strip() else "no detail"
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise CoordinationTimeoutError(f"{what}: timed out ({text})") from e
            raise CheckpointingError(f"{what}: failed, the peer is probably gone ({text})") from e
        if ok is False:
            raise CoordinationTimeoutError(f"{what}: timed out")


def move_files(
    moves: Sequence[FileMove],
    group: Any = None,
    *,
    timeout: float = 300.0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    digest: bool = True,
    verify: Callable[[str, FileMove], Any] | None = None,
    unavailable: str | None = None,
    reuse: Callable[[FileMove], str | None] | None = None,
) -> MoveStats:
    """Carry out ``moves`` (identical list on every rank of ``group``); see the module docstring.

    Args:
        group: a gloo process group spanning the ranks named in ``moves`` (default: the default group).
        timeout: seconds the whole call may take on this rank.
        bucket_bytes: largest single message.
        digest: the source hashes each file and the destination checks the hash.
        verify: ``verify(dirty_path, move)`` for each received file before it is committed; raise
            to reject it (e.g. check a part file with :func:`tierpoint.fileformat.verify`).
        unavailable: this rank cannot send its files (the reason): its destinations are told at once
            instead of waiting for the timeout, and this rank raises with that reason.
        reuse: for a file this rank receives, an existing file whose pages may be rewritten instead
            of filling a new one (renamed to the dirty name first; faster on tmpfs), or ``None``.

    Every rank completes the transfers that can complete, then raises the first failure it saw (a
    source that could not send fails its destinations without a timeout).
    """
    if bucket_bytes < 1:
        raise CheckpointingError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    tags = _Tags(next(_calls), len(moves))
    rank = dist.get_rank()
    start = time.monotonic()
    deadline = start + timeout
    mine = [(i, m) for i, m in enumerate(moves) if rank in (m.src, m.dst)]
    if not mine:
        return MoveStats(0, 0, 0.0)
    for _, m in mine:
        if m.src == m.dst:
            raise CheckpointingError(f"move of {m.src_path} has the same source and destination")
    failures: list[BaseException] = []
    if unavailable is not None:
        failures.append(CheckpointingError(unavailable))

    # Phase 1: sizes (-1: the source cannot send) and digests.
    sources: dict[int, tuple[mmap.mmap | None, torch.Tensor]] = {}
    headers: dict[int, torch.Tensor] = {}
    works: list[tuple[Any, str]] = []
    for i, m in mine:
        header = torch.full((_HEADER_WORDS,), -1, dtype=torch.int64)
        if m.src == rank:
            if unavailable is None:
                try:
                    nbytes = os.path.getsize(m.src_path)
                    sources[i] = _map(m.src_path, nbytes, writable=False)
                    header[0] = nbytes
                    header[1] = _digest(memoryview(sources[i][0])) if digest and nbytes else 0
                except OSError as e:
                    failures.append(CheckpointingError(f"cannot send {m.src_path}: {e}"))
            work = dist.isend(header, m.dst, group=group, tag=tags.header(i))
            works.append((work, f"sending {m.src_path} to rank {m.dst}"))
        else:
            work = dist.irecv(header, m.src, group=group, tag=tags.header(i))
            works.append((work, f"receiving {m.dst_path} from rank {m.src}"))
        headers[i] = header
    try:
        _wait(works, deadline)
    except BaseException:
        _abandoned.extend(sources.values())
        raise

    # Phase 2: the bytes of every move whose source could send.
    targets: dict[int, tuple[mmap.mmap | None, torch.Tensor, Path]] = {}
    works = []
    sent = received = 0
    try:
        for i, m in mine:
            nbytes = int(headers[i][0])
            if nbytes < 0:
                if m.dst == rank:
                    failures.append(
                        CheckpointingError(
                            f"rank {m.src} could not send {m.src_path} (wanted for {m.dst_path})"
                        )
                    )
                continue
            if m.src == rank:
                data = sources[i][1]
                for b, begin in enumerate(range(0, nbytes, bucket_bytes)):
                    chunk = data[begin : begin + bucket_bytes]
                    work = dist.isend(chunk, m.dst, group=group, tag=tags.bucket(i, b))
                    works.append((work, f"sending {m.src_path} to rank {m.dst}"))
                sent += nbytes
                continue
            try:
                targets[i] = _open_target(m.dst_path, nbytes, reuse(m) if reuse else None)
                view = targets[i][1]
            except OSError as e:  # e.g. a full disk: drain the bytes so the source is not stuck
                failures.append(CheckpointingError(f"cannot write {m.dst_path}: {e}"))
                view = None
                scratch = torch.empty(min(nbytes, bucket_bytes), dtype=torch.uint8)
            for b, begin in enumerate(range(0, nbytes, bucket_bytes)):
                end = min(nbytes, begin + bucket_bytes)
                chunk = view[begin:end] if view is not None else scratch[: end - begin]
                work = dist.irecv(chunk, m.src, group=group, tag=tags.bucket(i, b))
                works.append((work, f"receiving {m.dst_path} from rank {m.src}"))
            received += nbytes
        _wait(works, deadline)
        for i, m in mine:
            if i in targets:
                try:
                    _commit(m, targets.pop(i), int(headers[i][1]) if digest else None, verify)
                except (OSError, CheckpointingError) as e:
                    failures.append(e)
    except BaseException as e:
        _abandoned.extend(sources.values())
        for _, _, dirty in targets.values():
            _unlink(dirty)
        _abandoned.extend(targets.values())
        if isinstance(e, OSError):
            raise CheckpointingError(f"file transfer failed: {e}") from e
        raise
    for m_map, _ in sources.values():
        if m_map is not None:
            m_map.close()
    if failures:
        first = failures[0]
        if isinstance(first, OSError):
            raise CheckpointingError(f"file transfer failed: {first}") from first
        raise first
    seconds = time.monotonic() - start
    logger.debug("move_files: sent %d and received %d bytes in %.3f s", sent, received, seconds)
    return MoveStats(sent, received, seconds)


def _open_target(
    dst_path: str, nbytes: int, spare: str | None
) -> tuple[mmap.mmap | None, torch.Tensor, Path]:
    """The dirty file a received file is written into, sized and mapped."""
    dirty = dirty_name(dst_path)
    dirty.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if spare is not None:
        os.replace(spare, dirty)
    fd = os.open(dirty, os.O_RDWR | os.O_CREAT | (0 if spare else os.O_TRUNC), 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not as SIGBUS while receiving
    except OSError:
        os.close(fd)
        _unlink(dirty)
        raise
    os.close(fd)
    m_map, view = _map(str(dirty), nbytes, writable=True)
    return m_map, view, dirty


def _commit(
    move: FileMove,
    target: tuple[mmap.mmap | None, torch.Tensor, Path],
    expected: int | None,
    verify: Callable[[str, FileMove], Any] | None,
) -> None:
    m_map, _, dirty = target
    try:
        if m_map is not None:
            if expected is not None and _digest(memoryview(m_map)) != expected:
                raise CorruptCheckpointError(
                    move.dst_path, f"bytes received from rank {move.src} do not match its checksum"
                )
            m_map.flush()
            m_map.close()
        if verify is not None:
            verify(str(dirty), move)
        fd = os.open(dirty, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(dirty, move.dst_path)
        fsync_dir(Path(move.dst_path).parent)
    except BaseException:
        _unlink(dirty)
        raise


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
