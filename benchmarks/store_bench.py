"""Persistent tier on an object store: what each save costs the training thread, and how long until
it is durable, tierpoint against torch DCP, on a real S3-compatible server (moto, in this process)
behind a proxy that holds every request ``--latency`` ms (a store across a network, not on this
machine).

Per repetition, in this interleaved order (the machine's speed drifts):

- tierpoint: a ``TieredCheckpointManager`` with only the persistent tier (``keep_persistent=2``)
  saving every step of a loop of ``--saves`` steps, each step ``--step-ms`` of simulated training
  (a sleep: the GIL is free, as while GPU kernels run); figure: the training thread's time inside
  ``maybe_save`` per save (planning, snapshot, the previous save's commit and the retention it
  starts), then time to durable of one more save (``save`` to its commit: ``wait()``);
- torch: ``torch.distributed.checkpoint.async_save`` with ``FsspecWriter`` each step, the previous
  save's ``result()`` awaited first (as torch's documentation advises) and the step before it
  removed (``fs.rm``: retention as a user writes it); figure: the training thread's time in those
  calls per save, then time to durable of one more save;
- the floor: the state's bytes written as one object (one PUT through the same proxy).

Medians over repetitions; ratios against the floor. One rank (a gloo group of one), ``--mib`` MiB of
state. Run: ``./run bench store`` or ``.venv/bin/python benchmarks/store_bench.py --quick``.
Everything is written to a bucket of the server this run starts and removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from machine import cpu_sample, machine_line  # noqa: E402 - benchmarks/ is the script's directory


def make_state(mib: float) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    n = max(1, int(mib * 2**20 / 4 / 16))
    return {
        "model": {f"w{i}": torch.randn(n, generator=g) for i in range(16)},
        "step": torch.tensor(0),
        "position": {"samples": 0},
    }


def touch(state: dict[str, Any], step: int) -> None:
    state["model"]["w0"][0] = float(step)  # the state changes between saves, as training's does
    state["step"].fill_(step)


def run_tierpoint(url: str, options: dict, state: dict, saves: int, step_s: float) -> tuple:
    from tierpoint import TieredCheckpointManager

    costs = []
    with TieredCheckpointManager(
        None, url, "b", local_every=0, persistent_every=1, keep_persistent=2,
        storage_options=options, poll_every=1,
    ) as manager:  # fmt: skip
        for step in range(1, saves + 1):
            time.sleep(step_s)
            touch(state, step)
            start = time.perf_counter()
            manager.maybe_save(step, state)
            costs.append(time.perf_counter() - start)
        manager.wait()
        start = time.perf_counter()
        manager.save(saves + 1, state, tiers="persistent")
        manager.wait()
        durable = time.perf_counter() - start
    return statistics.median(costs[1:]), durable


def run_torch(url: str, options: dict, state: dict, saves: int, step_s: float) -> tuple:
    import fsspec
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    fs, _ = fsspec.url_to_fs(url, **options)
    costs, future = [], None
    for step in range(1, saves + 1):
        time.sleep(step_s)
        touch(state, step)
        start = time.perf_counter()
        if future is not None:
            future.result()
            if step > 2:
                fs.rm(f"{url}/step-{step - 2}", recursive=True)
        writer = FsspecWriter(f"{url}/step-{step}", **options)
        future = torch_dcp.async_save(state, storage_writer=writer)
        costs.append(time.perf_counter() - start)
    future.result()
    start = time.perf_counter()
    writer = FsspecWriter(f"{url}/step-{saves + 1}", **options)
    torch_dcp.async_save(state, storage_writer=writer).result()
    durable = time.perf_counter() - start
    return statistics.median(costs[1:]), durable


def run_floor(url: str, options: dict, state: dict) -> float:
    import fsspec

    fs, _ = fsspec.url_to_fs(url, **options)
    tensors = [t for t in state["model"].values()]
    data = b"".join(t.numpy().tobytes() for t in tensors)  # untimed: the floor is the PUT
    start = time.perf_counter()
    fs.pipe(f"{url}/floor.bin", data)
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a process of its own (in this one, its threads would take the GIL the
    contenders' training thread needs), once it answers."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("moto's server did not start") from None
            time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--mib", type=float, default=64, help="state size (MiB)")
    p.add_argument("--saves", type=int, default=8, help="saves per contender and repetition")
    p.add_argument("--step-ms", type=float, default=1500, help="simulated training between saves")
    p.add_argument("--latency", type=float, default=20, help="ms each request is held")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small: 16 MiB, 4 saves, 2 repetitions")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    if args.quick:
        args.mib, args.saves, args.reps, args.step_ms = 16, 4, 2, 1000
    try:
        import moto.server  # noqa: F401 - run below as its own process
        import s3fs
    except ImportError as e:
        print(f"skipped: needs moto[server] and s3fs ({e})")
        return 0
    from rich.console import Console
    from rich.table import Table

    from tests.dcp.s3_server import FaultyEndpoint

    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    # SIGTERM unwinds like Ctrl-C: the finally below stops the S3 server, removes the bucket
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    server, upstream = start_server()
    proxy = FaultyEndpoint(upstream, latency=args.latency / 1000)
    options = {"endpoint_url": proxy.url}
    direct = s3fs.S3FileSystem(endpoint_url=upstream)
    bucket = f"tierpoint-store-bench-{os.getpid()}"
    direct.mkdir(bucket)
    url = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    state = make_state(args.mib)
    figures: dict[str, list[float]] = {k: [] for k in
        ("tp_block", "tp_durable", "torch_block", "torch_durable", "floor")}  # fmt: skip
    step_s = args.step_ms / 1000
    start = cpu_sample()
    try:
        for rep in range(args.reps):
            block, durable = run_tierpoint(f"s3://{bucket}/tp{rep}", options, state,
                                           args.saves, step_s)  # fmt: skip
            figures["tp_block"].append(block)
            figures["tp_durable"].append(durable)
            block, durable = run_torch(f"s3://{bucket}/torch{rep}", options, state,
                                       args.saves, step_s)  # fmt: skip
            figures["torch_block"].append(block)
            figures["torch_durable"].append(durable)
            figures["floor"].append(run_floor(f"s3://{bucket}", options, state))
    finally:
        dist.destroy_process_group()
        direct.invalidate_cache()
        direct.rm(bucket, recursive=True)
        proxy.kill()
        server.kill()
        server.wait()
    med = {k: statistics.median(v) for k, v in figures.items()}
    floor = med["floor"]
    table = Table(title=f"persistent tier on S3 (moto, {args.latency:.0f} ms a request), "
                  f"{args.mib:.0f} MiB, {args.saves} saves x {args.reps} repetitions, medians")  # fmt: skip
    for column in ("contender", "figure", "seconds", "vs floor"):
        table.add_column(column, justify="right" if column in ("seconds", "vs floor") else "left")
    rows = [
        ("tierpoint", "training thread per save", med["tp_block"]),
        ("torch DCP async_save", "training thread per save", med["torch_block"]),
        ("tierpoint", "save to durable", med["tp_durable"]),
        ("torch DCP async_save", "save to durable", med["torch_durable"]),
        ("floor", "one PUT of the bytes", floor),
    ]
    for who, what, seconds in rows:
        table.add_row(who, what, f"{seconds:.3f}", f"{seconds / floor:.2f}x")
    Console().print(table)
    print(machine_line(start))
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": med, "all": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
