"""The fault-tolerant training demo: lose a whole node for real, resume, prove nothing was lost.

``python -m tierpoint.demo`` (or ``./run demo``) simulates ``--nodes`` nodes of ``--ranks-per-node``
ranks on 127.0.0.1 (one torchrun per node, ``--nnodes N --node-rank i``), each node with its own
local checkpoint root (its "RAM disk"), and runs three jobs:

1. train a small MLP with data-parallel SGD (gloo all-reduce), saving asynchronously to the local tier
   every ``--save-every`` steps, each part replicated to a rank on another node (clique replication,
   factor 2; a background worker writes, a background thread replicates; training pays for a memory
   copy), until every process of the last node kills itself with SIGKILL at ``--crash-at``; that
   node's root is then wiped (a replaced machine);
2. relaunch: every rank agrees on the newest iteration complete anywhere, the replaced node fetches
   its parts from their replicas on the other node (checksums verified) and gets its replicas back,
   and training goes on to ``--steps``;
3. the same training without any crash or checkpoint, as the reference.

It then compares the final weights of (2) and (3) bit for bit, checks that the replaced node holds
replicas again, and exits non-zero unless both hold. Everything it writes lives in a temporary
directory (under /dev/shm when present) removed at the end.
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
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import fileformat
from .asyncsave import AsyncCallsQueue
from .local import BasicTensorAwareStateDict, CliqueReplicationStrategy, LocalCheckpointManager
from .spawn import free_port

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
    manager = None
    if args.checkpoint:
        node = int(os.environ.get("GROUP_RANK", "0"))  # set by torchrun: this process's node
        # The default jump (ranks per node) puts each part's replica on another node.
        replication = CliqueReplicationStrategy.from_replication_params(replication_factor=2)
        manager = LocalCheckpointManager(
            Path(args.root) / f"node{node}", session_id="demo", repl_strategy=replication
        )
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
        if step == args.crash_at and int(os.environ.get("GROUP_RANK", "0")) == args.nodes - 1:
            print(
                f"  [rank {rank}] step {step}: killing myself with SIGKILL (node {args.nodes - 1} is lost)",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
    if queue is not None:
        queue.close()
    if rank == 0:
        fileformat.write(args.result, model.state_dict())
    dist.destroy_process_group()


def torchrun(
    args: argparse.Namespace, worker_args: list[str], log: Path, module: str | None = None
) -> int:
    """One torchrun per simulated node (``args.nodes`` x ``args.ranks_per_node``) running this
    demo's worker, or ``python -m module worker_args``; returns the first non-zero exit code (0 if
    all succeeded)."""
    target = [module] if module else ["tierpoint.demo", "--worker", f"--nodes={args.nodes}"]
    scratch = log.parent / "tmp"  # torchrun's log directories, removed with the demo's files
    scratch.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        OMP_NUM_THREADS="1",
        TMPDIR=str(scratch),
    )
    port = free_port()
    procs = []
    with open(log, "ab") as log_file:
        for node in range(args.nodes):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={args.nodes}",
                f"--nproc-per-node={args.ranks_per_node}",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                *target,
                *worker_args,
            ]
            out = subprocess.PIPE if node == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=log_file))
        echo = threading.Thread(target=_echo, args=(procs[0].stdout,), daemon=True)
        echo.start()
        codes = _wait_all(procs)
        echo.join(10)
    return next((c for c in codes if c != 0), 0)


def _echo(stream: Any) -> None:
    for line in stream:
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()


def _wait_all(procs: list[subprocess.Popen], limit: float = 600, grace: float = 30) -> list[int]:
    """Every process's exit code. Once one failed, the others get ``grace`` seconds to end (a
    torchrun whose workers all succeeded would otherwise wait 300 s at its exit barrier for the
    failed node's agent); then, or after ``limit`` seconds in all, they are stopped."""
    start = time.monotonic()
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now - start > limit or (failed_at is not None and now - failed_at > grace):
            for p in procs:
                if p.poll() is None:
                    print(f"  stopping torchrun (pid {p.pid}): another node's job failed or hung")
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    return [p.returncode for p in procs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tierpoint.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (>= 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
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
    if args.nodes < 2 or args.ranks_per_node < 1:
        parser.error(
            "need --nodes >= 2 (a lost node's parts live on another) and --ranks-per-node >= 1"
        )
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix="tierpoint-demo-", dir=base))
    try:
        return run_demo(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_demo(args: argparse.Namespace, work: Path) -> int:
    log = work / "torchrun.log"
    root = work / "local"
    lost = args.nodes - 1
    common = [
        f"--steps={args.steps}",
        f"--save-every={args.save_every}",
        f"--root={root}",
    ]
    print(
        f"tierpoint demo: {args.nodes} nodes x {args.ranks_per_node} ranks, {args.steps} steps, "
        f"local checkpoint every {args.save_every} steps, each part replicated to another node"
    )
    print(f"\n[1/3] training; node {lost} (all its ranks) will be lost at step {args.crash_at}")
    t0 = time.perf_counter()
    code = torchrun(
        args, [*common, f"--crash-at={args.crash_at}", f"--result={work / 'crashed.part'}"], log
    )
    print(f"  job ended with exit code {code} after {time.perf_counter() - t0:.1f} s (the crash)")
    if code == 0:
        print("FAILED: the crash did not happen")
        return 1
    shutil.rmtree(root / f"node{lost}", ignore_errors=True)
    print(f"  node {lost} replaced: its local checkpoint root is wiped")
    print("\n[2/3] relaunching the job: it resumes from the newest checkpoint complete anywhere")
    code = torchrun(args, [*common, "--crash-at=-1", f"--result={work / 'resumed.part'}"], log)
    if code != 0:
        print(
            f"FAILED: the resumed job exited with {code}; torchrun log:\n{log.read_text()[-3000:]}"
        )
        return 1
    print("\n[3/3] reference: the same training without crash or checkpoints")
    code = torchrun(
        args,
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
    if not same:
        print("\nFAILED: the resumed weights differ from the uninterrupted run")
        return 1
    print(
        f"\nOK: after losing node {lost} and resuming, all {n:,} weights equal the uninterrupted "
        "run bit for bit"
    )
    held = _replicas_held(root / f"node{lost}" / "demo", args)
    if not held:
        print(f"FAILED: the replaced node {lost} holds no replicas of other nodes' parts")
        return 1
    print(f"OK: the replaced node {lost} holds replicas again ({held})")
    return 0


def _replicas_held(session_dir: Path, args: argparse.Namespace) -> str:
    """'rank R: parts of ranks ...' for the replicas (parts of other ranks) under ``session_dir``."""
    from .local.naming import parse_part_name

    lines = []
    for holder in sorted(session_dir.iterdir()) if session_dir.is_dir() else []:
        origins = sorted(
            {
                p[1]
                for p in map(parse_part_name, os.listdir(holder))
                if p and p[1] != int(holder.name)
            }
        )
        if origins:
            lines.append(f"rank {holder.name}: part of rank {', '.join(map(str, origins))}")
    return "; ".join(lines)


if __name__ == "__main__":
    sys.exit(main())
