"""Peer replication and recovery on 4 ranks: tierpoint against raw gloo and against a disk read.

Four real gloo ranks on loopback play two nodes (``TIERPOINT_NODE_ID`` = ``node{rank // 2}``), so the
default clique replication (jump 2, factor 2) pairs ranks across nodes: cliques {0, 2} and {1, 3}.
Every rank holds ~``--mib`` MiB of state (~66 tensors of mixed sizes: fp32 weights and Adam moments,
a bf16 embedding and bf16 norms, an int64 step). Everything local lives under one fresh /dev/shm
directory; the "persistent tier" files live under one fresh directory on the real disk
(``--disk-dir``, default /var/tmp; its file system is printed). Both are removed at the end, also on
failure, Ctrl-C or SIGTERM.

Part 1, replication (after two untimed warm-up saves of each manager, so that expired files are
recycled as in steady state), interleaved per repetition in this order:

- tierpoint: a sync ``manager.save`` with ``CliqueReplicationStrategy`` (factor 2): the rank writes
  its part file, then swaps parts with its clique peer over gloo (``transfer.move_files``: the bytes go
  from a mapping of the sender's file into a mapping of the receiver's dirty file, each bucket checked
  against the part's checksums as it lands, fsynced, renamed). The replication figure is ``manager.last_replication``
  (that step alone); the whole save is timed too;
- raw gloo: each rank ``isend``s the same number of bytes (its part file's size) to its clique peer
  and ``irecv``s as many from it at the same time, preallocated tensors, on a gloo group of its own,
  in ``transfer.DEFAULT_BUCKET_BYTES`` messages (what tierpoint sends) and as one message;
- diagnostics: the bucketed raw exchange with both ends mapped as tierpoint maps them (sending from
  a private mapping of the rank's part file, receiving into a fresh shared mapping of a tmpfs file
  whose pages exist, as a recycled spare's do), and the same with both mappings made with
  ``MAP_POPULATE`` (page tables filled up front instead of one fault per page; the source then
  mapped shared and read-only, since populating a private writable mapping copies every page);
  and the cost of checking a received part: ``fileformat.verify`` (what the receiver runs:
  ``readinto`` + hash) against hashing a mapping of the file (``read_flat(mmap=True,
  verify=True)``, 2 threads);
- a sync save without replication (``repl_strategy=None``), for context.

Part 2, recovery, interleaved per repetition:

- tierpoint: node 1 (ranks 2 and 3) loses its directories (``shutil.rmtree``); a fresh strategy and
  manager on every rank (untimed), then ``find_latest()`` + ``load()`` timed on all four ranks: ranks
  2 and 3 fetch their own parts from ranks 0 and 1 before ``load()`` returns; ranks 0 and 1 load and
  verify their local parts; the replicas of ranks 0 and 1 that node 1 should hold come back in the
  background after ``load()`` returns (``wait_for_restore()``; timed as "until replicas restored");
- persistent tier on disk: ranks 2 and 3 read the same part bytes (a copy of their part file on the
  disk) with ``readinto`` into preallocated memory, and ``torch.load(weights_only=True)`` their state
  saved there by ``torch.save``; for context, all four ranks read their part files at once.
  Before every read the page cache of these files is dropped with ``posix_fadvise(DONTNEED)`` (no root
  needed for clean pages); ``mincore`` checks that it worked and the output says so.

A figure is the slowest rank's seconds in a repetition (what the job waits for); tables give medians
over ``--reps`` repetitions, ratios the median of per-repetition ratios (neighbours in time, so the
machine's drift cancels). GB/s: bytes of one rank's part per second (during replication every rank
sends that much and receives as much at the same time). Phase tables split the slowest rank's
replication step, and the slower wiped rank's recovery, into exclusive seconds: mapping and opening
files, waiting for bytes on the wire, checksum verification, fsync, renames, and for recovery also
the read of the own part and the collectives (which include waiting for slower ranks). They come
from wrapping tierpoint.peers.transfer's steps inside the rank processes (the benchmark's own
monkey-patching; nothing in the library changes; a hook that no longer exists is reported, not
fatal). The last line tells how much CPU other processes took meanwhile, the usual cause of noise.

Run: ``./run bench replication`` or ``.venv/bin/python benchmarks/replication_bench.py [--mib 256
--reps 5]`` (about 1.5 to 2.5 minutes on 2 busy cores); ``--mib 32 --reps 2`` is a quick check.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import logging
import math
import mmap
import multiprocessing
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from floor import tensors_of
from machine import cpu_sample, machine_line, require_memory

from tierpoint import dist as tpdist
from tierpoint import fileformat
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from tierpoint.local.naming import part_name
from tierpoint.local.recovery import PartRecovery
from tierpoint.peers import buckets, receiving, transfer
from tierpoint.peers.mapping_cache import MappingCache, OneShotMappings
from tierpoint.testing import run_ranks

WORLD = 4
RANKS_PER_NODE = 2
WIPED_NODE = 1
WIPED = [r for r in range(WORLD) if r // RANKS_PER_NODE == WIPED_NODE]
WARMUP_SAVES = 2
SESSION = "bench"
BUCKET = transfer.DEFAULT_BUCKET_BYTES
CHUNK = 64 << 20
TARGET = 0.8
POPULATE = hasattr(mmap, "MAP_POPULATE")
EXPECTED_WARNINGS = ("was replaced by the copy held by",)  # recovery of the wiped node says so

Series = dict[str, list[float]]

# ------------------------------------------------------------------------------------ the state


def make_state(mib: float, seed: int) -> dict[str, Any]:
    """~``mib`` MiB in 66 tensors: a bf16 embedding (1/8 of the bytes), 16 blocks of fp32 weight,
    exp_avg, exp_avg_sq (mixed widths) and a bf16 norm, an int64 step."""
    g = torch.Generator().manual_seed(seed)
    total = mib * 2**20
    scales = (0.75, 1.0, 1.25, 1.0) * 4
    base = math.sqrt(total * 7 / 8 / (12 * sum(s * s for s in scales)))
    widths = [max(16, round(base * s / 16) * 16) for s in scales]
    rows = max(1, round(total / 8 / (2 * widths[1])))
    model: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(rows, widths[1], generator=g).to(torch.bfloat16)
    }
    optim: dict[str, Any] = {"step": torch.tensor(7, dtype=torch.int64)}
    for i, h in enumerate(widths):
        model[f"layers.{i}.weight"] = torch.randn(h, h, generator=g)
        model[f"layers.{i}.norm"] = torch.randn(h, generator=g).to(torch.bfloat16)
        optim[f"layers.{i}"] = {
            "exp_avg": torch.randn(h, h, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(h, h, generator=g) * 1e-6,
        }
    return {"model": model, "optimizer": optim, "iteration": 0}


# ------------------------------------------------------------------------------------ phase clock


SENDER_MAP = "sender: map own part file"
OPEN_TARGET = "receiver: open dirty file (spare rename, fallocate, map)"
WAIT_HEADERS = "wait: headers (includes waiting for the peer)"
WAIT_DATA = "wait: bytes on the wire (gloo isend/irecv)"
COMMIT = "commit: unmap (rest of commit)"
VERIFY = "verify checksums as buckets land (PartVerifier)"
FSYNC = "commit: fsync file"
RENAME = "commit: rename"
FSYNC_DIR = "commit: fsync dir"
POSTING = "posting isend/irecv (waits while gloo moves data)"
REST = "rest of move_files (sender unmap, python)"
READ_OWN = "load: read + verify own part (read_flat, mmap)"
COLLECTIVES = "collectives (incl. waiting for slower ranks)"
MOVE_PHASES = [SENDER_MAP, OPEN_TARGET, WAIT_HEADERS, WAIT_DATA, VERIFY, FSYNC, RENAME, FSYNC_DIR]
MOVE_PHASES += [COMMIT, POSTING, REST]
LOAD_PHASES = [*MOVE_PHASES, READ_OWN, COLLECTIVES]


class PhaseClock:
    """Exclusive seconds per phase: a nested phase's time is taken out of its parent's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.received = 0
        self.waits = 0
        self._stack: list[list[Any]] = []  # [label, seconds spent in children]

    def reset(self) -> None:
        self.seconds = defaultdict(float)
        self.received = 0

    def inside(self, label: str) -> bool:
        return bool(self._stack) and self._stack[-1][0] == label

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # the background restore after a load: timed as a whole, not per phase
            return
        frame: list[Any] = [label, 0.0]
        self._stack.append(frame)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self._stack.pop()
            self.seconds[label] += elapsed - frame[1]
            if self._stack:
                self._stack[-1][1] += elapsed


class _TimedOs:
    """Stands in for ``os`` inside tierpoint.peers: times fsync and rename within a commit."""

    def __init__(self, real: Any, clock: PhaseClock) -> None:
        self._real, self._clock = real, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def fsync(self, fd: int) -> None:
        if not self._clock.inside(COMMIT):
            return self._real.fsync(fd)
        with self._clock.phase(FSYNC):
            return self._real.fsync(fd)

    def replace(self, src: Any, dst: Any) -> None:
        if not self._clock.inside(COMMIT):
            return self._real.replace(src, dst)
        with self._clock.phase(RENAME):
            return self._real.replace(src, dst)


class _TimedDist:
    """Stands in for ``torch.distributed`` inside tierpoint.peers: times posting isend/irecv."""

    def __init__(self, real: Any, clock: PhaseClock) -> None:
        self._real, self._clock = real, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def isend(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.phase(POSTING):
            return self._real.isend(*args, **kwargs)

    def irecv(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.phase(POSTING):
            return self._real.irecv(*args, **kwargs)


def instrument(clock: PhaseClock) -> list[str]:
    """Wrap tierpoint.peers.transfer's steps (in this process only); return the hooks that do not exist."""
    missing: list[str] = []

    def wrap(owner: Any, name: str, label: Callable[[tuple, dict], str | None]) -> None:
        original = getattr(owner, name, None)
        if not callable(original):
            missing.append(f"{owner.__name__}.{name}")
            return

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            which = label(args, kwargs)
            if which is None:
                return original(*args, **kwargs)
            with clock.phase(which):
                return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    def on_move(args: tuple, kwargs: dict) -> str:
        clock.waits = 0
        return REST

    def on_wait(args: tuple, kwargs: dict) -> str:
        clock.waits += 1
        return WAIT_HEADERS if clock.waits == 1 else WAIT_DATA

    def on_map(args: tuple, kwargs: dict) -> str | None:
        writable = kwargs.get("writable", args[2] if len(args) > 2 else False)
        return None if writable else SENDER_MAP  # the receiver's map counts in OPEN_TARGET

    def on_open(args: tuple, kwargs: dict) -> str:
        if threading.current_thread() is threading.main_thread():
            clock.received += int(args[1]) if len(args) > 1 else int(kwargs.get("nbytes", 0))
        return OPEN_TARGET

    wrap(transfer, "move_files", on_move)
    wrap(transfer, "_wait", on_wait)
    wrap(MappingCache, "map", on_map)
    wrap(OneShotMappings, "map", on_map)
    wrap(transfer, "open_target", on_open)
    wrap(transfer, "commit", lambda a, k: COMMIT)
    wrap(receiving, "fsync_dir", lambda a, k: FSYNC_DIR if clock.inside(COMMIT) else None)
    wrap(fileformat.PartVerifier, "advance", lambda a, k: VERIFY)
    wrap(PartRecovery, "read_own", lambda a, k: READ_OWN)
    wrap(tpdist, "all_gather_json", lambda a, k: COLLECTIVES)
    wrap(tpdist, "broadcast_json", lambda a, k: COLLECTIVES)
    for module, name, proxy in ((receiving, "os", _TimedOs), (buckets, "dist", _TimedDist)):
        if hasattr(module, name):
            setattr(module, name, proxy(getattr(module, name), clock))
        else:
            missing.append(f"{module.__name__}.{name}")
    return missing


# ------------------------------------------------------------------------------------ helpers


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Barrier (default group), then ``fn()`` timed on this rank."""
    dist.barrier()
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def make_strategy() -> CliqueReplicationStrategy:
    return CliqueReplicationStrategy.from_replication_params(
        replication_jump=None, replication_factor=2
    )


def clique_peer(strategy: Any, rank: int) -> int:
    clique = strategy.clique(rank) if hasattr(strategy, "clique") else None
    others = [r for r in (clique or []) if r != rank]
    return others[0] if others else (rank + WORLD // 2) % WORLD


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any, bucket: int) -> None:
    """Send ``send`` to ``peer`` while receiving ``recv`` from it, in messages of ``bucket`` bytes."""
    works = []
    n = send.numel()
    for b, begin in enumerate(range(0, n, bucket)):
        works.append(dist.irecv(recv[begin : begin + bucket], peer, group=group, tag=b))
        works.append(dist.isend(send[begin : begin + bucket], peer, group=group, tag=b))
    for work in works:
        work.wait()


def exchange_hashed(
    send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any, bucket: int
) -> None:
    """:func:`exchange`, hashing (xxh3-64) each received message as it completes: the least that
    verifying data on receipt can cost, with no files involved."""
    sends, recvs = [], []
    n = send.numel()
    for b, begin in enumerate(range(0, n, bucket)):
        recvs.append((dist.irecv(recv[begin : begin + bucket], peer, group=group, tag=b), begin))
        sends.append(dist.isend(send[begin : begin + bucket], peer, group=group, tag=b))
    data = memoryview(recv.numpy())
    for work, begin in recvs:
        work.wait()
        xxhash.xxh3_64_intdigest(data[begin : begin + bucket])
    for work in sends:
        work.wait()


def exchange_mapped(src: Path, dst: Path, peer: int, group: Any, populate: bool) -> None:
    """The bucketed exchange between mapped files: sending from a mapping of the own part file,
    receiving into a fresh shared mapping of an existing tmpfs file whose pages exist (a recycled
    spare), mapping and unmapping included.

    ``populate`` False maps as tierpoint.peers does (the source private and writable, as
    ``ACCESS_COPY``); True maps both with ``MAP_POPULATE``, the source shared and read-only (a
    private writable mapping would be populated by copying every page)."""
    extra = getattr(mmap, "MAP_POPULATE", 0) if populate else 0
    size = os.path.getsize(src)
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    source = (
        (mmap.MAP_SHARED, mmap.PROT_READ, os.O_RDONLY)
        if populate
        else (mmap.MAP_PRIVATE, rw, os.O_RDONLY)
    )
    maps = []
    for path, (flags, prot, mode) in ((src, source), (dst, (mmap.MAP_SHARED, rw, os.O_RDWR))):
        fd = os.open(path, mode)
        try:
            maps.append(mmap.mmap(fd, size, flags=flags | extra, prot=prot))
        finally:
            os.close(fd)
    with warnings.catch_warnings():  # torch warns that a read-only buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        send, recv = (torch.frombuffer(m, dtype=torch.uint8) for m in maps)
    exchange(send, recv, peer, group, BUCKET)
    del send, recv
    for m in maps:
        m.close()


def verify_mapped(path: Path) -> None:
    """Check every checksum by hashing a mapping of the file (no copy, 2 threads), then let it go."""
    _, tensors = fileformat.read_flat(path, verify=True, mmap=True)
    del tensors  # unmapped now, so the next save may recycle the file


def fill_file(path: Path, nbytes: int) -> None:
    """A file of ``nbytes`` whose pages exist (as a recycled spare's do)."""
    with open(path, "wb", buffering=0) as f:
        block = b"\xa5" * min(nbytes, CHUNK)
        left = nbytes
        while left:
            left -= f.write(block[: min(left, len(block))])


def read_whole(path: Path, target: torch.Tensor) -> None:
    """``readinto`` the whole file into the front of a preallocated uint8 tensor."""
    size = os.path.getsize(path)
    view = memoryview(target[:size].numpy())
    with open(path, "rb", buffering=0) as f:
        while len(view):
            n = f.readinto(view[:CHUNK])
            if not n:
                raise EOFError(f"{path} is shorter than expected")
            view = view[n:]


def copy_to_disk(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> float | None:
    """Ask the kernel to drop ``path``'s clean cached pages; return the fraction still resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_fraction(path)


def resident_fraction(path: Path) -> float | None:
    """Fraction of the file's pages in the page cache (``mincore``), or None where it cannot tell."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: no writes reach it
        try:
            buf = (ctypes.c_char * size).from_buffer(m)
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
            resident = sum(v & 1 for v in vec) / pages if rc == 0 else None
            del buf
        finally:
            m.close()
        return resident
    except (OSError, AttributeError, ValueError):
        return None


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(-1), y.view(-1))
        for x, y in zip(a, b)
    )


# ------------------------------------------------------------------------------------ one rank


def bench_rank(
    rank: int, world: int, root: str, disk: str, mib: float, reps: int
) -> dict[str, Any]:
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank // RANKS_PER_NODE}"
    torch.set_num_threads(1)
    logging.getLogger("tierpoint").addFilter(
        lambda record: not any(w in record.getMessage() for w in EXPECTED_WARNINGS)
    )
    clock = PhaseClock()
    missing = instrument(clock)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if rank == 0 else (lambda _: None)
    tier, diskdir = Path(root), Path(disk)
    state = make_state(mib, seed=rank)
    tensors = tensors_of(state)
    out: dict[str, Any] = {"missing_hooks": missing}

    strategy = make_strategy()
    peer = clique_peer(strategy, rank)
    repl = LocalCheckpointManager(
        tier / "repl", session_id=SESSION, repl_strategy=strategy, keep_last=1, recycle=True
    )
    plain = LocalCheckpointManager(tier / "plain", session_id=SESSION, keep_last=1, recycle=True)
    iteration = 0

    def save(manager: LocalCheckpointManager) -> float:
        state["iteration"] = iteration
        seconds, _ = timed(lambda: manager.save(BasicTensorAwareStateDict(state), iteration))
        return seconds

    say(f"warm-up: {WARMUP_SAVES} saves with and without replication")
    for _ in range(WARMUP_SAVES):
        iteration += 1
        save(repl)
        save(plain)
    size = os.path.getsize(tier / "repl" / SESSION / str(rank) / part_name(iteration, rank))

    # ---------------------------------------------------------------- part 1: replication
    group = dist.new_group(backend="gloo")
    send = torch.randint(0, 256, (size,), dtype=torch.uint8)
    recv = torch.zeros(size, dtype=torch.uint8)  # pages touched: preallocated
    spare = tier / "raw" / f"recv{rank}.bin"
    spare.parent.mkdir(exist_ok=True)
    fill_file(spare, size)
    series: Series = defaultdict(list)
    for rep in range(reps):
        say(f"replication repetition {rep + 1}/{reps}")
        iteration += 1
        before = repl.last_replication  # a read-only property: this save's stats replace it
        clock.reset()
        series["save_repl"].append(save(repl))
        stats = repl.last_replication
        stats = None if stats is before else stats
        moved = clock.seconds.copy()
        series["repl"].append(stats.seconds if stats is not None else sum(moved.values()))
        series["repl_bytes"].append(float(stats.received_bytes if stats else clock.received))
        out.setdefault("repl_phases", []).append(dict(moved))
        series["raw_bucketed"].append(timed(lambda: exchange(send, recv, peer, group, BUCKET))[0])
        series["raw_hashed"].append(
            timed(lambda: exchange_hashed(send, recv, peer, group, BUCKET))[0]
        )
        series["raw_single"].append(timed(lambda: exchange(send, recv, peer, group, size))[0])
        own = tier / "repl" / SESSION / str(rank) / part_name(iteration, rank)
        series["raw_mapped"].append(
            timed(functools.partial(exchange_mapped, own, spare, peer, group, False))[0]
        )
        if POPULATE:
            series["raw_populated"].append(
                timed(functools.partial(exchange_mapped, own, spare, peer, group, True))[0]
            )
        series["save_plain"].append(save(plain))
        series["verify_file"].append(timed(functools.partial(fileformat.verify, own))[0])
        series["verify_mapped"].append(timed(functools.partial(verify_mapped, own))[0])
    out["stats_source"] = "manager.last_replication" if stats is not None else "phase clock"
    send = None  # its memory goes back before part 2
    dist.barrier()
    spare.unlink(missing_ok=True)
    shutil.rmtree(tier / "plain" / SESSION / str(rank), ignore_errors=True)

    # ---------------------------------------------------------------- part 2: recovery
    say("recovery: copying the part files and torch.save files to the disk")
    own_disk = diskdir / f"part{rank}.bin"
    torch_disk = diskdir / f"state{rank}.pt"
    copy_to_disk(tier / "repl" / SESSION / str(rank) / part_name(iteration, rank), own_disk)
    if rank in WIPED:
        torch.save(state, torch_disk)
    read_target = recv  # preallocated, as large as the part
    resident: list[float] = []
    cache_unknown = False

    def disk_read(readers: Sequence[int], fn: Callable[[], Any], *paths: Path) -> float:
        nonlocal cache_unknown
        if rank in readers:
            for path in paths:
                left = drop_cache(path)
                if left is None:
                    cache_unknown = True
                else:
                    resident.append(left)
        seconds, _ = timed(lambda: fn() if rank in readers else None)
        return seconds if rank in readers else 0.0

    del repl, plain, strategy
    gc.collect()
    expected = iteration
    for rep in range(reps):
        say(f"recovery repetition {rep + 1}/{reps}")
        dist.barrier()
        if rank in WIPED:
            shutil.rmtree(tier / "repl" / SESSION / str(rank))
        dist.barrier()
        manager = LocalCheckpointManager(
            tier / "repl", session_id=SESSION, repl_strategy=make_strategy()
        )
        clock.reset()

        def recover(m: LocalCheckpointManager = manager) -> tuple[int, Any]:
            latest = m.find_latest()
            loaded, _ = m.load()
            return latest, loaded

        seconds, (latest, loaded) = timed(recover)
        received, phases = clock.received, dict(clock.seconds)
        start = time.perf_counter()
        manager.wait_for_restore()  # replicas come back in the background after load returns
        series["recovery"].append(seconds)
        series["recovery_restored"].append(seconds + time.perf_counter() - start)
        series["recovery_bytes"].append(float(received))
        out.setdefault("recovery_phases", []).append(phases)
        if latest != expected or not same_bytes(tensors_of(loaded.state_dict), tensors):
            raise AssertionError(
                f"rank {rank}: recovery gave iteration {latest} (expected {expected}) "
                "or tensors that differ from the saved state"
            )
        del loaded, manager
        gc.collect()
        series["disk_raw"].append(
            disk_read(WIPED, lambda: read_whole(own_disk, read_target), own_disk)
        )
        series["disk_torch"].append(
            disk_read(WIPED, lambda: torch.load(torch_disk, weights_only=True), torch_disk)
        )
        series["disk_raw_all"].append(
            disk_read(range(WORLD), lambda: read_whole(own_disk, read_target), own_disk)
        )
    out["resident_max"] = max(resident) if resident else None
    out["cache_unknown"] = cache_unknown
    out["part_bytes"] = size
    out["series"] = dict(series)
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------ reporting


def slowest(per_rank: list[dict[str, Any]], key: str) -> list[float]:
    reps = len(per_rank[0]["series"][key])
    return [max(r["series"][key][i] for r in per_rank) for i in range(reps)]


def paired(a: list[float], b: list[float]) -> float:
    """Median over repetitions of ``a / b``."""
    return statistics.median(x / y for x, y in zip(a, b))


def phase_table(
    per_rank: list[dict[str, Any]],
    total_key: str,
    phases_key: str,
    labels: Sequence[str],
    ranks: Sequence[int] = range(WORLD),
) -> list[str]:
    """Median per phase of the slowest of ``ranks`` in each repetition, and what no phase covers."""
    reps = len(per_rank[0]["series"][total_key])
    picked = []
    for i in range(reps):
        r = max(ranks, key=lambda k: per_rank[k]["series"][total_key][i])
        phases = {k: v for k, v in per_rank[r][phases_key][i].items() if k in labels}
        picked.append({**phases, "": per_rank[r]["series"][total_key][i] - sum(phases.values())})
    lines = []
    for label in labels:
        values = [p.get(label, 0.0) for p in picked]
        if any(values):
            lines.append(f"  {label:58s} {statistics.median(values):8.3f}")
    other = statistics.median(p[""] for p in picked)
    label = "outside these steps (python, scans, plan)"
    lines.append(f"  {label:58s} {max(0.0, other):8.3f}")
    total = statistics.median(sum(p.values()) for p in picked)
    lines.append(f"  {'total':58s} {total:8.3f}")
    return lines


def report(per_rank: list[dict[str, Any]], mib: float, disk: str, reps: int) -> None:
    size = per_rank[0]["part_bytes"]
    s = {k: slowest(per_rank, k) for k in per_rank[0]["series"] if not k.endswith("_bytes")}
    med = {k: statistics.median(v) for k, v in s.items()}
    gbs = {k: size / v / 1e9 if v else float("nan") for k, v in med.items()}
    count = len(tensors_of(make_state(mib, 0)))

    def row(label: str, key: str) -> None:
        print(f"{label:68s} {med[key]:8.3f} {gbs[key]:7.2f}")

    print(
        f"\nreplication: {WORLD} ranks on loopback as 2 nodes x {RANKS_PER_NODE}, part of"
        f" {size / 2**20:.0f} MiB per rank ({count} tensors), cliques {{0,2}} {{1,3}}, {reps}"
        f" interleaved repetitions\n(medians of the slowest rank; tierpoint after {WARMUP_SAVES}"
        f" warm-up saves; GB/s = part bytes one rank sends, and receives meanwhile, per second)"
    )
    print(f"{'contender':68s} {'seconds':>8s} {'GB/s':>7s}")
    row("tierpoint replication step (manager.last_replication)", "repl")
    row(f"raw gloo isend/irecv, {BUCKET >> 20} MiB messages (preallocated)", "raw_bucketed")
    row("raw gloo isend/irecv, one message (preallocated)", "raw_single")
    row("  diagnostic: raw gloo, each message hashed as it lands (xxh3)", "raw_hashed")
    row(
        f"  diagnostic: raw gloo, {BUCKET >> 20} MiB messages, both ends mapped files",
        "raw_mapped",
    )
    if "raw_populated" in s:
        row(
            "  diagnostic: the same, MAP_POPULATE (source shared, read-only)",
            "raw_populated",
        )
    row("tierpoint sync save with replication (whole save)", "save_repl")
    row("tierpoint sync save without replication", "save_plain")
    row("  diagnostic: fileformat.verify of the own part (readinto + hash)", "verify_file")
    row("  diagnostic: read_flat(mmap=True, verify=True) (hash the mapping)", "verify_mapped")
    moved = {int(b) for r in per_rank for b in r["series"]["repl_bytes"]}
    print(
        f"replication figure from {per_rank[0]['stats_source']}; bytes received per rank and"
        f" save: {', '.join(str(b) for b in sorted(moved))} (raw exchanges: {size})"
    )
    print("\nwhere the replication step's time goes (slowest rank, medians of exclusive seconds):")
    for line in phase_table(per_rank, "repl", "repl_phases", MOVE_PHASES):
        print(line)
    missing = sorted({m for r in per_rank for m in r["missing_hooks"]})
    if missing:
        print(f"  (not measured: hooks missing in this tierpoint: {', '.join(missing)})")

    fetched = max(max(r["series"]["recovery_bytes"]) for r in per_rank)
    print(
        f"\nrecovery: node {WIPED_NODE} (ranks {', '.join(map(str, WIPED))}) wiped; fresh managers;"
        f" each wiped rank receives {fetched / 2**20:.0f} MiB before load returns (its own part),"
        " as much again in the background (a replica);"
        f" {reps} interleaved repetitions\n(medians of the slowest rank; GB/s = one rank's part"
        " bytes per second)"
    )
    print(f"{'contender':68s} {'seconds':>8s} {'GB/s':>7s}")
    row("tierpoint find_latest + load from peers (all 4 ranks)", "recovery")
    row("  until the replicas are restored too (background, after load)", "recovery_restored")
    row(f"persistent dir on disk: readinto of the part (ranks {WIPED[0]}, {WIPED[1]})", "disk_raw")
    row(f"persistent dir on disk: torch.load (ranks {WIPED[0]}, {WIPED[1]})", "disk_torch")
    row("  context: readinto of the part files on all 4 ranks at once", "disk_raw_all")
    print(f"persistent dir: {disk} ({fs_of(disk)})")
    unknown = any(r["cache_unknown"] for r in per_rank)
    left = [r["resident_max"] for r in per_rank if r["resident_max"] is not None]
    if unknown or not left:
        print(
            "page cache: posix_fadvise(DONTNEED) issued before each read; mincore unavailable,"
            " so whether the cache was dropped is unknown"
        )
    elif max(left) <= 0.05:
        print(
            f"page cache: dropped before each read with posix_fadvise(DONTNEED) (at most"
            f" {max(left):.0%} of the pages still resident): reads came from the disk"
        )
    else:
        print(
            f"page cache: could NOT be dropped fully (up to {max(left):.0%} of the pages stayed"
            " resident after posix_fadvise(DONTNEED)): disk reads are partly from memory"
        )
    print(
        f"\nwhere a wiped rank's recovery time goes (the slower of ranks {WIPED[0]} and {WIPED[1]},"
        " medians of exclusive seconds):"
    )
    for line in phase_table(per_rank, "recovery", "recovery_phases", LOAD_PHASES, WIPED):
        print(line)

    ratio = paired(s["raw_bucketed"], s["repl"])
    print()
    label = f"replication rate >= {TARGET}x raw gloo ({BUCKET >> 20} MiB messages)"
    print(f"{label:62s} {ratio:5.2f}x  {'PASS' if ratio >= TARGET else 'MISS'}")
    infos = [
        ("replication rate vs raw gloo, one message", paired(s["raw_single"], s["repl"])),
        (
            "raw gloo hashed on arrival vs raw gloo (verifying's own cost)",
            paired(s["raw_bucketed"], s["raw_hashed"]),
        ),
        ("replication rate vs raw gloo hashed on arrival", paired(s["raw_hashed"], s["repl"])),
        ("replication rate vs raw gloo, both ends mapped", paired(s["raw_mapped"], s["repl"])),
        *(
            [
                (
                    "raw gloo between MAP_POPULATE mappings vs plain mappings",
                    paired(s["raw_mapped"], s["raw_populated"]),
                )
            ]
            if "raw_populated" in s
            else []
        ),
        (
            "verify from the mapping vs fileformat.verify",
            paired(s["verify_file"], s["verify_mapped"]),
        ),
        ("save with replication / save without", paired(s["save_repl"], s["save_plain"])),
        ("recovery speed-up vs disk readinto (ranks 2, 3)", paired(s["disk_raw"], s["recovery"])),
        (
            "recovery speed-up vs disk torch.load (ranks 2, 3)",
            paired(s["disk_torch"], s["recovery"]),
        ),
        (
            "recovery speed-up vs disk readinto (all 4 ranks)",
            paired(s["disk_raw_all"], s["recovery"]),
        ),
    ]
    for label, value in infos:
        print(f"{label:62s} {value:5.2f}x  info")


def fs_of(path: str) -> str:
    """The file system type and device of the mount holding ``path`` (from /proc/mounts)."""
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, kind = line.split()[:3]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, kind, device)
    except OSError:
        pass
    note = "" if best[1] != "tmpfs" else "; WARNING: tmpfs, not a disk"
    return f"{best[1]} on {best[2]}{note}"


# ------------------------------------------------------------------------------------ main


def check_room(mib: float) -> None:
    """Refuse to start where the run would not fit in memory (an OOM kill skips clean-up)."""
    part = mib * 2**20
    # per rank: state, raw send/recv buffers, torch.load result; in /dev/shm: own part, replica and
    # two spares (replicated manager), own part and a spare (plain), the mapped raw file
    need = WORLD * 11 * part + 2**30
    require_memory(int(need), "use a smaller --mib")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=256, help="state per rank in MiB (default 256)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    p.add_argument(
        "--disk-dir", default="/var/tmp", help="where the persistent-tier files go (a real disk)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    check_room(args.mib)
    # SIGTERM unwinds like Ctrl-C, so the directories go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = cpu_sample()
    root = tempfile.mkdtemp(prefix="tierpoint-repl-bench-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="tierpoint-repl-bench-", dir=args.disk_dir)
    try:
        per_rank = run_ranks(
            bench_rank,
            WORLD,
            root,
            disk,
            args.mib,
            args.reps,
            timeout=1800,
            pg_timeout=600,
        )
    finally:
        for child in multiprocessing.active_children():  # interrupted: no rank writes on
            child.kill()
            child.join(5)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    report(per_rank, args.mib, disk, args.reps)
    print(f"\n{machine_line(start)}")


if __name__ == "__main__":
    main()
