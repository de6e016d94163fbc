"""Async saving: what a tierpoint async save costs the training thread, against the floor and DCP.

Single process, CPU only, everything on the /dev/shm tmpfs. Measured on a ~``--gib`` GiB state shaped
like a transformer with Adam state (~300 tensors: fp32 weights, ``exp_avg``, ``exp_avg_sq``, bf16
norm weights, int64 step counters, small tensors, a plain int):

- memcpy floor: ``dst.copy_(src)`` of every tensor into tensors allocated and touched beforehand;
  and, as a diagnostic, the same into one preallocated buffer at the offsets tierpoint's part file
  (hence its staging buffer) uses, which tells what the staging layout alone costs;
- tierpoint blocking time: ``manager.save(BasicTensorAwareStateDict(state), it, is_async=True)``
  plus ``queue.schedule_async_request(request)`` (flatten, plan, snapshot into the reused staging
  memory: all the training thread pays), split into its two calls; and the time to durable (from the
  start of ``save`` until ``maybe_finalize_async_calls(blocking=True)`` returns); the first save
  after ``warm_up`` and, in a tier of its own, without it. Steady state: two
  untimed warm-up saves first, and the previous save is finalized before each timed one (the tier is
  on tmpfs, so the snapshot goes straight into the recycled part file's pages);
- the same with ``AsyncCallsQueue(overlap_snapshot=True)`` (same manager and files): what ``save`` +
  ``schedule`` block for (the copy runs on a thread), when ``wait_for_snapshot`` returns (the copy
  is done: nothing training does before then may modify the state; in a training loop the
  optimizer hook waits here, usually not at all), and the time to durable;
- ``torch.distributed.checkpoint.async_save`` (``no_dist=True``, thread executor): blocking time and
  time to durable (until its future's result), with the default staging (a fresh copy per save)
  and, where this torch has it, a ``DefaultStager`` kept across saves (cached staging memory; pinned
  only with CUDA); one untimed warm-up save each;
- ``torch.save`` (sync) into a new file.

Then a training loop (an MLP with fused Adam, ``torch.set_num_threads(2)``, its model + optimizer
state ~``--train-mib`` MiB, default 100 x ``--gib``, batches of ``--train-batch`` rows, default 128,
so that a step does the arithmetic a real training step does rather than only the optimizer's memory
pass; ``--train-batch 8`` is that optimizer-bound stress case) runs ``--train-steps`` steps,
``--train-reps`` times (default 2 x ``--reps``, as short runs drift less apart), (a) without
checkpoints, (b) with a tierpoint async save every 5 steps and
``maybe_finalize_async_calls(blocking=False)`` every step, (c) the same with
``AsyncCallsQueue(overlap_snapshot=True)`` and an optimizer pre-step hook that waits for the
snapshot, so that the copy overlaps forward/backward, (d) torch DCP ``async_save`` with a reused
``DefaultStager`` every 5 steps (waiting for the previous save's future first, as DCP requires). A
run's time includes its final blocking finalize. "ms/save" is everything the training thread spent
waiting for checkpointing per save: the save calls, and for (c) the hook's waits, for (d) the wait
for the previous future.

Contenders run interleaved (A B C A B C ...) because this machine's speed drifts; tables give
medians over ``--reps`` repetitions, and the checks use the median of per-repetition ratios
(neighbours in time, so drift cancels). GB/s is 10**9 bytes of tensor payload per second. The last
line tells how much CPU other processes took meanwhile, the usual cause of noise.

Run: ``./run bench async [--gib 2 --reps 5]`` or ``.venv/bin/python benchmarks/async_bench.py``;
``--gib 0.2 --reps 3`` is a quick run (about half a minute, mostly worker start-up and the training
loop). Everything written lives in one fresh directory under /dev/shm, removed at the end (also on
Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import itertools
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from floor import nbytes_of, tensors_of
from machine import CpuSample, cpu_sample, machine_line, require_memory

from tierpoint import fileformat
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tierpoint.tree import flatten

GIB = 2**30
LAYERS = 16
VOCAB = 8192
WARMUP_SAVES = 2
CKPT_EVERY = 5
TRAIN_DEPTH = 4
DEFAULT_TRAIN_BATCH = 128

Times = dict[str, list[float]]
Metrics = dict[str, float]

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# ------------------------------------------------------------------------------------ the state


def hidden_size_for(gib: float) -> int:
    """Hidden size (a multiple of 64) giving ~``gib`` GiB: per layer 12 h^2 fp32 weights x 3 (Adam)."""
    target = gib * GIB
    a, b = LAYERS * 12 * 4 * 3, VOCAB * 4 * 3  # bytes per h^2 and per h
    h = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    return max(64, round(h / 64) * 64)


def _adam(weight: torch.Tensor, step: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "step": torch.tensor(step, dtype=torch.int64),
        "exp_avg": torch.randn(weight.shape, generator=g) * 1e-3,
        "exp_avg_sq": torch.rand(weight.shape, generator=g) * 1e-6,
    }


def make_state(gib: float, seed: int = 0) -> dict[str, Any]:
    """Transformer-like model and Adam state: ~19 tensors per layer, ~300 in all."""
    g = torch.Generator().manual_seed(seed)
    h = hidden_size_for(gib)
    model: dict[str, torch.Tensor] = {"embed.weight": torch.randn(VOCAB, h, generator=g)}
    optim: dict[str, dict[str, torch.Tensor]] = {"embed.weight": _adam(model["embed.weight"], 7, g)}
    shapes = {
        "attn.qkv": (3 * h, h),
        "attn.proj": (h, h),
        "mlp.fc1": (4 * h, h),
        "mlp.fc2": (h, 4 * h),
    }
    for i in range(LAYERS):
        for name, shape in shapes.items():
            key = f"layers.{i}.{name}.weight"
            model[key] = torch.randn(shape, generator=g)
            optim[key] = _adam(model[key], 7, g)
        model[f"layers.{i}.attn.qkv.bias"] = torch.zeros(3 * h)
        model[f"layers.{i}.ln1.weight"] = torch.ones(h, dtype=torch.bfloat16)
        model[f"layers.{i}.ln2.weight"] = torch.ones(h, dtype=torch.bfloat16)
    model["final_ln.weight"] = torch.ones(h, dtype=torch.bfloat16)
    model["position_ids"] = torch.arange(4096, dtype=torch.int64)
    return {"model": model, "optimizer": optim, "iteration": 0}


# ------------------------------------------------------------------------------------ contenders


class TierpointSaver:
    """One LocalCheckpointManager and its AsyncCallsQueue, saving ``state_fn()`` at rising iterations."""

    def __init__(
        self,
        root: Path,
        state_fn: Callable[[], Any],
        stack: contextlib.ExitStack,
        like: TierpointSaver | None = None,
        device_snapshot: bool = False,
        **queue_kw: Any,
    ) -> None:
        """``like``: share its manager (tier files, iterations) with a queue of other options."""
        self.manager = (
            like.manager
            if like
            else LocalCheckpointManager(root, session_id="bench", device_snapshot=device_snapshot)
        )
        self.iterations = like.iterations if like else itertools.count(1)
        self.queue = stack.enter_context(AsyncCallsQueue(**queue_kw))
        self.state_fn = state_fn
        self.scheduling = 0.0  # seconds in schedule_async_request, all saves together
        overlap = queue_kw.get("overlap_snapshot")
        self.key = "tp_dv" if device_snapshot else "tp_ov" if overlap else "tp"

    def warm_up(self) -> None:
        """Prepare the first save ahead (staging memory, spare files) and wait until it is done."""
        self.manager.warm_up(BasicTensorAwareStateDict(self.state_fn()), wait=True)

    def save(self) -> tuple[float, float]:
        """Save and schedule one checkpoint: (seconds in ``save``, seconds in ``schedule``)."""
        start = time.perf_counter()
        request = self.manager.save(
            BasicTensorAwareStateDict(self.state_fn()), next(self.iterations), is_async=True
        )
        planned = time.perf_counter()
        self.queue.schedule_async_request(request)
        scheduled = time.perf_counter() - planned
        self.scheduling += scheduled
        return planned - start, scheduled

    def finalize(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)

    def measure(self) -> Metrics:
        self.finalize()  # the previous save is durable before the clock starts
        start = time.perf_counter()
        plan, snapshot = self.save()
        self.queue.wait_for_snapshot()  # at once unless the snapshot is overlapped
        copied = time.perf_counter() - start
        self.finalize()
        durable = time.perf_counter() - start
        k = self.key
        return {
            f"{k}_block": plan + snapshot,
            f"{k}_plan": plan,
            f"{k}_snapshot": snapshot,
            f"{k}_copied": copied,
            f"{k}_durable": durable,
        }


def memcpy_floor(tensors: Sequence[torch.Tensor]) -> Callable[[], Metrics]:
    targets = [torch.empty_like(t) for t in tensors]
    for t in targets:
        t.zero_()  # fault the pages in once: the floor copies into memory that exists

    def run() -> Metrics:
        start = time.perf_counter()
        for dst, src in zip(targets, tensors):
            dst.copy_(src)
        return {"floor": time.perf_counter() - start}

    return run


def part_layout_floor(state: Any) -> tuple[Callable[[], Metrics], str]:
    """Diagnostic: ``copy_`` into one preallocated buffer at the offsets of tierpoint's part file
    (the staging layout), and a note on how many bytes land off a 64-byte boundary there."""
    flat = flatten(state)
    plan = fileformat.plan_part(flat)
    buffer = torch.zeros(plan.data_size, dtype=torch.uint8)  # 64-byte aligned, pages touched
    targets = [
        buffer[begin:end].view(t.dtype).view(t.shape)
        for (begin, end), t in zip(plan.offsets, flat.tensors)
    ]
    off = [(b, e) for b, e in plan.offsets if b % 64]
    note = (
        f"{len(off)} of {len(targets)} tensors, {sum(e - b for b, e in off) / plan.data_size:.0%}"
        " of the bytes, start off a 64-byte boundary in the part-file layout"
    )

    def run() -> Metrics:
        start = time.perf_counter()
        for dst, src in zip(targets, flat.tensors):
            dst.copy_(src)
        return {"layout_floor": time.perf_counter() - start}

    return run, note


def reusable_stager() -> tuple[Any, str]:
    """A DCP DefaultStager to keep across saves (None where this torch lacks one), and a note."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None, "reused stager: unavailable (this torch has no DefaultStager)"
    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return None, "reused stager: unavailable (this torch's async_save takes no async_stager)"
    cuda = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=False,
        use_async_staging=False,  # stage in the call, as tierpoint does by default
        use_non_blocking_copy=cuda,
    )
    pinned = "pinned" if cuda else "cached, not pinned (no CUDA)"
    note = f"reused stager: DefaultStager kept across saves, {pinned}, staging in the call"
    return DefaultStager(options), note


def dcp_contender(root: Path, state: Any, key: str, stager: Any) -> Callable[[], Metrics]:
    counter = itertools.count()

    def run() -> Metrics:
        path = root / f"dcp-{key}-{next(counter)}"
        start = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=path, no_dist=True, async_stager=stager)
        returned = time.perf_counter()
        getattr(response, "upload_completion", response).result()
        durable = time.perf_counter() - start
        shutil.rmtree(path)
        return {f"{key}_block": returned - start, f"{key}_durable": durable}

    return run


def torch_save_contender(root: Path, state: Any) -> Callable[[], Metrics]:
    path = root / "torch.pt"

    def run() -> Metrics:
        start = time.perf_counter()
        torch.save(state, path)
        seconds = time.perf_counter() - start
        path.unlink()  # the next run writes a new file; meanwhile the memory is free
        return {"torch_save": seconds}

    return run


def run_interleaved(contenders: Sequence[Callable[[], Metrics]], reps: int) -> Times:
    times: Times = defaultdict(list)
    for _ in range(reps):
        for run in contenders:
            for key, value in run().items():
                times[key].append(value)
    return times


# ------------------------------------------------------------------------------------ training


@dataclass
class Trainer:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    fused: bool
    steps_done: int = 0

    def step(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.optimizer.step()
        self.steps_done += 1

    def sync(self) -> None:
        """Wait for the work queued by the steps (nothing is queued on the CPU)."""

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.steps_done,
        }


def make_trainer(state_mib: float, batch: int) -> Trainer:
    """An MLP whose weights + Adam moments take ~``state_mib`` MiB (12 bytes a parameter)."""
    torch.manual_seed(0)
    params = state_mib * 2**20 / 12
    width = max(128, round(math.sqrt(params / TRAIN_DEPTH) / 128) * 128)
    layers: list[torch.nn.Module] = []
    for _ in range(TRAIN_DEPTH):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    try:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5, fused=True)
        fused = True
    except (RuntimeError, TypeError):  # no fused CPU Adam in this torch
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
        fused = False
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return Trainer(model, optimizer, x, y, fused)


class OverlapHook:
    """Optimizer pre-step hook that waits for pending snapshots and counts the time it waited."""

    def __init__(self, saver: TierpointSaver, optimizer: torch.optim.Optimizer) -> None:
        self.waited = 0.0
        self.queue = saver.queue
        self.handle = optimizer.register_step_pre_hook(lambda *_: self.wait())

    def wait(self) -> None:
        start = time.perf_counter()
        self.queue.wait_for_snapshot()
        self.waited += time.perf_counter() - start


class DcpTrainingSaver:
    """torch DCP ``async_save`` with a reused stager, one save in flight (the previous awaited)."""

    def __init__(self, root: Path, state_fn: Callable[[], Any], stager: Any) -> None:
        self.root, self.state_fn, self.stager = root, state_fn, stager
        self.pending: Any = None
        self.counter = itertools.count()

    def finalize(self) -> None:
        if self.pending is not None:
            future, path = self.pending
            getattr(future, "upload_completion", future).result()
            self.pending = None
            shutil.rmtree(path, ignore_errors=True)

    def save(self) -> float:
        start = time.perf_counter()
        self.finalize()
        path = self.root / f"dcp-train-{next(self.counter)}"
        future = dcp.async_save(
            self.state_fn(), checkpoint_id=path, no_dist=True, async_stager=self.stager
        )
        self.pending = (future, path)
        return time.perf_counter() - start


def train_run(
    trainer: Trainer,
    steps: int,
    saver: TierpointSaver | DcpTrainingSaver | None,
    every: int = CKPT_EVERY,
) -> tuple[float, float, float]:
    """``steps`` training steps, checkpointing every ``every``: (seconds until the last step's work
    is done, seconds in save calls, seconds the last save then took to finish). The first is the
    job's steady throughput: the last save's drain is paid once a job, not once every few steps.
    ``trainer``: anything with ``step()`` and ``sync()`` (waits for the work ``step`` queued)."""
    blocked = 0.0
    start = time.perf_counter()
    for i in range(1, steps + 1):
        trainer.step()
        if saver is None:
            continue
        if isinstance(saver, TierpointSaver):
            saver.queue.maybe_finalize_async_calls(blocking=False)
        if i % every == 0 and i < steps:
            if isinstance(saver, TierpointSaver):
                blocked += sum(saver.save())
            else:
                blocked += saver.save()
    trainer.sync()
    seconds = time.perf_counter() - start
    if saver is not None:
        saver.finalize()
    return seconds, blocked, time.perf_counter() - start - seconds


def training_contenders(
    trainer: Trainer,
    steps: int,
    plain: TierpointSaver,
    overlap: TierpointSaver,
    dcp_saver: DcpTrainingSaver | None,
) -> list[Callable[[], Metrics]]:
    def no_ckpt() -> Metrics:
        return {"train_a": train_run(trainer, steps, None)[0]}

    def with_ckpt() -> Metrics:
        seconds, blocked, _ = train_run(trainer, steps, plain)
        return {"train_b": seconds, "train_b_blocked": blocked}

    def overlapped() -> Metrics:
        hook = OverlapHook(overlap, trainer.optimizer)
        try:
            seconds, blocked, _ = train_run(trainer, steps, overlap)
        finally:
            hook.handle.remove()
        return {"train_c": seconds, "train_c_blocked": blocked + hook.waited}

    def with_dcp() -> Metrics:
        assert dcp_saver is not None
        seconds, blocked, _ = train_run(trainer, steps, dcp_saver)
        return {"train_d": seconds, "train_d_blocked": blocked}

    return [no_ckpt, with_ckpt, overlapped, *([with_dcp] if dcp_saver is not None else [])]


# ------------------------------------------------------------------------------------ reporting


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def paired(times: Times, num: str, den: str) -> float:
    """Median over repetitions of ``num / den`` (each pair ran next to each other)."""
    return median([a / b for a, b in zip(times[num], times[den])])


def print_save_table(
    times: Times, nbytes: int, count: int, reps: int, notes: Sequence[str]
) -> None:
    print(
        f"\nasync save of {nbytes / GIB:.2f} GiB in {count} tensors, {reps} interleaved repetitions"
        f" (medians; tierpoint after {WARMUP_SAVES} warm-up saves)"
    )
    print(f"{'contender':52s} {'seconds':>8s} {'GB/s':>7s}")
    rows = [
        ("memcpy floor (copy_ into preallocated tensors)", "floor"),
        ("  diagnostic: copy_ into one buffer, part-file layout", "layout_floor"),
        ("tierpoint async: blocking (save + schedule)", "tp_block"),
        ("  of which manager.save (flatten, agree, plan)", "tp_plan"),
        ("  of which schedule (snapshot into staging)", "tp_snapshot"),
        ("tierpoint async: time to durable", "tp_durable"),
        ("tierpoint async, overlap_snapshot: blocking", "tp_ov_block"),
        ("  snapshot copied (wait_for_snapshot returns)", "tp_ov_copied"),
        ("  time to durable", "tp_ov_durable"),
        ("tierpoint async: first save after warm_up, blocking", "tp_first_block"),
        ("tierpoint async: first save after warm_up, durable", "tp_first_durable"),
        ("tierpoint async: first save without warm_up, blocking", "tp_cold_block"),
        ("tierpoint async: first save without warm_up, durable", "tp_cold_durable"),
        ("DCP async_save (default staging): blocking", "dcp_default_block"),
        ("DCP async_save (default staging): time to durable", "dcp_default_durable"),
        ("DCP async_save (reused stager): blocking", "dcp_stager_block"),
        ("DCP async_save (reused stager): time to durable", "dcp_stager_durable"),
        ("torch.save (sync, new file)", "torch_save"),
    ]
    for label, key in rows:
        if times.get(key):
            seconds = median(times[key])
            print(f"{label:52s} {seconds:8.3f} {nbytes / seconds / 1e9:7.2f}")
    for note in notes:
        print(note)


def print_train_table(
    times: Times, trainer: Trainer, state_bytes: int, steps: int, reps: int
) -> None:
    saves = (steps - 1) // CKPT_EVERY
    print(
        f"\ntraining loop: MLP {TRAIN_DEPTH} x {trainer.x.shape[1]}, batch {trainer.x.shape[0]},"
        f" {'fused' if trainer.fused else 'foreach'} Adam, {torch.get_num_threads()} threads,"
        f" state {state_bytes / 2**20:.0f} MiB, {steps} steps and {saves} saves a run,"
        f" {reps} interleaved repetitions (medians)"
    )
    print("vs (a): throughput relative to (a), median of per-repetition ratios;")
    print("ms/save: what the training thread spent in save + schedule per checkpoint")
    print(f"{'variant':52s} {'ms/step':>8s} {'vs (a)':>7s} {'ms/save':>8s}")
    rows = [
        ("(a) no checkpoints", "train_a", None),
        ("(b) tierpoint async every 5 steps", "train_b", "train_b_blocked"),
        ("(c) (b) + overlap_snapshot + optimizer hook", "train_c", "train_c_blocked"),
        ("(d) DCP async_save, reused stager, every 5 steps", "train_d", "train_d_blocked"),
    ]
    for label, key, blocked in rows:
        if key not in times:
            continue
        step_ms = median(times[key]) / steps * 1e3
        ratio = paired(times, "train_a", key)
        save_ms = f"{median(times[blocked]) / saves * 1e3:8.1f}" if blocked and saves else ""
        print(f"{label:52s} {step_ms:8.1f} {ratio:6.2f}x {save_ms:>8s}")


def print_checks(times: Times, stager_available: bool) -> None:
    dcp_key = "dcp_stager_block" if stager_available else "dcp_default_block"
    dcp_label = "reused stager" if stager_available else "default staging: no reusable stager"
    checks = [
        ("tierpoint blocking <= 1.2x memcpy floor", paired(times, "tp_block", "floor"), 1.2),
        (
            f"tierpoint blocking <= 0.8x DCP async_save ({dcp_label})",
            paired(times, "tp_block", dcp_key),
            0.8,
        ),
        (
            f"overlapped blocking <= 0.8x DCP async_save ({dcp_label})",
            paired(times, "tp_ov_block", dcp_key),
            0.8,
        ),
    ]
    print()
    for label, ratio, target in checks:
        print(f"{label:62s} {ratio:5.2f}x  {'PASS' if ratio <= target else 'MISS'}")
    if "train_d_blocked" in times:
        ratio = paired(times, "train_c_blocked", "train_d_blocked")
        label = "in the loop: overlapped blocking <= 0.8x DCP (reused stager)"
        print(f"{label:62s} {ratio:5.2f}x  {'PASS' if ratio <= 0.8 else 'MISS'}")
    ratio = paired(times, "train_a", "train_c")
    label = "overlapped training throughput >= 0.9x no checkpoints"
    print(f"{label:62s} {ratio:5.2f}x  {'PASS' if ratio >= 0.9 else 'MISS'}")


def print_machine(start: CpuSample) -> None:
    print(f"\n{machine_line(start)}")


# ------------------------------------------------------------------------------------ main


def check_room(gib: float, train_mib: float) -> bool:
    """Refuse to start where the run would not fit in memory (an OOM kill skips clean-up);
    return whether one more copy of the state, for the layout diagnostic, fits too."""
    h = hidden_size_for(gib)
    state = LAYERS * 144 * h * h + 12 * VOCAB * h
    # state, floor, staging, DCP cache, DCP fresh copy and its file, 2 tierpoint files
    need = 8 * state + 6 * train_mib * 2**20 + GIB // 2
    return require_memory(need, "use a smaller --gib") >= need + state


def bench_saves(
    root: Path, gib: float, reps: int, layout: bool, stack: contextlib.ExitStack
) -> tuple[Times, bool]:
    """The save contenders, interleaved; also whether a reusable DCP stager was available."""
    state = make_state(gib)
    tensors = tensors_of(state)
    stack.callback(shutil.rmtree, root / "tier", ignore_errors=True)  # after the queue closed
    with contextlib.ExitStack() as cold_stack:  # a first save without warm_up, for comparison
        cold = TierpointSaver(root / "cold", lambda: state, cold_stack).measure()
    shutil.rmtree(root / "cold", ignore_errors=True)
    tierpoint = TierpointSaver(root / "tier", lambda: state, stack)
    tierpoint.warm_up()  # as a job would, steps before its first save
    first = [tierpoint.measure() for _ in range(WARMUP_SAVES)][0]
    overlapped = TierpointSaver(
        root / "tier", lambda: state, stack, tierpoint, overlap_snapshot=True
    )
    overlapped.measure()  # starts its worker
    stager, stager_note = reusable_stager()
    if stager is not None:
        stack.callback(stager.close)
    layout_floor, layout_note = (
        part_layout_floor(state) if layout else (None, "layout diagnostic skipped: low memory")
    )
    contenders = [
        memcpy_floor(tensors),
        *([layout_floor] if layout_floor is not None else []),
        tierpoint.measure,
        overlapped.measure,
        dcp_contender(root, state, "dcp_default", None),
        *([dcp_contender(root, state, "dcp_stager", stager)] if stager is not None else []),
        torch_save_contender(root, state),
    ]
    run_interleaved(contenders, 1)  # warm-up: DCP's first save allocates its cache
    times = run_interleaved(contenders, reps)
    times["tp_first_block"] = [first["tp_block"]]
    times["tp_first_durable"] = [first["tp_durable"]]
    times["tp_cold_block"] = [cold["tp_block"]]
    times["tp_cold_durable"] = [cold["tp_durable"]]
    check_round_trip(tierpoint.manager, tensors)
    print_save_table(times, nbytes_of(tensors), len(tensors), reps, [layout_note, stager_note])
    return times, stager is not None


def check_round_trip(manager: LocalCheckpointManager, tensors: list[torch.Tensor]) -> None:
    """Untimed sanity check: the last tierpoint checkpoint loads back bit-exact."""
    loaded, _ = manager.load()
    if not all(torch.equal(a, b) for a, b in zip(loaded.tensors, tensors, strict=True)):
        raise SystemExit("tierpoint round trip is NOT bit-exact")


def bench_training(
    root: Path, train_mib: float, batch: int, steps: int, reps: int, stack: contextlib.ExitStack
) -> Times:
    torch.set_num_threads(2)
    trainer = make_trainer(train_mib, batch)
    for _ in range(3):
        trainer.step()  # builds the Adam state
    plain = TierpointSaver(root / "train-b", trainer.state, stack)
    overlap = TierpointSaver(root / "train-c", trainer.state, stack, overlap_snapshot=True)
    for saver in (plain, overlap):
        for _ in range(WARMUP_SAVES):
            saver.measure()
    stager, _ = reusable_stager()
    dcp_saver = None
    if stager is not None:
        stack.callback(stager.close)
        dcp_saver = DcpTrainingSaver(root, trainer.state, stager)
        stack.callback(dcp_saver.finalize)
        for _ in range(WARMUP_SAVES):
            dcp_saver.save()
        dcp_saver.finalize()
    contenders = training_contenders(trainer, steps, plain, overlap, dcp_saver)
    times = run_interleaved(contenders, reps)
    print_train_table(times, trainer, nbytes_of(tensors_of(trainer.state())), steps, reps)
    return times


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2.0)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    p.add_argument(
        "--train-mib",
        type=float,
        default=None,
        help="training model + Adam state in MiB (default 100 x --gib, at least 16)",
    )
    p.add_argument("--train-steps", type=int, default=20, help="steps per training run")
    p.add_argument(
        "--train-batch",
        type=int,
        default=DEFAULT_TRAIN_BATCH,
        help=f"rows per training batch (default {DEFAULT_TRAIN_BATCH}; 8: optimizer-bound case)",
    )
    p.add_argument(
        "--train-reps", type=int, default=None, help="training repetitions (default 2 x --reps)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    train_mib = args.train_mib if args.train_mib is not None else max(16.0, 100 * args.gib)
    train_reps = args.train_reps if args.train_reps is not None else 2 * args.reps
    layout = check_room(args.gib, train_mib)
    # SIGTERM unwinds like Ctrl-C: queues close and the directory goes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = cpu_sample()
    root = Path(tempfile.mkdtemp(prefix="tierpoint-async-bench-", dir="/dev/shm"))
    try:
        with contextlib.ExitStack() as stack:
            times, stager_available = bench_saves(root, args.gib, args.reps, layout, stack)
        gc.collect()
        with contextlib.ExitStack() as stack:
            times.update(
                bench_training(
                    root, train_mib, args.train_batch, args.train_steps, train_reps, stack
                )
            )
        print_checks(times, stager_available)
        print_machine(start)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
