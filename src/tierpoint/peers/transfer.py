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
completes without deadlock; every wait is bounded by ``timeout`` (the messages and their tags:
:mod:`~tierpoint.peers.buckets`). Buckets go straight from a mapping of the source file into a
mapping of the destination's dirty file (:mod:`~tierpoint.peers.mapping_cache`): no intermediate
copies, no memory beyond the files themselves. The receiver checks each bucket as it lands
(:mod:`~tierpoint.peers.checks`: running digest, or the caller's :class:`ReceiveCheck`), so
verification overlaps the transfer instead of following it.

Invariants:
- A received file becomes visible only verified (:mod:`~tierpoint.peers.receiving`): written as
  ``<dst>.dirty``, checked against the sender's digest and/or the caller's check, fsynced, renamed
  to ``dst``, directory fsynced.
- Any failure (peer gone, timeout, mismatch, full disk) removes the dirty file and raises a
  :class:`CheckpointingError` naming the file and the peer; it never leaves a partial file visible.
  It fails that move only: the other moves are still posted and waited for, so a peer gone does
  not leave the healthy ones waiting for their files until the timeout.
- Tags never repeat within a process and group, so a receive left over from a timed-out call can
  never match a later call's data; its destination mapping is kept alive (never unmapped) for the
  same reason. Calls on different groups may run at the same time on different threads.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointingError
from ..files import unlink_quietly as _unlink
from .buckets import DEFAULT_BUCKET_BYTES, Tags, next_call
from .buckets import post as _post
from .buckets import wait as _wait
from .checks import DigestCheck, ReceiveCheck, Rejected
from .checks import digest as _digest
from .mapping_cache import MappingCache, OneShotMappings
from .moves import FileMove, MoveStats
from .receiving import Target, commit, open_target

logger = logging.getLogger("tierpoint")


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
    tags = Tags(next_call(group), len(moves))
    rank = dist.get_rank()
    start = time.monotonic()
    deadline = start + timeout
    mine = [(i, m) for i, m in enumerate(moves) if rank in (m.src, m.dst)]
    if not mine:
        return MoveStats(0, 0, 0.0)
    for _, m in mine:
        if m.src == m.dst:
            raise CheckpointingError(f"move of {m.src_path} has the same source and destination")
    mapper = mappings if mappings is not None else OneShotMappings()
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
    targets: dict[int, Target] = {}
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
                target = targets[i] = open_target(m.dst_path, nbytes, spare, mapper, m.mode)
                view = target.tensor
                checks[i] = []
                if digest:
                    digest_check = DigestCheck(m, target.memory)
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
                    checks[i] = [Rejected(e)]
                    break
        wait(works)
        for i, m in mine:
            if i in targets and i not in failed:
                try:
                    commit(m, targets.pop(i), checks.get(i, ()), mapper)
                except (OSError, CheckpointingError) as e:
                    if not any(isinstance(c, Rejected) for c in checks.get(i, ())):
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


__all__ = ["move_files"]
