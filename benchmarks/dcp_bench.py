"""Persistent tier: tierpoint's DCP save/load against torch DCP and the raw floor, on 2 ranks.

Every rank holds ~``--gib`` GiB (default 1) of DTensor shards (``Shard(0)`` on a 2-rank CPU mesh; ~150
tensors: fp32 64 MiB / 8 MiB, bf16 4 MiB, int64 1 MiB, small fp32 and bool) plus two plain values,
so each rank writes and reads its own ~``--gib`` GiB. Two targets: a directory on the local disk
(under /tmp when /tmp is not a tmpfs) and /dev/shm. Per target and repetition, in this order (the
contenders interleave because the machine's speed drifts; each checkpoint is loaded right after it
is written, then removed, so at most one is on the target at a time):

1. tierpoint ``dcp.async_save`` with its queue and staging pool kept across saves (after one untimed
   warm-up save): blocking time (the call) and time to durable (until ``result()`` returns: files
   fsynced, ``.metadata`` committed). On /dev/shm the snapshot fills the data file itself, and the
   next save's file is allocated and faulted in by a background thread right after it (a cost the
   training steps after a save share): "next save's file ready" is when that is over, counted from
   the call, and nothing else starts before it; then tierpoint ``dcp.load`` of that checkpoint;
2. torch ``dcp.save`` (``FileSystemWriter``, ``thread_count=2``); then tierpoint ``dcp.load`` (its
   ``Reader``, 4 threads) and torch ``dcp.load`` with ``FileSystemReader`` of that same checkpoint
   (on a disk: both once more, from the page cache);
3. torch ``dcp.async_save`` (same writer settings, default staging: a fresh copy per save, on its own
   gloo group): blocking and durable; then tierpoint's synchronous ``dcp.save`` (2 threads), which
   writes straight from the tensors (no staging copy), for comparison;
4. the raw floor: the same tensor bytes written back to back into a new file with ``os.write`` and
   fsynced; written again past the page cache (``O_DIRECT`` from an aligned buffer, fsynced; on a
   disk often faster, so the write floor is the faster of the two in each repetition), into a
   second file; then the bytes are read back with ``readinto`` into the same preallocated tensors,
   and with ``preadv`` on 4 threads (a disk may serve several reads in flight faster than one
   stream; the read floor is the faster of the two in each repetition), both from the second file
   on a disk (dropped from the page cache before each read; then ``readinto`` once more from the
   page cache), one from each on /dev/shm.

Loads go into the saved DTensors themselves, zeroed first (memory that exists, as the floor's
``readinto`` targets), and must restore their exact bytes (xxh3 checked after every load). On the
disk target every file is dropped from the page cache before it is read (``posix_fadvise
DONTNEED``: a cold restart, as after a node reboot); then torch's checkpoint and the raw file are
read once more from the page cache those reads filled (a process restarted on the same node: the
targets in parentheses). On /dev/shm, where pages cannot be dropped, every timed read is the
first read of its files (the first read of a page just written costs more, ~20% here): torch's
checkpoint is saved a second time (untimed) for torch's reader, and the two raw reads read the two
raw files.

A figure is the slowest rank's time (what the job waits for); tables give medians over repetitions;
ratios are medians of per-repetition ratios (neighbours in time, so drift cancels). GB/s counts both
ranks' tensor bytes. Targets (PASS/MISS): durable save (tierpoint async_save's time to durable)
>= 1.5x torch ``dcp.save``; load >= 1.5x torch's reader; both >= 0.7x the floor. The same checks
for tierpoint's sync save are shown in parentheses. Next to each ratio to torch stands its ceiling:
the ratio tierpoint would reach at exactly the floor's speed (when torch already runs near the
floor, as with a cold disk, no reader or writer can reach 1.5x).

Run: ``./run bench dcp`` or ``.venv/bin/python benchmarks/dcp_bench.py [--gib 1 --reps 3]``. Peak
memory is about 3 x ``--gib`` GiB per rank (state, tierpoint's staging, torch's async staging copy)
plus one checkpoint, or the floor's two raw files. Everything written lives in fresh temporary
directories, removed at the end (also on errors).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from floor import raw_read, raw_read_parallel, raw_write, raw_write_direct, tensor_bytes
from machine import cpu_sample, machine_line
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tierpoint.testing import run_ranks

WORLD = 2
MIB = 2**20
READER_THREADS = 4

Times = dict[str, list[float]]


# ------------------------------------------------------------------------------------ the state


def shard_shapes(gib: float) -> list[tuple[tuple[int, int], torch.dtype]]:
    """Local (per-rank) shard shapes: ~``gib`` GiB in ~150 tensors of mixed sizes and dtypes."""
    scale = gib
    big = max(64, int(4096 * scale))  # rows of 4096 fp32: 64 MiB at gib=1
    shapes: list[tuple[tuple[int, int], torch.dtype]] = []
    shapes += [((big, 4096), torch.float32)] * 8
    shapes += [((max(8, int(1024 * scale)), 2048), torch.float32)] * 40  # 8 MiB
    shapes += [((max(8, int(1024 * scale)), 2048), torch.bfloat16)] * 40  # 4 MiB
    shapes += [((max(8, int(256 * scale)), 512), torch.int64)] * 30  # 1 MiB
    shapes += [((64, 64), torch.float32)] * 20
    shapes += [((1000, 1), torch.bool)] * 10
    return shapes


def make_local_tensors(gib: float, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in shard_shapes(gib):
        if dtype == torch.int64:
            out.append(torch.randint(0, 1 << 40, shape, generator=g))
        elif dtype == torch.bool:
            out.append(torch.rand(shape, generator=g) > 0.5)
        else:
            out.append(torch.randn(shape, generator=g).to(dtype))
    return out


def as_state(locals_: list[torch.Tensor], mesh: Any, step: Any, name: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    state: dict[str, Any] = {
        f"t{i:03d}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
        for i, t in enumerate(locals_)
    }
    state["step"] = step
    state["name"] = name
    return state


# ------------------------------------------------------------------------------------ helpers


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on this rank, all ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def digest(tensors: list[torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


def drop_cache(paths: list[Path]) -> None:
    """Evict the files' pages from the page cache (they are fsynced, so clean)."""
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@dataclass
class Rank:
    """What one rank keeps across targets and repetitions."""

    rank: int
    state: dict[str, Any]
    source: list[torch.Tensor]
    """The DTensors' local shards: saved from, and loaded back into (zeroed first)."""
    digest: str
    """xxh3 of ``source`` as made: every load must restore exactly these bytes."""
    queue: Any
    torch_group: Any


def torch_async_save(r: Rank, path: Path) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    response = dcp.async_save(
        r.state,
        checkpoint_id=path,
        storage_writer=FileSystemWriter(path, thread_count=2),
        process_group=r.torch_group,
    )
    blocking = time.perf_counter() - start
    getattr(response, "upload_completion", response).result()
    return blocking, time.perf_counter() - start


def tierpoint_async_save(r: Rank, path: Path, pool: Any) -> tuple[float, float, float]:
    """Blocking time, time to durable, and when the next save's in-place file (RAM file systems)
    is ready, counted from the start too (it is prepared in the background after the snapshot; the
    next contender starts only then, so that it does not compete with it)."""
    from tierpoint.dcp import async_save

    dist.barrier()
    start = time.perf_counter()
    future = async_save(r.state, str(path), queue=r.queue, staging_pool=pool)
    blocking = time.perf_counter() - start
    future.result()
    durable = time.perf_counter() - start
    pool.wait_for_spare()
    return blocking, durable, time.perf_counter() - start


def remove(*paths: Path) -> None:
    """Rank 0 removes ``paths`` once every rank is done with them."""
    dist.barrier()
    if dist.get_rank() == 0:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


def one_repetition(r: Rank, root: Path, rep: int, pool: Any, times: Times) -> None:
    """One of each contender, interleaved; each checkpoint is loaded right after it is written and
    removed before the next one (peak: one checkpoint on disk, which matters on /dev/shm)."""
    from tierpoint.dcp import load, save

    in_memory = str(root).startswith("/dev/shm")

    def record(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(seconds)

    def load_with(key: str, fn: Callable[[], Any], paths: list[Path]) -> None:
        for t in r.source:
            t.zero_()  # the load must write every byte back
        if not in_memory:
            drop_cache(paths)
        record(key, timed(fn))
        if digest(r.source) != r.digest:
            raise AssertionError(f"{key}: the loaded tensors differ from the saved ones")

    threads = READER_THREADS
    tp_dir, torch_dir, async_dir = root / f"tp-{rep}", root / f"torch-{rep}", root / f"ta-{rep}"
    sync_dir = root / f"tps-{rep}"
    raw = root / f"raw-{rep}-{r.rank}.bin"
    raw_direct = root / f"raw-direct-{rep}-{r.rank}.bin"

    blocking, durable, spare = tierpoint_async_save(r, tp_dir, pool)
    record("tp_block", blocking)
    record("tp_durable", durable)
    record("tp_spare", spare)
    load_with("tp_load_own", lambda: load(r.state, tp_dir, thread_count=threads), [tp_dir])
    remove(tp_dir)

    writer = FileSystemWriter(torch_dir, thread_count=2)
    record("torch_save", timed(lambda: dcp.save(r.state, storage_writer=writer)))
    load_with("tp_load", lambda: load(r.state, torch_dir, thread_count=threads), [torch_dir])
    if in_memory:  # a second copy, so that torch's reader too reads pages never read before
        remove(torch_dir)
        dcp.save(r.state, storage_writer=FileSystemWriter(torch_dir, thread_count=2))
    reader = FileSystemReader(torch_dir)
    load_with("torch_load", lambda: dcp.load(r.state, storage_reader=reader), [torch_dir])
    if not in_memory:  # again, from the page cache those reads filled (a process restarted)
        load_with("tp_load_warm", lambda: load(r.state, torch_dir, thread_count=threads), [])
        load_with("torch_load_warm", lambda: dcp.load(r.state, storage_reader=reader), [])
    remove(torch_dir)

    blocking, durable = torch_async_save(r, async_dir)
    record("torch_async_block", blocking)
    record("torch_async_durable", durable)
    remove(async_dir)

    record("tp_sync", timed(lambda: save(r.state, str(sync_dir))))
    remove(sync_dir)

    record("raw_write", timed(lambda: raw_write(raw, r.source)))
    try:
        record("raw_write_direct", timed(lambda: raw_write_direct(raw_direct, r.source)))
    except OSError:  # a file system without O_DIRECT: the buffered floor stands
        record("raw_write_direct", math.inf)
        raw_write(raw_direct, r.source)
    # On a disk both read the file written last (its cache dropped before each): a file written
    # earlier may be placed or cached differently by the virtual disk.
    first = raw if in_memory else raw_direct
    load_with("raw_read", lambda: raw_read(first, r.source), [first])
    load_with(
        "raw_read_parallel", lambda: raw_read_parallel(raw_direct, r.source, threads), [raw_direct]
    )
    if not in_memory:
        load_with("raw_read_warm", lambda: raw_read(raw_direct, r.source), [])
    raw.unlink()
    raw_direct.unlink()


def bench_rank(rank: int, world: int, roots: list[str], gib: float, reps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tierpoint.asyncsave import AsyncCallsQueue
    from tierpoint.dcp import StagingPool

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    source = make_local_tensors(gib, seed=rank)
    r = Rank(
        rank=rank,
        state=as_state(source, mesh, 7, "bench"),
        source=source,
        digest=digest(source),
        queue=AsyncCallsQueue(),
        torch_group=dist.new_group(backend="gloo"),
    )
    results: dict[str, Any] = {"nbytes": sum(t.numel() * t.element_size() for t in source)}
    pool = StagingPool()  # one for the whole run: the layout never changes
    try:
        for root_text in roots:
            root = Path(root_text)
            # Untimed warm-up: tierpoint's worker, staging and plan cache; torch's first save.
            tierpoint_async_save(r, root / "warm-tp", pool)
            torch_async_save(r, root / "warm-torch")
            remove(root / "warm-tp", root / "warm-torch")
            times: Times = {}
            for rep in range(reps):
                one_repetition(r, root, rep, pool, times)
            results[root_text] = times
    finally:
        r.queue.close()
    return results


# ------------------------------------------------------------------------------------ reporting

ROWS = [
    ("tierpoint async_save: blocking", "tp_block"),
    ("tierpoint async_save: time to durable", "tp_durable"),
    ("tierpoint async_save: next save's file ready", "tp_spare"),
    ("tierpoint dcp.save (sync, 2 threads)", "tp_sync"),
    ("torch dcp.save (FileSystemWriter, 2 threads)", "torch_save"),
    ("torch dcp.async_save: blocking", "torch_async_block"),
    ("torch dcp.async_save: time to durable", "torch_async_durable"),
    ("raw write (os.write + fsync, new file)", "raw_write"),
    ("raw write past the page cache (O_DIRECT + fsync)", "raw_write_direct"),
    ("raw write floor (the faster of the two)", "write_floor"),
    (f"tierpoint load, torch's checkpoint ({READER_THREADS} threads)", "tp_load"),
    ("torch dcp.load (FileSystemReader)", "torch_load"),
    ("tierpoint load, tierpoint's checkpoint", "tp_load_own"),
    ("raw read (readinto, preallocated)", "raw_read"),
    (f"raw read, {READER_THREADS} threads (preadv of 16 MiB pieces)", "raw_read_parallel"),
    ("raw read floor (the faster of the two)", "read_floor"),
    ("page cache: tierpoint load, torch's checkpoint", "tp_load_warm"),
    ("page cache: torch dcp.load (FileSystemReader)", "torch_load_warm"),
    ("page cache: raw read (readinto)", "raw_read_warm"),
]
CHECKS = [
    # (label, slower contender, tierpoint, target, floor bounding the ratio to torch)
    ("durable save >= 1.5x torch dcp.save", "torch_save", "tp_durable", 1.5, "write_floor"),
    ("durable save >= 0.7x raw write floor", "write_floor", "tp_durable", 0.7, None),
    ("  (sync save >= 1.5x torch dcp.save)", "torch_save", "tp_sync", 1.5, "write_floor"),
    ("  (sync save >= 0.7x raw write floor)", "write_floor", "tp_sync", 0.7, None),
    ("load >= 1.5x torch FileSystemReader", "torch_load", "tp_load", 1.5, "read_floor"),
    ("load >= 0.7x raw read floor", "read_floor", "tp_load", 0.7, None),
    ("  (page cache: load >= 1.5x torch's reader)", "torch_load_warm", "tp_load_warm", 1.5, None),
    ("  (page cache: load >= 0.7x raw read)", "raw_read_warm", "tp_load_warm", 0.7, None),
]


def report(per_rank: list[dict[str, Any]], roots: dict[str, str], reps: int) -> None:
    total = sum(r["nbytes"] for r in per_rank)
    for root, label in roots.items():
        slowest = {
            k: [max(r[root][k][i] for r in per_rank) for i in range(reps)]
            for k in per_rank[0][root]
        }
        slowest["write_floor"] = list(map(min, slowest["raw_write"], slowest["raw_write_direct"]))
        slowest["read_floor"] = list(map(min, slowest["raw_read"], slowest["raw_read_parallel"]))
        med = {k: statistics.median(v) for k, v in slowest.items()}
        print(
            f"\n{label}: {WORLD} ranks x {total / WORLD / 2**30:.2f} GiB, {reps} interleaved"
            " repetitions (medians, slowest rank)"
        )
        print(f"{'contender':50s} {'seconds':>8s} {'GB/s':>7s}  {'range (s)':>13s}")
        for name, key in ROWS:
            if key not in med:
                continue
            spread = f"{min(slowest[key]):.3f}-{max(slowest[key]):.3f}"
            print(f"{name:50s} {med[key]:8.3f} {total / med[key] / 1e9:7.2f}  {spread:>13s}")
        print()
        for name, slow, fast, target, floor in CHECKS:
            if fast not in med:
                continue
            ratio = paired(slowest, slow, fast)
            verdict = "PASS" if ratio >= target else "MISS"
            note = ""
            if floor is not None:
                # Even at the floor's speed tierpoint could not beat torch by more than this.
                ceiling = paired(slowest, slow, floor)
                note = f"  (ceiling at the floor's speed: {ceiling:.2f}x)"
            print(f"  {name:44s} {ratio:5.2f}x  {verdict}{note}")


def paired(times: Times, slow: str, fast: str) -> float:
    """Median over repetitions of ``slow / fast`` (each pair ran close together in time)."""
    return statistics.median([s / f for s, f in zip(times[slow], times[fast])])


def disk_root() -> str:
    """A directory on a real disk: /tmp unless it is a tmpfs, else the working directory."""
    fstype = subprocess.run(
        ["stat", "-f", "-c", "%T", "/tmp"], capture_output=True, text=True, check=False
    ).stdout.strip()
    base = "/tmp" if fstype not in ("tmpfs", "ramfs") else os.getcwd()
    return tempfile.mkdtemp(prefix="tierpoint-dcp-bench-", dir=base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size per rank (GiB)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: the finally below removes the files (and stops the ranks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = cpu_sample()
    roots = {
        disk_root(): "local disk",
        tempfile.mkdtemp(prefix="tierpoint-dcp-bench-", dir="/dev/shm"): "/dev/shm",
    }
    try:
        per_rank = run_ranks(
            bench_rank, WORLD, list(roots), args.gib, args.reps, timeout=3600, pg_timeout=900
        )
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    report(per_rank, roots, args.reps)
    print()
    print(machine_line(start))


if __name__ == "__main__":
    main()
