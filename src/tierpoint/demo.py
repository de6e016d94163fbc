"""The fault-tolerant training demo: train on 2 ranks, crash one for real, resume, prove nothing was lost.

``python -m tierpoint.demo`` (or ``./run demo``) runs three torchrun jobs on 127.0.0.1:

1. train a small MLP with data-parallel SGD (gloo all-reduce), saving asynchronously to the local tier
   every ``--save-every`` steps (a background worker process writes; training pays for a memory copy),
   until rank 1 kills itself with SIGKILL at ``--crash-at``;
2. relaunch: every rank agrees on the newest complete checkpoint, loads it (checksums verified) and
   trains on to ``--steps``;
3. the same training without any crash or checkpoint, as the reference.

It then compares the final weights of (2) and (3) bit for bit and exits non-zero unless they are equal.
Everything it writes lives in a temporary directory (under /dev/shm when present) removed at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import fileformat
from .asyncsave import AsyncCallsQueue
from .local import BasicTensorAwareStateDict, LocalCheckpointManager

WIDTH = 512
DEPTH = 4


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(64, WIDTH, generator=g)
    return x, x[:, :8].sum(dim=1, keepdim=True).sin()


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int
) -> float:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    return loss.item()


def worker(args: argparse.Namespace) -> None:
    """One rank of a torchrun job (phases 1-3)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stdout,
        format=f"  [rank {rank}] %(message)s",
    )
    model, opt = build_model()
    manager = LocalCheckpointManager(args.root, session_id="demo") if args.checkpoint else None
    queue = AsyncCallsQueue() if args.checkpoint else None
    if queue is not None:
        queue.wait_ready()  # the worker's start (a torch import) would otherwise delay the first save
    start_step = 0
    if manager is not None:
        latest = manager.find_latest()
        if latest != -1:
            ta, _ = manager.load()
            state = ta.state_dict
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start_step = state["step"]
            if rank == 0:
                print(
                    f"  resumed from the checkpoint of step {start_step} (agreed by all {world} ranks)"
                )
        elif rank == 0:
            print("  no checkpoint found: starting from scratch")
    for step in range(start_step + 1, args.steps + 1):
        loss = train_step(model, opt, step, rank, world)
        if rank == 0 and step % 5 == 0:
            print(f"  step {step:3d}  loss {loss:.5f}")
        if queue is not None:
            queue.maybe_finalize_async_calls(
                blocking=False
            )  # cheap: no collective until a save is done
        if manager is not None and queue is not None and step % args.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            t0 = time.perf_counter()
            queue.schedule_async_request(
                manager.save(BasicTensorAwareStateDict(state), step, is_async=True)
            )
            if rank == 0:
                print(
                    f"  step {step:3d}  async checkpoint scheduled; training blocked {1e3 * (time.perf_counter() - t0):.1f} ms"
                )
        if step == args.crash_at and rank == 1:
            print(
                f"  [rank 1] step {step}: killing myself with SIGKILL (simulated node crash)",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
    if queue is not None:
        queue.close()
    if rank == 0:
        fileformat.write(args.result, model.state_dict())
    dist.destroy_process_group()


def torchrun(ranks: int, worker_args: list[str], log: Path) -> int:
    env = dict(
        os.environ,
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        OMP_NUM_THREADS="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "tierpoint.demo",
        "--worker",
        *worker_args,
    ]
    with open(log, "ab") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log_file)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()
        return proc.wait(timeout=600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tierpoint.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=27)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-checkpoint", dest="checkpoint", action="store_false", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not 0 < args.save_every < args.crash_at < args.steps:
        parser.error("need 0 < --save-every < --crash-at < --steps")
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix="tierpoint-demo-", dir=base))
    try:
        return run_demo(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_demo(args: argparse.Namespace, work: Path) -> int:
    log = work / "torchrun.log"
    common = [
        f"--steps={args.steps}",
        f"--save-every={args.save_every}",
        f"--root={work / 'local'}",
    ]
    print(
        f"tierpoint demo: {args.ranks} ranks, {args.steps} steps, local checkpoint every {args.save_every} steps"
    )
    print(f"\n[1/3] training; rank 1 will crash at step {args.crash_at}")
    t0 = time.perf_counter()
    code = torchrun(
        args.ranks,
        [*common, f"--crash-at={args.crash_at}", f"--result={work / 'crashed.part'}"],
        log,
    )
    print(f"  job ended with exit code {code} after {time.perf_counter() - t0:.1f} s (the crash)")
    if code == 0:
        print("FAILED: the crash did not happen")
        return 1
    print("\n[2/3] relaunching the job: it resumes from the newest complete checkpoint")
    code = torchrun(
        args.ranks, [*common, "--crash-at=-1", f"--result={work / 'resumed.part'}"], log
    )
    if code != 0:
        print(
            f"FAILED: the resumed job exited with {code}; torchrun log:\n{log.read_text()[-3000:]}"
        )
        return 1
    print("\n[3/3] reference: the same training without crash or checkpoints")
    code = torchrun(
        args.ranks,
        [*common, "--crash-at=-1", "--no-checkpoint", f"--result={work / 'reference.part'}"],
        log,
    )
    if code != 0:
        print(
            f"FAILED: the reference job exited with {code}; torchrun log:\n{log.read_text()[-3000:]}"
        )
        return 1
    resumed = fileformat.read(work / "resumed.part")
    reference = fileformat.read(work / "reference.part")
    same = resumed.keys() == reference.keys() and all(
        torch.equal(resumed[k], reference[k]) for k in resumed
    )
    n = sum(t.numel() for t in resumed.values())
    if same:
        print(
            f"\nOK: after the crash and resume, all {n:,} weights equal the uninterrupted run bit for bit"
        )
        return 0
    print("\nFAILED: the resumed weights differ from the uninterrupted run")
    return 1


if __name__ == "__main__":
    sys.exit(main())
