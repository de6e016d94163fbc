"""The GPU path (issue 21): what checkpointing a CUDA training state costs, against the PCIe floor and
torch DCP, on one GPU.

State: the transformer-like state of ``async_bench`` (fp32 weights and Adam moments, bf16 norms,
int64 step counters, ~300 tensors) moved to the GPU, ~``--gib`` GiB (by default sized from the
GPU's memory: 1/16 of it, at most 4 GiB and what host memory and the tier's file system allow).
Measured, interleaved (A B C A B C ...: the machine drifts), after warm-up saves:

- floors: the device-to-host copy of every tensor into one page-locked buffer (``non_blocking`` on a
  side stream, one synchronize) and into pageable memory (allocated and touched beforehand);
- local tier (``LocalCheckpointManager`` + ``AsyncCallsQueue``): blocking time (``save`` +
  ``schedule_async_request``), when the snapshot is copied, time to durable; plain, with
  ``overlap_snapshot=True`` and with ``device_snapshot=True`` too; the first save's blocking
  time, after ``warm_up`` (as a job would call it, steps ahead) and without it;
- persistent tier (``tierpoint.dcp.async_save`` into a fresh step directory each time, a reused
  ``StagingPool``): blocking time, time to durable; the first save after ``tierpoint.dcp.warm_up``;
- torch DCP ``async_save`` (``no_dist=True``) with its default staging and with a reused pinned
  ``DefaultStager`` (where this torch has one); a contender torch refuses is reported as failed;
- a training loop: a GPT-style model (``--layers`` x ``--width``, sequence 512, batch 8, bf16
  autocast, fused AdamW), ``--steps`` steps a run: (a) no checkpoints; tierpoint local async every
  25 and every 10 steps, plain, overlapped (optimizer hook waiting for the snapshot) and with
  ``device_snapshot`` (overlapped; the hook has nothing to wait for); torch DCP
  ``async_save`` (default options) every 25. Throughput relative to (a), and what the training
  thread waited for per save. Whole runs differ by 10-20% on a GPU machine (in run 7 of issue 21,
  5.7-7.0 s for the same 100 steps), more than the few percent a save costs, so each variant is
  also measured in ``--pairs`` paired segments: as many steps as it saves every, without a save,
  then with one (its segment ends when the save is durable: nothing spills over). Pairs are a
  second or two apart, so the drift between runs cancels out of their ratios.

Tables give medians; ratios to the floor are medians of per-repetition ratios (neighbours in time).
Host memory (RSS and the tier's files) is shown before and after the training loop, and after each
of ``--memory-saves`` (50) saves taking turns between the tiers, a state of at most 1 GiB. Everything
written goes under one fresh directory (/dev/shm when it has room), a subdirectory per part removed
after it, the whole removed at the end. A part that raises is reported (traceback, ``failed_parts``
in the JSON, exit status 1) and the next part runs; ``--json`` is written however the run ends
(SIGTERM, as ``timeout`` sends, included), with what was measured by then (``incomplete`` says so).

Run: ``./run bench gpu [--reps 5] [--json results.json]``; without CUDA it exits with a message.
``--parts saves,training`` and ``--variants tp10,ov10`` measure a part of it (a short device run);
``--profile dv10`` runs a variant once more under cProfile and prints where its time went.
``--device cpu`` runs the same code on the CPU with a tiny state (a check of the script itself; its
figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from async_bench import (
    GIB,
    DcpTrainingSaver,
    OverlapHook,
    TierpointSaver,
    dcp_contender,
    make_state,
    median,
    paired,
    reusable_stager,
    run_interleaved,
    train_run,
)
from floor import nbytes_of, tensors_of
from machine import cpu_sample, machine_line, require_memory

from tierpoint import dcp as tpdcp
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.snapshot_copy import LANES_ENV

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

Metrics = dict[str, float]
Times = dict[str, list[float]]
BATCH = 8
PARTS = ("saves", "memory", "training")
TRAIN_VARIANTS = ("tp25", "tp10", "ov25", "ov10", "dv25", "dv10", "dcp25")
VARIANT = re.compile(r"(?P<mode>tp|ov|dv)(?P<every>[0-9]+)(?:w(?P<lanes>[0-9]+))?|dcp25")
"""A training variant: mode (tp plain, ov overlapped, dv device snapshot), a save every so many
steps, optionally ``w<N>``: the worker copies or hashes with N lanes (``TIERPOINT_COPY_LANES``)."""
MODES = {
    "tp": "tierpoint local async",
    "ov": "tierpoint local overlapped",
    "dv": "tierpoint local device snapshot",
}
HOST_COPIES = 10
"""Host memory per byte of state: floors (2), local staging and files (3), persistent staging and
files (2), DCP's copies and files (3)."""


# ------------------------------------------------------------------------------------ the device


def device_line(device: torch.device) -> str:
    if device.type != "cuda":
        return "device: CPU (--device cpu: a check of the script, not a measurement)"
    p = torch.cuda.get_device_properties(device)
    return (
        f"device: {p.name}, {p.total_memory / GIB:.0f} GiB, {p.multi_processor_count} SMs;"
        f" torch {torch.__version__}, CUDA {torch.version.cuda}; {os.cpu_count()} CPUs"
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_root(need: int) -> Path:
    """/dev/shm when it has room for the tier's files, else the temporary directory."""
    for base in ("/dev/shm", tempfile.gettempdir()):
        st = os.statvfs(base)
        if st.f_bavail * st.f_frsize >= need:
            return Path(tempfile.mkdtemp(prefix="tierpoint-gpu-bench-", dir=base))
    raise SystemExit(f"no file system with {need / GIB:.1f} GiB free for the checkpoints")


def state_size(args: argparse.Namespace, device: torch.device) -> float:
    """GiB of state: ``--gib``, or 1/16 of the GPU's memory, at most 4 GiB and what host memory
    allows for the contenders' copies."""
    if args.gib is not None:
        return args.gib
    if device.type != "cuda":
        return 0.05
    gpu = torch.cuda.get_device_properties(device).total_memory / GIB
    with open("/proc/meminfo") as f:
        host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvail"))
    return max(0.25, min(4.0, gpu / 16, host / GIB / (HOST_COPIES + 2)))


def on_device(state: Any, device: torch.device) -> Any:
    """``state`` with its floating-point tensors moved to ``device`` (integer counters stay on
    the CPU, as optimizers keep them: a mixed state)."""
    if isinstance(state, torch.Tensor):
        return state.to(device) if state.is_floating_point() else state
    if isinstance(state, dict):
        return {k: on_device(v, device) for k, v in state.items()}
    return state


# ------------------------------------------------------------------------------------ contenders


def d2h_floor(tensors: Sequence[torch.Tensor], pinned: bool, key: str) -> Callable[[], Metrics]:
    """Device-to-host copy of every tensor into one preallocated host buffer (touched first)."""
    total = nbytes_of(tensors)
    host = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
    targets, at = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        targets.append(host[at : at + n].view(t.dtype).view(t.shape))
        at += n
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)
    stream = torch.cuda.Stream(device) if device is not None else None

    def run() -> Metrics:
        start = time.perf_counter()
        if stream is None:
            for dst, src in zip(targets, tensors):
                dst.copy_(src)
        else:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for dst, src in zip(targets, tensors):
                    dst.copy_(src, non_blocking=pinned)
            stream.synchronize()
        return {key: time.perf_counter() - start}

    return run


class PersistentSaver:
    """``tierpoint.dcp.async_save`` into a new step directory each time, one pool, one queue; the
    previous step directory is removed once the next one is durable (the tier holds one)."""

    def __init__(self, root: Path, state: Any, stack: contextlib.ExitStack) -> None:
        self.root, self.state = root, state
        self.queue = stack.enter_context(AsyncCallsQueue())
        self.pool = tpdcp.StagingPool()
        stack.callback(self.pool.close)
        self.steps = itertools.count(1)
        self.previous: Path | None = None

    def warm_up(self) -> None:
        """The first save's staging memory, prepared ahead (as a job would, steps before it)."""
        tpdcp.warm_up(self.state, self.root, staging_pool=self.pool)
        self.pool.wait_for_spare(120)

    def measure(self) -> Metrics:
        self.pool.wait_for_spare(120)  # the next in-place file is ready: a quiet start
        path = Path(tpdcp.step_path(self.root, next(self.steps)))
        start = time.perf_counter()
        future = tpdcp.async_save(self.state, path, queue=self.queue, staging_pool=self.pool)
        returned = time.perf_counter()
        future.result(timeout=600)
        durable = time.perf_counter() - start
        if self.previous is not None:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = path
        return {"pt_block": returned - start, "pt_durable": durable}


def guarded(
    name: str, run: Callable[[], Metrics], failures: dict[str, str]
) -> Callable[[], Metrics]:
    """``run``, or nothing from the first time it raises on (its failure kept in ``failures``)."""

    def call() -> Metrics:
        if name in failures:
            return {}
        try:
            return run()
        except Exception as e:  # noqa: BLE001 - reported as failed
            failures[name] = f"{type(e).__name__}: {e}"[:300]
            return {}

    return call


# ------------------------------------------------------------------------------------ training


class GptTrainer:
    """A GPT-style decoder (pre-norm blocks, causal attention), bf16 autocast, fused AdamW; the
    interface ``async_bench.train_run`` drives (``step``, ``sync``, ``state``, ``optimizer``)."""

    def __init__(self, layers: int, width: int, vocab: int, seq: int, device: torch.device) -> None:
        torch.manual_seed(0)
        heads = max(1, width // 64)
        block = torch.nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.device = device
        self.model = torch.nn.ModuleDict(
            {
                "embed": torch.nn.Embedding(vocab, width),
                "blocks": torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False),
                "head": torch.nn.Linear(width, vocab, bias=False),
            }
        ).to(device)
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **fused)
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, vocab, (BATCH, seq + 1), generator=g).to(device)
        self.mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=device)
        self.steps_done = 0

    def step(self) -> None:
        x, y = self.tokens[:, :-1], self.tokens[:, 1:]
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            h = self.model["blocks"](self.model["embed"](x), mask=self.mask, is_causal=True)
            logits = self.model["head"](h)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps_done += 1

    def sync(self) -> None:
        sync(self.device)

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.steps_done,
        }


def host_bytes(root: Path) -> tuple[int, int]:
    """This process's resident memory and the bytes of every file under ``root``."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    return rss, sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def host_memory(root: Path) -> str:
    rss, files = host_bytes(root)
    return f"RSS {rss / GIB:.2f} GiB, checkpoint files {files / GIB:.2f} GiB"


def bench_memory(
    root: Path, gib: float, saves: int, device: torch.device, stack: contextlib.ExitStack
) -> Times:
    """Host memory over ``saves`` saves, taking turns: the local tier plain, overlapped, with a
    device snapshot, and the persistent tier (a state of at most 1 GiB: a leak grows with the
    saves, not the state). RSS and the files under ``root`` after each; growth counted from the
    5th save (each kind warm by then)."""
    state = on_device(make_state(min(gib, 1.0)), device)
    sync(device)
    local = TierpointSaver(root / "mem-local", lambda: state, stack)
    local.warm_up()
    snapshot = TierpointSaver(
        root / "mem-device", lambda: state, stack, device_snapshot=True, overlap_snapshot=True
    )
    snapshot.warm_up()
    kinds = [
        local.measure,
        TierpointSaver(
            root / "mem-local", lambda: state, stack, local, overlap_snapshot=True
        ).measure,
        snapshot.measure,
        PersistentSaver(root / "mem-persistent", state, stack).measure,
    ]
    rss, files = [], []
    for k in range(saves):
        kinds[k % len(kinds)]()
        r, f = host_bytes(root)
        rss.append(r)
        files.append(f)
    base = min(4, saves - 1)
    growth = max(rss[base:]) - rss[base]
    print(
        f"\nhost memory over {saves} saves (local plain, overlapped, device snapshot, persistent"
        " in turn, "
        f"{nbytes_of(tensors_of(state)) / 1e9:.2f} GB state): RSS after save {base + 1} "
        f"{rss[base] / GIB:.2f} GiB, after save {saves} {rss[-1] / GIB:.2f} GiB, at most "
        f"{max(rss[base:]) / GIB:.2f} GiB; checkpoint files {files[base] / GIB:.2f} -> "
        f"{files[-1] / GIB:.2f} GiB"
    )
    return {
        "memory_rss": [float(r) for r in rss],
        "memory_files": [float(f) for f in files],
        "memory_growth": [float(growth)],
        "memory_state": [float(nbytes_of(tensors_of(state)))],
    }


def cadence(key: str) -> int:
    """Steps between saves of a training variant (0: no checkpoints)."""
    found = VARIANT.fullmatch(key)
    return 0 if found is None else 25 if key == "dcp25" else int(found["every"])


@contextlib.contextmanager
def worker_lanes(lanes: str | None) -> Iterator[None]:
    """``TIERPOINT_COPY_LANES`` set to ``lanes`` (None: as it is) for a worker started meanwhile."""
    before = os.environ.get(LANES_ENV)
    if lanes is not None:
        os.environ[LANES_ENV] = lanes
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LANES_ENV, None)
        else:
            os.environ[LANES_ENV] = before


def variant_label(key: str) -> str:
    if key == "none":
        return "no checkpoints"
    if key == "dcp25":
        return "torch DCP async_save (default) every 25"
    found = VARIANT.fullmatch(key)
    assert found is not None
    lanes = f", {found['lanes']} lanes" if found["lanes"] else ""
    return f"{MODES[found['mode']]} every {found['every']}{lanes}"


def bench_training(
    root: Path,
    args: argparse.Namespace,
    device: torch.device,
    stack: contextlib.ExitStack,
    times: Times,
    floor_bps: float | None = None,
) -> str:
    """The training loop's variants, interleaved, their figures into ``times`` as they come;
    ``floor_bps``: the pinned device-to-host floor (bytes a second), for the ceiling a plain
    save's blocking copy leaves. Returns the host memory before and after the loop."""
    trainer = GptTrainer(args.layers, args.width, args.vocab, args.seq, device)
    for _ in range(10):
        trainer.step()  # builds the optimizer's state, warms the kernels up
    trainer.sync()
    savers: dict[str, TierpointSaver] = {}  # by mode and worker lanes: cadences share one

    def saver_of(key: str) -> TierpointSaver:
        found = VARIANT.fullmatch(key)
        assert found is not None and found["mode"]
        mode, lanes = found["mode"], found["lanes"]
        name = mode + (f"w{lanes}" if lanes else "")
        if name not in savers:
            like = saver_of(f"{mode}25") if lanes else None  # same tier files, its own worker
            with worker_lanes(lanes):
                savers[name] = TierpointSaver(
                    root / f"train-{mode}",
                    trainer.state,
                    stack,
                    like=like,
                    device_snapshot=mode == "dv",
                    overlap_snapshot=mode in ("ov", "dv"),
                )
            if like is None:
                savers[name].warm_up()  # pinned staging and spare files: the first save
        return savers[name]

    for key in args.variants:
        if key != "dcp25":
            saver_of(key)
    for saver in savers.values():  # workers started (importing torch) before any run is timed
        saver.queue.wait_ready()
    dcp_saver = DcpTrainingSaver(root, trainer.state, None)  # torch's default options
    stack.callback(dcp_saver.finalize)
    failures: dict[str, str] = {}
    times["train_failures"] = []  # type: ignore[assignment]

    def variant(key: str) -> Callable[[], Metrics]:
        every = cadence(key)

        def run() -> Metrics:
            with GcPauses() as gc_pauses:
                metrics = measure()
            return {**metrics, f"train_{key}_gc": gc_pauses.seconds}

        def measure() -> Metrics:
            if key == "none":
                return {"train_none": train_run(trainer, args.steps, None)[0]}
            if key == "dcp25":
                seconds, blocked, drain = train_run(trainer, args.steps, dcp_saver, every)
                return {
                    "train_dcp25": seconds,
                    "train_dcp25_blocked": blocked,
                    "train_dcp25_drain": drain,
                }
            saver = saver_of(key)
            scheduling = saver.scheduling
            with snapshot_hook(key, saver, trainer) as hook:
                seconds, blocked, drain = train_run(trainer, args.steps, saver, every)
            return {
                f"train_{key}": seconds,
                f"train_{key}_blocked": blocked + hook.waited,
                f"train_{key}_scheduling": saver.scheduling - scheduling,
                f"train_{key}_drain": drain,
            }

        return guarded(f"train_{key}", run, failures)

    def segments(key: str) -> Metrics:
        saver = dcp_saver if key == "dcp25" else saver_of(key)
        with snapshot_hook(key, saver, trainer):
            plain, saving = train_segments(trainer, saver, cadence(key), args.pairs)
        return {f"pair_{key}_plain": plain, f"pair_{key}_saving": saving}  # type: ignore[dict-item]

    keys = ["none", *args.variants]
    memory_before = host_memory(root)
    try:
        interleaved([variant(k) for k in keys], args.train_reps, times)
        memory = f"host memory before the loop: {memory_before}; after: {host_memory(root)}"
        print_training(times, trainer, args, failures, floor_bps)
        if args.pairs:
            for key in args.variants:
                times.update(guarded(f"pair_{key}", lambda k=key: segments(k), failures)())
            print_pairs(times, args, failures)
        for key in args.profile:
            profile_training(key, variant(key))
    finally:
        times["train_failures"] = [f"{k}: {v}" for k, v in failures.items()]  # type: ignore
    return memory


class GcPauses:
    """Seconds Python's garbage collector ran (every thread stops meanwhile) while in the block:
    a save that leaves many objects behind makes full collections of the training process's
    whole heap come sooner."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._callback)


class _NoHook:
    waited = 0.0


@contextlib.contextmanager
def snapshot_hook(
    key: str, saver: TierpointSaver | DcpTrainingSaver, trainer: GptTrainer
) -> Iterator[OverlapHook | _NoHook]:
    """The optimizer hook an overlapped variant (ov, dv) installs, while the block runs."""
    if not key.startswith(("ov", "dv")):
        yield _NoHook()
        return
    assert isinstance(saver, TierpointSaver)
    hook = OverlapHook(saver, trainer.optimizer)
    try:
        yield hook
    finally:
        hook.handle.remove()


def train_segments(
    trainer: GptTrainer, saver: TierpointSaver | DcpTrainingSaver, every: int, pairs: int
) -> tuple[list[float], list[float]]:
    """``pairs`` pairs of ``every``-step segments, each pair one without a save and then one that
    starts with a save and ends once that save is durable (so its whole cost falls inside it, none
    into the next segment): (seconds of the plain segments, seconds of the saving ones). Adjacent
    segments last a second or two, so the machine's drift, which makes whole runs differ by 10-20%,
    hardly differs within a pair."""
    plain: list[float] = []
    saving: list[float] = []
    for k in range(2 * pairs):
        with_save = k % 2 == 1
        trainer.sync()
        start = time.perf_counter()
        if with_save:
            saver.save()
        for _ in range(every):
            trainer.step()
            if isinstance(saver, TierpointSaver):
                saver.queue.maybe_finalize_async_calls(blocking=False)
        if with_save:
            saver.finalize()
        trainer.sync()
        (saving if with_save else plain).append(time.perf_counter() - start)
    return plain, saving


def profile_training(key: str, run: Callable[[], Metrics]) -> None:
    """One more run of variant ``key`` under cProfile: where its time goes. Python 3.12's profiler
    sees every thread of the process (the snapshot's too; times are wall times, GIL waits
    included); earlier ones the training thread only."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    print(f"\nprofile of one run of {variant_label(key)} (cumulative):")
    stats = pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative")
    stats.print_stats(15)
    stats.print_stats("tierpoint|async_bench|acquire|synchronize|wait", 45)


# ------------------------------------------------------------------------------------ reporting


def print_saves(times: Times, nbytes: int, count: int, reps: int, failures: dict[str, str]) -> None:
    print(
        f"\nasync save of {nbytes / 1e9:.2f} GB in {count} tensors from the GPU,"
        f" {reps} interleaved repetitions (medians; ratios: median of per-repetition ratios)"
    )
    print(f"{'contender':56s} {'seconds':>8s} {'GB/s':>7s} {'/floor':>7s}")
    rows = [
        ("floor: D2H into pinned memory", "floor_pinned"),
        ("floor: D2H into pageable memory", "floor_pageable"),
        ("local tier async: blocking (save + schedule)", "tp_block"),
        ("  snapshot copied", "tp_copied"),
        ("  time to durable", "tp_durable"),
        ("  first save after warm_up: blocking", "tp_first_block"),
        ("  first save without warm_up: blocking", "tp_cold_block"),
        ("local tier, overlap_snapshot: blocking", "tp_ov_block"),
        ("  snapshot copied (wait_for_snapshot returns)", "tp_ov_copied"),
        ("  time to durable", "tp_ov_durable"),
        ("local tier, device_snapshot (overlapped): blocking", "tp_dv_block"),
        ("  time to durable", "tp_dv_durable"),
        ("persistent tier (tierpoint.dcp.async_save): blocking", "pt_block"),
        ("  time to durable", "pt_durable"),
        ("  first save after warm_up: blocking", "pt_first_block"),
        ("torch DCP async_save (default staging): blocking", "dcp_default_block"),
        ("  time to durable", "dcp_default_durable"),
        ("torch DCP async_save (reused pinned stager): blocking", "dcp_stager_block"),
        ("  time to durable", "dcp_stager_durable"),
    ]
    for label, key in rows:
        if not times.get(key):
            continue
        seconds = median(times[key])
        both = len(times[key]) == len(times.get("floor_pinned", ()))
        ratio = f"{paired(times, key, 'floor_pinned'):6.2f}x" if both else ""
        print(f"{label:56s} {seconds:8.3f} {nbytes / seconds / 1e9:7.2f} {ratio:>7s}")
    for name, why in failures.items():
        print(f"{name}: failed ({why})")


def print_training(
    times: Times,
    trainer: GptTrainer,
    args: argparse.Namespace,
    failures: dict[str, str],
    floor_bps: float | None,
) -> None:
    params = sum(p.numel() for p in trainer.model.parameters())
    state = nbytes_of(tensors_of(trainer.state()))
    print(
        f"\ntraining loop: GPT {args.layers} x {args.width} ({params / 1e6:.0f}M parameters,"
        f" state {state / 1e9:.2f} GB), seq {args.seq}, batch {BATCH}, bf16 autocast, fused AdamW;"
        f" {args.steps} steps a run, {args.train_reps} interleaved repetitions (medians)"
    )
    head = f"{'variant':50s} {'ms/step':>8s} {'vs none':>8s} {'range':>11s} {'ms/save':>8s}"
    print(f"{head} {'sched':>8s} {'drain s':>8s} {'ceiling':>8s} {'GC ms':>7s}")
    for key in ["none", *args.variants]:
        label, every = variant_label(key), cadence(key)
        if not times.get(f"train_{key}"):
            print(f"{label:50s} failed ({failures.get(f'train_{key}', '?')})")
            continue
        step_ms = median(times[f"train_{key}"]) / args.steps * 1e3
        none_runs = times.get("train_none") or []  # none where that run failed
        ratios = [a / b for a, b in zip(none_runs, times[f"train_{key}"])]
        vs_none = f"{median(ratios):7.3f}x" if ratios else ""
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if key != "none" and ratios else ""
        saves = (args.steps - 1) // every if every else 0
        blocked = times.get(f"train_{key}_blocked")
        save_ms = f"{median(blocked) / saves * 1e3:8.1f}" if blocked and saves else ""
        scheduling = times.get(f"train_{key}_scheduling")
        sched_ms = f"{median(scheduling) / saves * 1e3:8.1f}" if scheduling and saves else ""
        drain = times.get(f"train_{key}_drain")
        drain_s = f"{median(drain):8.2f}" if drain else ""
        ceiling = ""
        if key.startswith("tp") and floor_bps and times.get("train_none"):
            none = median(times["train_none"])
            ceiling = f"{none / (none + saves * state / floor_bps):7.3f}x"
        gc_ms = f"{median(g) * 1e3:7.0f}" if (g := times.get(f"train_{key}_gc")) else ""
        line = f"{label:50s} {step_ms:8.1f} {vs_none:>8s} {spread:>11s} {save_ms:>8s}"
        print(f"{line} {sched_ms:>8s} {drain_s:>8s} {ceiling:>8s} {gc_ms:>7s}")
    print(
        "(ms/step until the last step's work is done; 'range': the lowest and highest ratio of"
        " one repetition to the run without checkpoints next to it; 'ms/save': the training"
        " thread's wait per"
        " save (save, schedule, optimizer hook); 'sched': the part in schedule_async_request\n"
        " (the previous save finishing); 'drain': the last save's finishing after it, paid once"
        " a job; 'ceiling': the throughput a save blocking for the pinned\n device-to-host floor"
        " alone would leave; 'GC ms': Python's garbage collector's pauses in a run)"
    )
    if none := times.get("train_none"):
        print(
            f"runs without checkpoints took {min(none):.2f}-{max(none):.2f} s"
            f" (a {max(none) / min(none) - 1:.0%} spread between repetitions)"
        )


def print_pairs(times: Times, args: argparse.Namespace, failures: dict[str, str]) -> None:
    print(
        f"\npaired segments: {args.pairs} pairs of segments of as many steps as the variant saves"
        " every, one without a save, then one with a save that ends when the save is durable"
    )
    print(f"{'variant':50s} {'ms/step':>8s} {'saving':>8s} {'vs none':>8s} {'quartiles':>11s}")
    for key in args.variants:
        label, every = variant_label(key), cadence(key)
        plain, saving = times.get(f"pair_{key}_plain"), times.get(f"pair_{key}_saving")
        if not plain or not saving:
            print(f"{label:50s} failed ({failures.get(f'pair_{key}', '?')})")
            continue
        ratios = sorted(a / b for a, b in zip(plain, saving))
        quartiles = f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}"
        ms_plain, ms_saving = (median(v) / every * 1e3 for v in (plain, saving))
        ratio = median(ratios)
        print(f"{label:50s} {ms_plain:8.1f} {ms_saving:8.1f} {ratio:7.3f}x {quartiles:>11s}")


def print_checks(times: Times) -> None:
    checks = [
        ("local async blocking <= 1.2x pinned floor", "tp_block", "floor_pinned", 1.2, False),
        ("persistent async blocking <= 1.2x pinned floor", "pt_block", "floor_pinned", 1.2, False),
        ("overlapped copy done <= 1.5x pinned floor", "tp_ov_copied", "floor_pinned", 1.5, False),
    ]
    for mode, name in (("tp", "tierpoint"), ("ov", "overlapped"), ("dv", "device snapshot")):
        for every, target in ((25, 0.95), (10, 0.9)):
            key = f"{mode}{every}"
            label = f"training, {name} every {every} >= {target}x none"
            checks.append((label, "train_none", f"train_{key}", target, True))
            checks.append(
                (f"{label}, pairs", f"pair_{key}_plain", f"pair_{key}_saving", target, True)
            )
    print()
    for label, num, den, target, at_least in checks:
        if not times.get(num) or not times.get(den) or len(times[num]) != len(times[den]):
            if not num.startswith("pair_"):  # pairs are measured for the variants run only
                print(f"{label:58s}   n/a")
            continue
        ratio = paired(times, num, den)
        ok = ratio >= target if at_least else ratio <= target
        print(f"{label:58s} {ratio:5.3f}x {'PASS' if ok else 'MISS'}")
    if times.get("memory_growth"):
        growth, state = times["memory_growth"][0], times["memory_state"][0]
        allowed = max(64 << 20, 0.02 * state)  # allocator noise, not a buffer per save
        saves = len(times["memory_rss"])
        print(
            f"{f'host memory flat over {saves} saves (RSS growth)':58s} {growth / 2**20:5.0f} MiB "
            f"{'PASS' if growth <= allowed else 'MISS'}"
        )
    for label, first, steady in (
        ("first local save (after warm_up) <= 2x a steady one", "tp_first_block", "tp_block"),
        ("first persistent save (after warm_up) <= 2x a steady", "pt_first_block", "pt_block"),
    ):
        if times.get(first) and times.get(steady):
            ratio = times[first][0] / median(times[steady])
            print(f"{label:58s} {ratio:5.3f}x {'PASS' if ratio <= 2 else 'MISS'}")


# ------------------------------------------------------------------------------------ main


def bench_saves(
    root: Path,
    gib: float,
    reps: int,
    device: torch.device,
    stack: contextlib.ExitStack,
    times: Times,
    failures: dict[str, str],
) -> None:
    """The save contenders, interleaved; their figures go into ``times`` as each is measured (a
    run stopped midway keeps them), contenders that failed into ``failures``."""
    state = on_device(make_state(gib), device)
    tensors = tensors_of(state)
    sync(device)
    with contextlib.ExitStack() as cold_stack:  # a first save without warm_up, for comparison
        first_cold = TierpointSaver(root / "cold", lambda: state, cold_stack).measure()
    shutil.rmtree(root / "cold", ignore_errors=True)
    local = TierpointSaver(root / "tier", lambda: state, stack)
    local.warm_up()  # as a job would, steps before its first save
    first_local = local.measure()
    local.measure()
    overlapped = TierpointSaver(root / "tier", lambda: state, stack, local, overlap_snapshot=True)
    overlapped.measure()
    device_copy = TierpointSaver(
        root / "tier-dev", lambda: state, stack, device_snapshot=True, overlap_snapshot=True
    )
    device_copy.warm_up()
    device_copy.measure()
    persistent = PersistentSaver(root / "persistent", state, stack)
    persistent.warm_up()
    first_persistent = persistent.measure()
    stager, stager_note = reusable_stager()
    if stager is not None:
        stack.callback(stager.close)
    contenders = [
        guarded(
            "floor_pinned", d2h_floor(tensors, device.type == "cuda", "floor_pinned"), failures
        ),
        guarded("floor_pageable", d2h_floor(tensors, False, "floor_pageable"), failures),
        guarded("local", local.measure, failures),
        guarded("local overlapped", overlapped.measure, failures),
        guarded("local device snapshot", device_copy.measure, failures),
        guarded("persistent", persistent.measure, failures),
        guarded("dcp default", dcp_contender(root, state, "dcp_default", None), failures),
        *(
            [guarded("dcp stager", dcp_contender(root, state, "dcp_stager", stager), failures)]
            if stager is not None
            else []
        ),
    ]
    if stager is None:
        failures["dcp stager"] = stager_note
    run_interleaved(contenders, 1)  # warm-up: DCP's first save allocates its staging
    times["state_bytes"] = [float(nbytes_of(tensors))]
    interleaved(contenders, reps, times)
    times["tp_first_block"] = [first_local["tp_block"]]
    times["tp_cold_block"] = [first_cold["tp_block"]]
    times["pt_first_block"] = [first_persistent["pt_block"]]
    print_saves(times, nbytes_of(tensors), len(tensors), reps, failures)


def interleaved(contenders: Sequence[Callable[[], Metrics]], reps: int, times: Times) -> None:
    """``run_interleaved`` appending into ``times`` as each figure comes (none lost to a stop)."""
    for _ in range(reps):
        for run in contenders:
            for key, value in run().items():
                times.setdefault(key, []).append(value)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--gib", type=float, default=None, help="state size (default: from the GPU)")
    p.add_argument("--reps", type=int, default=5, help="interleaved save repetitions")
    p.add_argument("--steps", type=int, default=100, help="training steps a run")
    p.add_argument("--train-reps", type=int, default=3, help="interleaved training repetitions")
    p.add_argument("--layers", type=int, default=None, help="GPT layers (default: from the GPU)")
    p.add_argument("--width", type=int, default=1024, help="GPT width")
    p.add_argument("--seq", type=int, default=512, help="GPT sequence length")
    p.add_argument("--vocab", type=int, default=32768, help="GPT vocabulary")
    p.add_argument(
        "--pairs",
        type=int,
        default=8,
        help="paired segments (without and with a save) per training variant; 0: none",
    )
    p.add_argument("--memory-saves", type=int, default=50, help="saves of the memory check")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"what to measure, a comma-separated subset of {','.join(PARTS)}",
    )
    p.add_argument(
        "--variants",
        default=",".join(TRAIN_VARIANTS),
        help="training variants besides no checkpoints, e.g. tp25,ov10,dv10w2 (w: worker lanes)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="training variants to run once more under cProfile, e.g. dv10",
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args(argv)
    args.parts, args.variants = args.parts.split(","), args.variants.split(",")
    args.profile = [k for k in args.profile.split(",") if k]
    if unknown := set(args.profile) - set(args.variants):
        p.error(f"--profile names variants not measured: {', '.join(sorted(unknown))}")
    if unknown := set(args.parts) - set(PARTS):
        p.error(f"unknown parts: {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    if unknown := {v for v in args.variants if not VARIANT.fullmatch(v)}:
        p.error(
            f"unknown variants: {', '.join(sorted(unknown))} (tp|ov|dv, steps between saves, "
            "optionally w<worker lanes>: e.g. dv10w2; or dcp25)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "gpu_bench: no CUDA device here (torch.cuda.is_available() is False); run it on a "
            "machine with a GPU (see benchmarks/gpu_device_run.sh), or --device cpu to check it"
        )
    if args.device == "cpu":  # a check of the script: tiny everything
        args.layers, args.width, args.steps = args.layers or 1, 64, min(args.steps, 30)
        args.seq, args.vocab = 32, 256
    elif args.layers is None:  # ~16 bytes a parameter with AdamW: about 1/4 of the GPU
        gpu = torch.cuda.get_device_properties(0).total_memory
        per_layer = 12 * args.width**2 * 16 * 4  # with activations, generously
        args.layers = max(2, min(24, int(gpu / 4 / per_layer)))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    gib = state_size(args, device)
    require_memory(int(HOST_COPIES * gib * GIB), "use a smaller --gib")
    # SIGTERM unwinds like Ctrl-C: queues close, the figures so far are written, the directory goes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print(device_line(device))
    start = cpu_sample()
    root = pick_root(int(6 * gib * GIB))
    print(f"checkpoints under {root}")
    times: Times = {}
    failures: dict[str, str] = {}  # contenders of the saves that failed
    broken: dict[str, str] = {}  # parts that failed: the others still run
    memory = ""
    stopped = "stopped before the end"
    try:
        if "saves" in args.parts:
            with part("saves", root, device, broken) as where, contextlib.ExitStack() as stack:
                bench_saves(where, gib, args.reps, device, stack, times, failures)
        if "memory" in args.parts:
            with part("memory", root, device, broken) as where, contextlib.ExitStack() as stack:
                times.update(bench_memory(where, gib, args.memory_saves, device, stack))
        if "training" in args.parts:
            floor_bps = None
            if times.get("floor_pinned") and times.get("state_bytes"):
                floor_bps = times["state_bytes"][0] / median(times["floor_pinned"])
            with part("training", root, device, broken) as where, contextlib.ExitStack() as stack:
                memory = bench_training(where, args, device, stack, times, floor_bps)
            print(memory)
        print_checks(times)
        print(f"\n{machine_line(start)}")
        stopped = ""
    finally:
        if args.json is not None:
            out = {"device": device_line(device), "failures": failures, "memory": memory}
            out |= {"failed_parts": broken, "incomplete": stopped, **times}
            args.json.write_text(json.dumps(out, indent=1))
        shutil.rmtree(root, ignore_errors=True)
    if broken:
        raise SystemExit(f"gpu_bench: failed: {', '.join(broken)} (tracebacks above)")


@contextlib.contextmanager
def part(name: str, root: Path, device: torch.device, broken: dict[str, str]) -> Iterator[Path]:
    """One part of the run in its own directory under ``root``, removed after it; an exception
    there is printed and kept in ``broken``, and the next part runs (a failure in one hides none
    of the others)."""
    where = root / name
    where.mkdir()
    try:
        yield where
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on
        traceback.print_exc()
        print(f"\n{name}: failed ({type(e).__name__}: {e})"[:400], flush=True)
        broken[name] = f"{type(e).__name__}: {e}"[:300]
    finally:
        shutil.rmtree(where, ignore_errors=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
