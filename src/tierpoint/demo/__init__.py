"""The demo: a small GPT-style model trained on several simulated nodes, checkpointed through every
tier, loses a node and then every node's local storage, resumes each time, and ends bit for bit
where an uninterrupted run ends.

``python -m tierpoint.demo`` (``./run demo``, ``tierpoint demo``) runs :mod:`tierpoint.demo.job`
on ``--nodes`` torchruns of ``--ranks-per-node`` ranks on 127.0.0.1 (CPU, gloo), each node with its
own local root (its "RAM disk") and one shared persistent directory (or ``--persistent s3://...``).
For each failure of ``--failures`` (``KIND@STEP``, KIND: ``rank`` the last rank, ``node`` the last
node, ``all`` every rank) the job is launched, the ranks named SIGKILL themselves right after
``maybe_save(STEP)`` returned (a save of STEP or of an earlier step may then be in flight), and
what a real failure takes with it is wiped (the node's local root; every local root); then the job is relaunched and resumes from the newest
checkpoint complete anywhere. A last launch finishes, the same training runs once without
checkpoints as the reference, and the final parameters are compared bit for bit. The report says,
per failure, the steps lost, where the restore came from and how long it took, and per tier the
blocking time per save and the time to durable. Everything is written under one temporary
directory (in /dev/shm when present), removed at the end unless ``--keep``.

Call order: :func:`main` parses and checks the arguments, :func:`run_demo` runs the launches
(:mod:`.launch`) and :func:`report` prints what they wrote. Exit status 0 only when every failure
happened, every resume came from the expected tier and the parameters are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .launch import Cluster, torchrun

KINDS = {"rank": "the last rank", "node": "the last node", "all": "every node"}
EXPECTED_TIER = {"rank": "local", "node": "peers", "all": "persistent"}


def parse_failures(text: str, steps: int) -> list[tuple[str, int]]:
    """``"node@12,all@21"`` -> ``[("node", 12), ("all", 21)]``, checked (increasing, in range)."""
    failures = []
    for item in filter(None, text.split(",")):
        kind, _, step = item.partition("@")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"bad failure {item!r}: want KIND@STEP with KIND in {sorted(KINDS)}")
        failures.append((kind, int(step)))
    points = [s for _, s in failures]
    if points != sorted(set(points)) or not all(0 < s < steps for s in points):
        raise ValueError(f"failure steps must increase and lie in 1..{steps - 1}, got {points}")
    return failures


def kill_ranks(kind: str, cluster: Cluster) -> list[int]:
    world = cluster.nodes * cluster.ranks_per_node
    if kind == "rank":
        return [world - 1]
    if kind == "node":
        return list(range(world - cluster.ranks_per_node, world))
    return list(range(world))


def main(argv: list[str] | None = None, prog: str = "python -m tierpoint.demo") -> int:
    """Run the demo with ``argv``; ``prog``: how its usage line names it. Returns the status."""
    p = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--nodes", type=int, default=2, help="simulated nodes (an even number >= 2; default 2)"
    )
    p.add_argument("--ranks-per-node", type=int, default=2, help="default 2")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--local-every", type=int, default=3, help="local save every N steps (3)")
    p.add_argument("--persistent-every", type=int, default=6, help="persistent save every N (6)")
    p.add_argument("--width", type=int, default=64, help="model width (64)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (2)")
    p.add_argument(
        "--failures",
        default="node@13,all@22",
        help="KIND@STEP,...: SIGKILL 'rank' (the last), 'node' (the last) or 'all' right after "
        "maybe_save(STEP) returned (default node@13,all@22: resumes from peers, then from the "
        "persistent tier)",
    )
    p.add_argument("--persistent", help="persistent tier: a path or s3:// URL (default: temporary)")
    p.add_argument("--endpoint-url", help="S3 endpoint for an s3:// --persistent")
    p.add_argument(
        "--keep", action="store_true", help="keep the checkpoints and logs (kept anyway on failure)"
    )
    args = p.parse_args(argv)
    if args.nodes < 2 or args.ranks_per_node < 1:
        p.error("need --nodes >= 2 (a lost node's parts live on another) and --ranks-per-node >= 1")
    if args.nodes % 2:  # cliques of 2 nodes: an odd count leaves the local tier unreplicated
        p.error(
            f"--nodes must be even, got {args.nodes}: each part is copied to one other node, the "
            "nodes in pairs (with an odd count the local tier saves unreplicated)"
        )
    if min(args.steps, args.local_every, args.persistent_every, args.layers) < 1:
        p.error(
            "need --steps, --local-every, --persistent-every and --layers >= 1 (each tier saves)"
        )
    if args.width < 4 or args.width % 4:
        p.error(
            f"--width must be a positive multiple of 4 (the blocks' attention heads), got {args.width}"
        )
    try:
        failures = parse_failures(args.failures, args.steps)
    except ValueError as e:
        p.error(str(e))
    for kind, step in failures:  # nothing of its tier could be committed yet: it would resume at 0
        every = args.persistent_every if EXPECTED_TIER[kind] == "persistent" else args.local_every
        if step <= every:
            flag = "--persistent-every" if EXPECTED_TIER[kind] == "persistent" else "--local-every"
            p.error(
                f"failure {kind}@{step} comes before any {EXPECTED_TIER[kind]} checkpoint could "
                f"be committed ({flag} {every}): give it a later step"
            )
    if args.persistent:
        _check_persistent(p, args.persistent, args.endpoint_url)
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix="tierpoint-demo-", dir=base))
    code = 1
    try:
        code = run_demo(args, failures, work)
        return code
    finally:
        if args.keep or code != 0:
            ckpt = work / "ckpt"
            print(f"kept for inspection (checkpoints, torchrun.log): {work}; `tierpoint ls` lists "
                  f"{ckpt}/node<N> (each node's local tier) and the persistent tier "
                  f"{args.persistent or ckpt / 'persistent'}")  # fmt: skip
        else:
            shutil.rmtree(work, ignore_errors=True)


def _check_persistent(p: argparse.ArgumentParser, url: str, endpoint_url: str | None) -> None:
    """A ``--persistent`` location must be new or empty: the demo's first launch would resume
    from what an earlier run left there (and its failures then never happen)."""
    from .. import storage
    from ..errors import CheckpointingError

    if storage.is_local(url) and os.path.exists(url) and not os.path.isdir(url):
        p.error(f"--persistent {url}: a file, not a directory")
    try:
        held = storage.listdir(url, {"endpoint_url": endpoint_url} if endpoint_url else None)
    except CheckpointingError as e:
        p.error(f"--persistent {url}: {e}")
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        p.error(
            f"--persistent {url} is not empty ({shown}): the demo would resume from an earlier "
            "run's checkpoints there; give it a new or empty location"
        )


def run_demo(args: argparse.Namespace, failures: list[tuple[str, int]], work: Path) -> int:
    cluster = Cluster(args.nodes, args.ranks_per_node)
    log, root = work / "torchrun.log", work / "ckpt"
    persistent = args.persistent or str(root / "persistent")
    common = [
        f"--root={root}",
        f"--persistent={persistent}",
        f"--steps={args.steps}",
        f"--local-every={args.local_every}",
        f"--persistent-every={args.persistent_every}",
        f"--width={args.width}",
        f"--layers={args.layers}",
        *([f"--endpoint-url={args.endpoint_url}"] if args.endpoint_url else []),
    ]
    world = cluster.nodes * cluster.ranks_per_node
    phases = len(failures) + 2
    print(
        f"tierpoint demo: {cluster.nodes} nodes x {cluster.ranks_per_node} ranks (CPU, gloo), a "
        f"GPT-style model ({args.layers} blocks, width {args.width}) with AdamW, {args.steps} steps"
    )
    print(
        f"  local tier every {args.local_every} steps: {root}/node<N> (each part copied to "
        f"another node); persistent tier every {args.persistent_every} steps: {persistent}"
    )
    started = time.perf_counter()
    for i, (kind, step) in enumerate(failures):
        verb = "training" if i == 0 else "relaunching: resume, then train"
        print(f"\n[{i + 1}/{phases}] {verb}; {KINDS[kind]} is lost at step {step}", flush=True)
        ranks = ",".join(map(str, kill_ranks(kind, cluster)))
        kill = [f"--kill={step}", f"--kill-ranks={ranks}", f"--report={work / f'run{i}.json'}"]
        code = torchrun(cluster, [*common, *kill], log)
        if code == 0:
            print("FAILED: the failure did not happen")
            return 1
        if kind == "node":
            shutil.rmtree(root / f"node{cluster.nodes - 1}", ignore_errors=True)
            print(f"  node {cluster.nodes - 1} replaced: its local root is wiped")
        elif kind == "all":
            for node in range(cluster.nodes):
                shutil.rmtree(root / f"node{node}", ignore_errors=True)
            print("  every node replaced: every local root is wiped")
    print(f"\n[{phases - 1}/{phases}] relaunching: resume, then train to the end", flush=True)
    final = work / "final.json"
    result = work / "resumed.part"
    code = torchrun(cluster, [*common, f"--report={final}", f"--result={result}"], log)
    if code != 0:
        print(f"FAILED: the last launch exited with {code}; log:\n{log.read_text()[-3000:]}")
        return 1
    print(f"\n[{phases}/{phases}] reference: the same training without failures or checkpoints")
    reference = work / "reference.part"
    code = torchrun(cluster, [*common, "--no-checkpoint", f"--result={reference}"], log)
    if code != 0:
        print(f"FAILED: the reference run exited with {code}; log:\n{log.read_text()[-3000:]}")
        return 1
    # The launch after each failure reports where it resumed from.
    resumes = [_read(work / f"run{i}.json") for i in range(1, len(failures))] + [_read(final)]
    return report(failures, resumes, final, result, reference, world, started)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def report(
    failures: list[tuple[str, int]],
    resumes: list[dict[str, Any]],
    final: Path,
    result: Path,
    reference: Path,
    world: int,
    started: float,
) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from .. import fileformat

    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    console = Console(highlight=False, width=None if wide else 110)
    resumed, expected = fileformat.read(result), fileformat.read(reference)
    same = resumed.keys() == expected.keys() and all(
        torch.equal(resumed[k], expected[k]) for k in expected
    )
    ok = same
    table = Table(title="failures and recoveries")
    for column in (
        "failure",
        "at step",
        "resumed at",
        "steps lost",
        "from tier",
        "restore",
        "bytes/rank",
    ):
        table.add_column(column)
    seconds: dict[str, float] = {}
    early = []  # failures that came before anything was committed
    for (kind, step), run in zip(failures, resumes):
        restore = run.get("restore") or {}
        tier = restore.get("tier")
        ok &= tier == EXPECTED_TIER[kind]
        if run and tier is None:
            early.append(f"{kind}@{step}")
        start = run.get("start", 0)
        seconds[str(tier)] = restore.get("seconds", 0.0)
        table.add_row(
            KINDS[kind],
            str(step),
            str(start),
            str(step - start),
            str(tier),
            f"{restore.get('seconds', 0.0):.2f} s",
            f"{restore.get('bytes', 0):,}",
        )
    console.print(table)
    stats = (_read(final).get("stats") or {}).get("tiers", {})
    saves = Table(title="saves in the last launch (rank 0)")
    for column in ("tier", "saves", "blocking per save (median)", "time to durable (median)"):
        saves.add_column(column)
    for tier, s in stats.items():
        saves.add_row(
            tier,
            str(s["saves"]),
            f"{1e3 * s['blocking_s']['median']:.1f} ms",
            f"{1e3 * s['durable_s']['median']:.1f} ms",
        )
    console.print(saves)
    if "peers" in seconds and seconds.get("persistent"):
        console.print(
            f"restore from peers took {seconds['peers']:.2f} s, from the persistent tier "
            f"{seconds['persistent']:.2f} s ({seconds['persistent'] / max(seconds['peers'], 1e-9):.1f}x)"
        )
    n = sum(t.numel() for t in resumed.values())
    if not same:
        print("FAILED: the final parameters differ from the uninterrupted run")
    else:
        print(f"OK: all {n:,} parameters equal the uninterrupted run bit for bit ({world} ranks)")
    if early:
        print(
            f"FAILED: nothing to resume from after {', '.join(early)}: the saves before it were "
            "all still in flight (a job's first save also waits for its worker to start); give "
            "it a later step"
        )
    elif not ok and same:
        print("FAILED: a restore did not come from the tier expected for its failure")
    print(f"demo took {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
