"""Local tier on 4 ranks: LocalCheckpointManager save/load vs torch.save/torch.load vs the raw floor.

Every rank holds ~``--mib`` MiB of transformer-like state (fp32 weights, Adam moments, some bf16 and
int64 tensors) and, per repetition, in this interleaved order (the machine's speed drifts):

- save: tierpoint ``manager.save`` (sync; fsync, checksums, agreement included), ``torch.save`` into a
  new file, and the raw floor: the same bytes written with ``os.write`` into a new file;
- load: tierpoint ``manager.load`` (verified), ``torch.load(weights_only=True)`` into fresh memory, and
  the raw floor: ``readinto`` of the same bytes into preallocated memory.

A figure is the slowest rank's time (what the job waits for); the table gives medians over
repetitions, and for tierpoint saves the steady state (from the third save on, when expired files are
recycled). Run: ``./run bench local`` or ``.venv/bin/python benchmarks/local_bench.py --mib 512``.
Everything is written under a temporary directory in /dev/shm and removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from floor import preallocate, raw_read, raw_write, tensors_of
from machine import cpu_sample, machine_line

from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tierpoint.testing import run_ranks

WORLD = 4


def make_state(mib: float, seed: int) -> dict:
    """~``mib`` MiB: blocks of (weight, exp_avg, exp_avg_sq) plus a few bf16/int64/scalar tensors."""
    g = torch.Generator().manual_seed(seed)
    width = 1024
    per_block = 3 * width * width * 4
    blocks = max(1, int(mib * 2**20 / per_block))
    model, optim = {}, {}
    for i in range(blocks):
        model[f"layers.{i}.weight"] = torch.randn(width, width, generator=g)
        optim[f"layers.{i}"] = {
            "step": torch.tensor(float(i)),
            "exp_avg": torch.randn(width, width, generator=g),
            "exp_avg_sq": torch.rand(width, width, generator=g),
        }
        model[f"layers.{i}.norm"] = torch.randn(width, generator=g).to(torch.bfloat16)
    model["position_ids"] = torch.arange(4096, dtype=torch.int64)
    return {"model": model, "optimizer": optim, "iteration": 0}


def timed(fn, *args) -> float:  # noqa: ANN001
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench_rank(rank: int, world: int, root: str, mib: float, reps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    state = make_state(mib, seed=rank)
    tensors = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    scratch = Path(root) / f"scratch{rank}"
    scratch.mkdir(parents=True)
    manager = LocalCheckpointManager(Path(root) / "tier", session_id="bench")
    targets = preallocate(tensors)  # the floor reads into memory that already exists
    times: dict[str, list[float]] = {
        k: [] for k in ("tp_save", "torch_save", "raw_write", "tp_load", "torch_load", "raw_read")
    }

    def torch_save() -> None:
        (scratch / "torch.pt").unlink(missing_ok=True)
        torch.save(state, scratch / "torch.pt")

    def raw_write_new() -> None:
        (scratch / "raw.bin").unlink(missing_ok=True)
        raw_write(scratch / "raw.bin", tensors)

    for it in range(1, reps + 1):
        state["iteration"] = it
        times["tp_save"].append(timed(manager.save, BasicTensorAwareStateDict(state), it))
        times["torch_save"].append(timed(torch_save))
        times["raw_write"].append(timed(raw_write_new))
        times["tp_load"].append(timed(lambda: manager.load()))
        times["torch_load"].append(
            timed(lambda: torch.load(scratch / "torch.pt", weights_only=True))
        )
        times["raw_read"].append(timed(raw_read, scratch / "raw.bin", targets))
    times["nbytes"] = [float(nbytes)]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=512, help="state size per rank (MiB)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: the finally below removes the files (and stops the ranks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    root = tempfile.mkdtemp(prefix="tierpoint-local-bench-", dir="/dev/shm")
    start = cpu_sample()
    try:
        per_rank = run_ranks(
            bench_rank, WORLD, root, args.mib, args.reps, timeout=3600, pg_timeout=600
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(per_rank, args.reps)
    print(f"\n{machine_line(start)}")


def report(per_rank: list[dict[str, list[float]]], reps: int) -> None:
    total = sum(r["nbytes"][0] for r in per_rank)
    # The job waits for its slowest rank: per repetition, the maximum over ranks.
    slowest = {
        k: [max(r[k][i] for r in per_rank) for i in range(reps)]
        for k in per_rank[0]
        if k != "nbytes"
    }
    steady = slowest["tp_save"][2:] or slowest["tp_save"]
    med = {k: statistics.median(v) for k, v in slowest.items()}
    med["tp_save_steady"] = statistics.median(steady)
    med["tp_save_first"] = slowest["tp_save"][0]
    gbs = {k: total / v / 1e9 for k, v in med.items()}
    print(
        f"\nlocal tier, {WORLD} ranks x {total / WORLD / 2**20:.0f} MiB, {reps} interleaved repetitions (medians)"
    )
    print(f"{'contender':34s} {'seconds':>8s} {'GB/s':>7s}")
    # The third save is the first to rewrite an expired file; fewer repetitions have none.
    steady_label = f"tierpoint save ({'steady, recycled' if reps >= 3 else 'none recycled yet'})"
    rows = [
        ("tierpoint save (first, new files)", "tp_save_first"),
        (steady_label, "tp_save_steady"),
        ("torch.save (new file)", "torch_save"),
        ("raw os.write floor (new file)", "raw_write"),
        ("tierpoint load (verified)", "tp_load"),
        ("torch.load (weights_only)", "torch_load"),
        ("raw readinto floor (preallocated)", "raw_read"),
    ]
    for label, key in rows:
        print(f"{label:34s} {med[key]:8.3f} {gbs[key]:7.2f}")
    checks = [
        ("steady save >= 1.5x torch.save", gbs["tp_save_steady"] / gbs["torch_save"], 1.5),
        ("steady save >= 1.0x raw new-file floor", gbs["tp_save_steady"] / gbs["raw_write"], 1.0),
        ("load >= 0.8x raw read floor", gbs["tp_load"] / gbs["raw_read"], 0.8),
        ("load >= 1.5x torch.load", gbs["tp_load"] / gbs["torch_load"], 1.5),
    ]
    print()
    for label, ratio, target in checks:
        print(f"{label:40s} {ratio:5.2f}x  {'PASS' if ratio >= target else 'MISS'}")


if __name__ == "__main__":
    main()
