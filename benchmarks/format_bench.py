"""Part-file benchmark: tierpoint write/read against torch.save/load, safetensors and raw I/O.

What it measures (CPU only, files on the /dev/shm tmpfs, so this is memory-to-memory speed):

- A ~2 GiB training state shaped like a transformer with Adam state (bf16/fp16 weights, fp32
  master copies, fp32 ``exp_avg``/``exp_avg_sq``, int64 step counters, a few small tensors and
  plain values).
- Write: ``tierpoint.fileformat.write`` (which fsyncs), ``torch.save``,
  ``safetensors.torch.save_file`` and a raw floor (one ``os.write`` per tensor into a new file,
  then ``fsync``). Every repetition deletes the contender's previous file first, so every write
  fills new tmpfs pages.
- Read: ``fileformat.read_flat`` into preallocated tensors (verify on and off), ``fileformat.read``
  (fresh tensors, verify on), ``torch.load`` (plain, and ``mmap=True`` both lazily and followed by a
  copy into the preallocated tensors), ``safetensors.torch.load_file`` and a raw floor (one
  ``readinto`` per tensor into the preallocated tensors). Before each run, memory the previous
  one freed goes back to the kernel (``malloc_trim``), so fresh allocations are fresh for all.
- Also, where ``read_flat`` has ``mmap=True`` (a copy-on-write mapping of the file): that load, and
  that load followed by a store to every page (what the first in-place optimizer step does, each
  store a copy-on-write fault), next to the same stores after a read into the targets.
- Context: memcpy bandwidth into reused memory (``copy_`` of every tensor into a preallocated one).

After one untimed warm-up round, contenders run interleaved (A B C, B C A, C A B, ...: each
round starts one further) because this machine's speed drifts. The tables give medians, GB/s
(10**9 bytes of tensor payload per second) and speed ratios (``reference time / this time``, so
> 1 is faster) against the raw floor and against torch.save / torch.load; then PASS/MISS for the
issue's targets: tierpoint write >= 0.9x the raw new-file floor; tierpoint verified read into
targets >= 0.85x the raw read floor and >= 1.5x torch.load. Rows marked "lazy" map the file and
copy nothing: their speed is not comparable. Each round and the last line tell how much CPU other
processes took meanwhile, the usual cause of drift (tierpoint hashes on a second thread, so it
suffers most when the other CPU is taken). Everything written lives in one fresh directory under
/dev/shm, removed at the end, also on Ctrl-C or SIGTERM.

Run: ``./run bench format [--gib 2 --reps 5]`` or ``.venv/bin/python benchmarks/format_bench.py
--gib 2``; ``--gib 0.2 --reps 2`` is a quick smoke run (seconds).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import inspect
import math
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from floor import preallocate, raw_read, raw_write
from machine import CpuSample, cpu_sample, machine_line, others_cpu_seconds

from tierpoint import fileformat
from tierpoint.tree import flatten

try:  # a contender where installed (./run bench installs it)
    import safetensors
    import safetensors.torch
except ImportError:
    safetensors = None

GIB = 1 << 30
PAGE = 4096
LAYERS = 5
"""Transformer blocks; with Adam state this gives ~290 tensors whatever the size."""
FILES_ON_SHM = 4
"""Files alive at once: one per write contender (the read phase reads the last ones)."""
RAM_COPIES = 3
"""State, preallocated targets and one freshly loaded copy."""

# Targets from the issue: speed ratios tierpoint must reach.
WRITE_VS_FLOOR = 0.9
READ_VS_FLOOR = 0.85
READ_VS_TORCH = 1.5


# ------------------------------------------------------------------------------------ the state


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def low_precision(self) -> bool:
        return self.dtype in (torch.bfloat16, torch.float16)


def param_specs(d: int) -> list[ParamSpec]:
    """The parameters of a small GPT: bf16 matmul weights, fp32 norms and biases, fp16 positions."""
    vocab = 8 * d
    specs = [
        ParamSpec("embed.weight", (vocab, d), torch.bfloat16),
        ParamSpec("pos_embed", (d, d), torch.float16),
    ]
    for i in range(LAYERS):
        p = f"layers.{i}."
        specs += [
            ParamSpec(p + "ln1.weight", (d,), torch.float32),
            ParamSpec(p + "ln1.bias", (d,), torch.float32),
            ParamSpec(p + "attn.qkv.weight", (3 * d, d), torch.bfloat16),
            ParamSpec(p + "attn.qkv.bias", (3 * d,), torch.float32),
            ParamSpec(p + "attn.proj.weight", (d, d), torch.bfloat16),
            ParamSpec(p + "attn.proj.bias", (d,), torch.float32),
            ParamSpec(p + "ln2.weight", (d,), torch.float32),
            ParamSpec(p + "ln2.bias", (d,), torch.float32),
            ParamSpec(p + "mlp.fc1.weight", (4 * d, d), torch.bfloat16),
            ParamSpec(p + "mlp.fc1.bias", (4 * d,), torch.float32),
            ParamSpec(p + "mlp.fc2.weight", (d, 4 * d), torch.bfloat16),
            ParamSpec(p + "mlp.fc2.bias", (d,), torch.float32),
        ]
    specs += [
        ParamSpec("final_ln.weight", (d,), torch.float32),
        ParamSpec("final_ln.bias", (d,), torch.float32),
        ParamSpec("lm_head.weight", (vocab, d), torch.bfloat16),
    ]
    return specs


def state_bytes(d: int) -> int:
    """Tensor bytes of params, fp32 master copies and Adam state for hidden size ``d`` (the few
    small extra tensors of :func:`build_state` add a few KiB)."""
    total = 0
    for s in param_specs(d):
        own = s.numel * s.dtype.itemsize
        master = 4 * s.numel if s.low_precision else 0
        total += own + master + 2 * 4 * s.numel + 8
    return total


def hidden_size_for(target_bytes: float) -> int:
    d = 64
    while state_bytes(d + 8) <= target_bytes:
        d += 8
    return d


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02).to(dtype)


def _adam_state(spec: ParamSpec, step: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    state = {"step": torch.tensor(step, dtype=torch.int64)}
    if spec.low_precision:
        state["master"] = _random(spec.shape, torch.float32, gen)
    state["exp_avg"] = _random(spec.shape, torch.float32, gen)
    state["exp_avg_sq"] = _random(spec.shape, torch.float32, gen).square_()
    return state


def build_state(d: int, seed: int = 0) -> dict[str, Any]:
    """A training checkpoint: model, optimizer (Adam), grad scaler, RNG and plain metadata."""
    gen = torch.Generator().manual_seed(seed)
    specs = param_specs(d)
    step = 12_345
    model = {s.name: _random(s.shape, s.dtype, gen) for s in specs}
    optimizer = {
        "state": {i: _adam_state(s, step, gen) for i, s in enumerate(specs)},
        "param_groups": [
            {
                "lr": 3e-4,
                "betas": (0.9, 0.95),
                "eps": 1e-8,
                "weight_decay": 0.1,
                "params": list(range(len(specs))),
            }
        ],
    }
    return {
        "model": model,
        "optimizer": optimizer,
        "scaler": {"scale": torch.tensor(65536.0), "growth_tracker": torch.tensor(7)},
        "rng": {"cpu": torch.get_rng_state(), "seed": seed},
        "loss_history": torch.randn(1000, generator=gen).to(torch.float16),
        "iteration": step,
        "config": {"hidden": d, "layers": LAYERS, "name": "format-bench"},
    }


# ------------------------------------------------------------------------------------ helpers


def unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def copy_into(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    for dst, src in zip(targets, sources, strict=True):
        dst.copy_(src)


def same_tensors(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Give memory freed by the previous contender back to the kernel.

    Otherwise glibc keeps some of it in its heap and whichever contender runs next gets
    ready-faulted "fresh" memory: a fresh-allocating load then looks up to 2x faster or slower
    depending on what ran before it.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# ------------------------------------------------------------------------------------ contenders


@dataclass
class Contender:
    name: str
    run: Callable[[], Any]
    before: Callable[[], None] | None = None
    """Untimed set-up before each run (deleting the previous file)."""
    path: Path | None = None
    note: str = ""
    times: list[float] = field(default_factory=list)

    def time_once(self, record: bool = True) -> float:
        if self.before is not None:
            self.before()
        gc.collect()
        release_free_memory()
        start = time.perf_counter()
        result = self.run()
        elapsed = time.perf_counter() - start
        del result  # freeing a fresh copy is not part of its load time
        if record:
            self.times.append(elapsed)
        return elapsed

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass(frozen=True)
class Files:
    """One file per format; each write contender replaces its own."""

    tierpoint: Path
    torch: Path
    safetensors: Path
    raw: Path

    @classmethod
    def under(cls, root: Path) -> Files:
        names = ("tierpoint.tp", "torch.pt", "state.safetensors", "raw.bin")
        return cls(*(root / n for n in names))


def write_contenders(
    state: Any,
    names: list[str],
    tensors: list[torch.Tensor],
    targets: list[torch.Tensor],
    files: Files,
) -> list[Contender]:
    flat_dict = dict(zip(names, tensors, strict=True))
    tp, pt, st, raw = files.tierpoint, files.torch, files.safetensors, files.raw
    return [
        Contender(
            "tierpoint write", lambda: fileformat.write(tp, state), lambda: unlink(tp), tp, "fsync"
        ),
        Contender("torch.save", lambda: torch.save(state, pt), lambda: unlink(pt), pt),
        Contender(
            "safetensors save_file",
            lambda: safetensors.torch.save_file(flat_dict, str(st)),
            lambda: unlink(st),
            st,
        ),
        Contender(
            "raw os.write (floor)",
            lambda: raw_write(raw, tensors),
            lambda: unlink(raw),
            raw,
            "fsync",
        ),
        Contender("memcpy copy_ (context)", lambda: copy_into(targets, tensors), note="reused mem"),
    ]


def installed(contenders: list[Contender]) -> list[Contender]:
    """``contenders`` less those of a library that is not installed."""
    return [c for c in contenders if safetensors is not None or "safetensors" not in c.name]


def load_mmap_and_copy(path: Path, targets: list[torch.Tensor]) -> None:
    loaded = torch.load(path, mmap=True, weights_only=True)
    copy_into(targets, flatten(loaded).tensors)


def load_safetensors_and_copy(path: Path, names: list[str], targets: list[torch.Tensor]) -> None:
    loaded = safetensors.torch.load_file(path)
    copy_into(targets, [loaded[n] for n in names])


def write_every_page(tensors: Sequence[torch.Tensor]) -> None:
    """Store to one byte in every 4 KiB, as the first in-place optimizer step does to each page."""
    for t in tensors:
        if t.numel():
            t.as_strided((t.numel(),), (1,)).view(torch.uint8)[::PAGE].add_(0)


def read_then_store(path: Path, targets: list[torch.Tensor]) -> None:
    fileformat.read_flat(path, verify=True, targets=targets)
    write_every_page(targets)


def tierpoint_mmap_contenders(tp: Path) -> list[Contender]:
    """``read_flat(mmap=True)`` (a copy-on-write mapping; the local tier loads so), if present."""
    if "mmap" not in inspect.signature(fileformat.read_flat).parameters:
        return []

    def load(verify: bool, write: bool) -> list[torch.Tensor]:
        _, loaded = fileformat.read_flat(tp, verify=verify, mmap=True)
        if write:
            write_every_page(loaded)
        return loaded

    return [
        Contender("tierpoint mmap verify", lambda: load(True, False), note="lazy COW map, hashed"),
        Contender(
            "tierpoint mmap verify + page stores",
            lambda: load(True, True),
            note="a COW fault per page",
        ),
        Contender("tierpoint mmap no-verify", lambda: load(False, False), note="lazy"),
    ]


def read_contenders(
    files: Files, names: list[str], tensors: list[torch.Tensor], targets: list[torch.Tensor]
) -> list[Contender]:
    tp, pt, st, raw = files.tierpoint, files.torch, files.safetensors, files.raw
    return [
        Contender(
            "tierpoint read_flat verify",
            lambda: fileformat.read_flat(tp, verify=True, targets=targets),
            note="into targets",
        ),
        Contender(
            "tierpoint read_flat no-verify",
            lambda: fileformat.read_flat(tp, verify=False, targets=targets),
            note="into targets",
        ),
        Contender(
            "tierpoint verify + page stores",
            lambda: read_then_store(tp, targets),
            note="targets: no faults",
        ),
        *tierpoint_mmap_contenders(tp),
        Contender("tierpoint read", lambda: fileformat.read(tp), note="fresh, verify"),
        Contender("torch.load", lambda: torch.load(pt, weights_only=True), note="fresh"),
        Contender(
            "torch.load mmap",
            lambda: torch.load(pt, mmap=True, weights_only=True),
            note="lazy: copies nothing",
        ),
        Contender(
            "torch.load mmap + copy_",
            lambda: load_mmap_and_copy(pt, targets),
            note="into targets",
        ),
        Contender(
            "safetensors load_file",
            lambda: safetensors.torch.load_file(st),
            note=f"lazy in v{getattr(safetensors, '__version__', '?')} (mmap)",
        ),
        Contender(
            "safetensors load_file + copy_",
            lambda: load_safetensors_and_copy(st, names, targets),
            note="into targets",
        ),
        Contender("raw readinto (floor)", lambda: raw_read(raw, targets), note="into targets"),
        Contender("memcpy copy_ (context)", lambda: copy_into(targets, tensors), note="reused mem"),
    ]


def run_interleaved(contenders: Sequence[Contender], reps: int, phase: str) -> None:
    """One untimed warm-up round, then ``reps`` timed rounds of every contender in turn.

    Each round starts one contender further down the list, so no contender always runs right
    after the same one (what ran just before, e.g. a large free, measurably shifts a timing).
    The warm-up matters on a VM: the first touch of guest memory the kernel never handed out
    before is backed by the host on demand, which makes whichever contender meets it look slow.
    """
    print(f"{phase} contenders: " + ", ".join(c.name for c in contenders), flush=True)
    warm = " ".join(f"{c.time_once(record=False):.2f}" for c in contenders)
    print(f"  {phase} warm-up (not counted): {warm} s", flush=True)
    n = len(contenders)
    for rep in range(reps):
        start = cpu_sample()
        for k in range(n):
            contenders[(rep + k) % n].time_once()
        end = cpu_sample()
        times = " ".join(f"{c.times[-1]:.2f}" for c in contenders)
        others = others_cpu_seconds(start, end) / (end.wall - start.wall)
        print(
            f"  {phase} round {rep + 1}/{reps} (listed order): {times} s;"
            f" other processes: {others:.2f} CPUs",
            flush=True,
        )


# ------------------------------------------------------------------------------------ report


def ratio(base: Contender | None, c: Contender) -> str:
    return f"{base.median / c.median:6.2f}x" if base is not None else ""


def print_table(
    title: str,
    contenders: Sequence[Contender],
    payload: int,
    floor: Contender,
    torch_ref: Contender,
) -> None:
    print(f"\n{title}")
    head = f"{'contender':36} {'median s':>9} {'min s':>7} {'max s':>7} {'GB/s':>6}"
    head += f" {'vs floor':>8} {'vs torch':>8} {'file MiB':>9}  note"
    print(head)
    print("-" * len(head))
    for c in contenders:
        size = (
            f"{c.path.stat().st_size / (1 << 20):9.1f}" if c.path and c.path.exists() else " " * 9
        )
        print(
            f"{c.name:36} {c.median:9.3f} {min(c.times):7.3f} {max(c.times):7.3f}"
            f" {payload / c.median / 1e9:6.2f} {ratio(floor, c):>8} {ratio(torch_ref, c):>8}"
            f" {size}  {c.note}"
        )


def paired_ratio(base: Contender, c: Contender) -> float:
    """Median over repetitions of ``base time / c time`` within the same repetition."""
    return statistics.median(b / t for b, t in zip(base.times, c.times, strict=True))


def check(label: str, base: Contender, c: Contender, target: float) -> bool:
    got = base.median / c.median
    verdict = "PASS" if got >= target else "MISS"
    print(
        f"  {verdict}  {label}: {got:.3f}x (target >= {target:.2f}x;"
        f" per-repetition median {paired_ratio(base, c):.3f}x)"
    )
    return got >= target


def by_name(contenders: Sequence[Contender]) -> dict[str, Contender]:
    return {c.name: c for c in contenders}


def print_checks(writes: Sequence[Contender], reads: Sequence[Contender]) -> None:
    w, r = by_name(writes), by_name(reads)
    tp_read = r["tierpoint read_flat verify"]
    print("\ntargets (speed ratio = other's median time / tierpoint's median time):")
    check(
        "tierpoint write vs raw new-file floor",
        w["raw os.write (floor)"],
        w["tierpoint write"],
        WRITE_VS_FLOOR,
    )
    check(
        "tierpoint read (verify, targets) vs raw read floor",
        r["raw readinto (floor)"],
        tp_read,
        READ_VS_FLOOR,
    )
    check("tierpoint read (verify, targets) vs torch.load", r["torch.load"], tp_read, READ_VS_TORCH)


def print_machine(start: CpuSample) -> None:
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    print(f"\n{machine_line(start)}; peak RSS {peak_rss:.1f} GiB")


# ------------------------------------------------------------------------------------ main


def check_room(payload: int) -> None:
    """Refuse to start where the run could fill /dev/shm or memory (an OOM kill skips clean-up)."""
    shm = os.statvfs("/dev/shm")
    shm_free = shm.f_bavail * shm.f_frsize
    need_shm = int(FILES_ON_SHM * payload * 1.05)
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    need_ram = need_shm + RAM_COPIES * payload
    if shm_free < need_shm or meminfo["MemAvailable"] < need_ram:
        raise SystemExit(
            f"not enough room for {payload / GIB:.2f} GiB of state: /dev/shm has"
            f" {shm_free / GIB:.1f} GiB free (need {need_shm / GIB:.1f}), memory"
            f" {meminfo['MemAvailable'] / GIB:.1f} GiB available (need {need_ram / GIB:.1f});"
            " use a smaller --gib"
        )


def verify_round_trip(
    files: Files, tensors: list[torch.Tensor], targets: list[torch.Tensor]
) -> None:
    """Untimed sanity check: the tierpoint file reads back bit-exact into cleared targets."""
    for t in targets:
        t.zero_()
    _, back = fileformat.read_flat(files.tierpoint, verify=True, targets=targets)
    if not same_tensors(back, tensors):
        raise SystemExit("tierpoint round trip is NOT bit-exact")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2.0)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: a multi-threaded copy_ stalls whenever another"
        " process holds a CPU, and the kernel copies of read/write are single-threaded too)",
    )
    args = p.parse_args(argv)
    if args.gib <= 0 or args.reps < 1 or args.threads < 1:
        p.error("--gib must be > 0, --reps and --threads >= 1")
    return args


def run(gib: float, reps: int, root: Path) -> None:
    d = hidden_size_for(gib * GIB)
    check_room(state_bytes(d))
    start = cpu_sample()
    t0 = time.perf_counter()
    state = build_state(d)
    flat = flatten(state)
    tensors, names = flat.tensors, flat.paths
    payload = sum(t.nbytes for t in tensors)
    targets = preallocate(tensors)
    print(
        f"state: {len(tensors)} tensors, {payload / GIB:.3f} GiB ({payload / 1e9:.3f} GB),"
        f" hidden {d}, built in {time.perf_counter() - t0:.1f} s; {reps} interleaved reps;"
        f" torch {torch.__version__}, {torch.get_num_threads()} threads, files in {root}",
        flush=True,
    )
    files = Files.under(root)
    writes = installed(write_contenders(state, names, tensors, targets, files))
    run_interleaved(writes, reps, "write")
    reads = installed(read_contenders(files, names, tensors, targets))
    run_interleaved(reads, reps, "read")
    verify_round_trip(files, tensors, targets)
    w, r = by_name(writes), by_name(reads)
    print_table(
        "WRITE (new file each rep)", writes, payload, w["raw os.write (floor)"], w["torch.save"]
    )
    print_table("READ", reads, payload, r["raw readinto (floor)"], r["torch.load"])
    print_checks(writes, reads)
    print_machine(start)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    # SIGTERM unwinds like Ctrl-C so the finally below removes the files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="format_bench-", dir="/dev/shm"))
    try:
        run(args.gib, args.reps, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
