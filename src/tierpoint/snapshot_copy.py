"""The one snapshot-copy engine: a state's tensors into staging memory, for both tiers.

Call order: the local tier's :class:`~tierpoint.staging.Stager` and the persistent tier's
:mod:`tierpoint.dcp.snapshot` pin the staging buffer once (:mod:`tierpoint.pinning`), match each
tensor with its place in it, then call :func:`copy_tensors`; it returns once every byte is in place.

- CPU tensors whose bytes can be copied as they are (same dtype, contiguous, strided, no lazy
  conjugate or negation) are copied with ``memmove``, which releases the GIL: in 8 MiB chunks by a
  few threads (:data:`LANES`; one pool per process, made on first use) with no intra-op thread
  barriers, which cost a lot when training keeps the cores busy. With ``hash=True`` each tensor is
  copied and hashed (xxh3-64) 512 KiB at a time by one lane (the lanes share the tensors, largest
  first), each piece hashed right after it is copied, while it is still in the CPU cache (one
  memory pass, not two; xxhash releases the GIL).
- Any other CPU tensor goes through ``Tensor.copy_`` (hashed afterwards with ``hash=True``).
- CUDA tensors go through :func:`copy_from_devices`: one side stream per device (reused) that first
  waits for the training thread's stream (:func:`training_streams`, taken when the save was
  requested; the overlapped snapshot copies on another thread), so the copy sees every kernel
  queued before;
  ``non_blocking`` into pinned memory, issued in one call per device (:func:`issue_copies`),
  waited for before returning on an event that lets the thread sleep (not spin). Their
  checksums are left to the writer (nothing of a device copy is in the CPU cache to hash from):
  ``copy_tensors`` then returns ``None``.

Written by hand because no library copies into caller-owned (shared, pinned) memory with these
properties; ``torch`` provides the device copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import xxhash

from .fileformat import byte_view, checksum

logger = logging.getLogger("tierpoint")

_CHUNK = 8 << 20
"""Bytes one ``memmove`` of a lane copies."""
_HASH_PIECE = 512 << 10
"""Bytes copied then hashed at a time: small enough to be hashed from the CPU cache."""
LANES_ENV = "TIERPOINT_COPY_LANES"


def _lanes() -> int:
    """``TIERPOINT_COPY_LANES`` (a positive integer), or this rank's share of the node's CPUs (the
    CPUs this process may use over torchrun's ``LOCAL_WORLD_SIZE``), at most 8."""
    given = os.environ.get(LANES_ENV, "").strip()
    if not given:
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")
        share = _usable_cpus() // max(1, int(local) if local.isdigit() else 1)
        return max(1, min(8, share))
    if not given.isdigit() or int(given) < 1:
        raise ValueError(
            f"{LANES_ENV} must be a positive integer (threads a copy uses), not {given!r}"
        )
    return int(given)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, e.g. a container's share), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


LANES = _lanes()
"""Threads that copy (and hash) at once, in the training process and in its background worker
(which reads the environment when it starts: a queue made after setting it gives its worker that
many). The worker's lanes decide how soon a save is durable, hence how often one can be saved
without waiting: on an H100 host (16 CPUs) a 4.4 GB GPU state saved every 10 steps (0.42 s apart)
kept 0.92x of training's throughput with 8 lanes, 0.85x with 4, 0.71x with 2 while the worker
copied and hashed each save; once it only hashed (a RAM tier's snapshot lands in the part files)
0.92x, 0.95x and 0.93x."""
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


Streams = Mapping[torch.device, "torch.cuda.Stream"]
"""A stream per CUDA device (see :func:`training_streams`)."""


def training_streams(tensors: Sequence[torch.Tensor]) -> dict[torch.device, torch.cuda.Stream]:
    """The current stream of each CUDA device ``tensors`` are on, for the calling thread: taken on
    the training thread when a save is requested, so that a snapshot copied later, perhaps on
    another thread (whose current stream may differ), waits for the kernels queued there."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return {d: torch.cuda.current_stream(d) for d in devices}


def copy_tensors(
    sources: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    pinned: bool,
    hash: bool = False,
    after: Streams | None = None,
) -> list[str] | None:
    """Copy each source into its target (host memory; ``pinned``: page-locked). ``hash``: return
    the checksum of each staged tensor, in order, when every source is on the CPU (else None).
    ``after``: the streams device copies wait for (:func:`training_streams`; default: this
    thread's current streams)."""
    with torch.no_grad():
        if any(s.device.type == "cuda" for s in sources):
            copy_from_devices(sources, targets, pinned, after)
            return None
        if hash:
            return _copy_and_hash_all(sources, targets)
        chunks: list[tuple[int, int, int]] = []
        for src, dst in zip(sources, targets):
            if not _plain_bytes(src, dst):
                dst.copy_(src.detach())
                continue
            n = src.numel() * src.element_size()
            to, frm = dst.data_ptr(), src.data_ptr()
            chunks.extend((to + o, frm + o, min(_CHUNK, n - o)) for o in range(0, n, _CHUNK))
        if chunks:
            lanes = min(LANES, len(chunks))
            pool = _threads()
            for done in [pool.submit(_memmove_all, chunks[k::lanes]) for k in range(lanes)]:
                done.result()
    return None


def copy_from_devices(
    sources: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    pinned: bool,
    after: Streams | None = None,
) -> None:
    """Copy ``sources`` (some on CUDA devices) into host ``targets``; returns once every byte is in
    place. ``pinned``: the targets are page-locked, so the copies are queued ``non_blocking`` and
    waited for once. ``after``: see :func:`copy_tensors`. Other sources are copied on the way."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    with torch.no_grad():
        for src, dst in zip(sources, targets):
            if src.device.type == "cuda":
                by_device.setdefault(src.device, []).append((src, dst))
            else:
                dst.copy_(src.detach())
        copied, used = [], []
        try:
            for device, pairs in by_device.items():
                stream = _side_streams.get(device)
                if stream is None:
                    stream = _side_streams[device] = torch.cuda.Stream(device)
                waited = (after or {}).get(device)
                stream.wait_stream(
                    waited if waited is not None else torch.cuda.current_stream(device)
                )
                used.append(stream)
                with torch.cuda.stream(stream):
                    issue_copies([s for s, _ in pairs], [d for _, d in pairs], pinned)
                    done = torch.cuda.Event(blocking=True)
                    done.record(stream)
                copied.append(done)
        except BaseException:
            # Copies already queued still write into the targets: they end before the caller
            # may free those (a part file unmapped by the save's abort).
            for stream in used:
                with contextlib.suppress(Exception):
                    stream.synchronize()
            raise
        for done in copied:
            # Sleeps until the copies end: a stream's synchronize would spin a CPU core meanwhile
            # (CUDA's default with few contexts), one the training thread may need.
            done.synchronize()


_batched_copies = True  # False once torch refused a batched copy: one call per tensor from then on


def issue_copies(
    sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], non_blocking: bool
) -> None:
    """``targets[k].copy_(sources[k])`` for every k, queued in one call to torch per dtype
    (``_foreach_copy_``, which holds the GIL once, not once per tensor, and copies within a device
    in a few kernels when every tensor of the call has one dtype: a background snapshot of
    hundreds of tensors then barely competes with the training thread that launches kernels); one
    call per tensor where torch refuses the batch."""
    global _batched_copies
    if _batched_copies and len(sources) > 1:
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for src, dst in zip(sources, targets):
            group = by_dtype.setdefault(src.dtype, ([], []))
            group[0].append(src)
            group[1].append(dst)
        try:
            for srcs, dsts in by_dtype.values():
                torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
            return
        except (RuntimeError, TypeError, AttributeError) as e:  # redone one by one: idempotent
            _batched_copies = False
            logger.debug("batched copies refused (%s): one copy per tensor", e)
    for src, dst in zip(sources, targets):
        dst.copy_(src, non_blocking=non_blocking)


def plain_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its values as they are, back to back: a contiguous, strided
    CPU tensor without a lazy conjugate or negation."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def _plain_bytes(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``src`` can be copied into ``dst`` as raw bytes."""
    return src.dtype == dst.dtype and plain_bytes(src)


def _copy_and_hash_all(
    sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
) -> list[str]:
    """Copy and hash every tensor, the lanes sharing them (largest first); returns once every lane
    is done, also when one failed."""
    sizes = [s.numel() * s.element_size() for s in sources]
    if len(sources) < 2 or LANES == 1:
        return [_copy_and_hash(src, dst) for src, dst in zip(sources, targets)]
    pool = _threads()
    order = sorted(range(len(sources)), key=lambda i: -sizes[i])
    futures = {i: pool.submit(_copy_and_hash, sources[i], targets[i]) for i in order}
    wait(futures.values())
    return [futures[i].result() for i in range(len(sources))]


def _copy_and_hash(src: torch.Tensor, dst: torch.Tensor) -> str:
    """Copy one CPU tensor into its staging place and return the checksum of the staged bytes."""
    if not _plain_bytes(src, dst) or src.numel() == 0:
        dst.copy_(src.detach())
        return checksum(byte_view(dst))
    hasher = xxhash.xxh3_64()
    staged = byte_view(dst)
    nbytes, src_ptr, dst_ptr = len(staged), src.data_ptr(), dst.data_ptr()
    for offset in range(0, nbytes, _HASH_PIECE):
        n = min(_HASH_PIECE, nbytes - offset)
        ctypes.memmove(dst_ptr + offset, src_ptr + offset, n)
        hasher.update(staged[offset : offset + n])
    return hasher.hexdigest()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(LANES, thread_name_prefix="tierpoint-snapshot")
        return _pool


def _memmove_all(chunks: list[tuple[int, int, int]]) -> None:
    for to, frm, n in chunks:
        ctypes.memmove(to, frm, n)
