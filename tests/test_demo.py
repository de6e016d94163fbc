"""The demo as the end-to-end test of every tier: torchrun, 2 nodes x 2 ranks on 127.0.0.1, a
GPT-style job checkpointing only through TieredCheckpointManager, killed with SIGKILL at random
steps with a save in flight: one rank (resumes from the local tier), node 1 with its local root
wiped (from peer replicas), every node with every local root wiped (from the persistent tier). It
must end bit for bit equal to an uninterrupted run, report each recovery, and leave nothing behind.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierpoint.demo.launch import _wait_all


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_killed_three_ways_the_demo_ends_bit_equal_to_an_uninterrupted_run(tmp_path) -> None:
    logs = tmp_path  # the demo's TMPDIR (not /tmp, where other tests' torchrun jobs write)
    rng = random.Random()
    # Right after a scheduled save (every 3 steps: it is in flight), at least a save apart.
    rank_at = rng.choice([6, 9])
    node_at = rng.choice([s for s in (12, 15, 18) if s > rank_at + 3])
    all_at = rng.choice([s for s in (21, 24) if s > node_at + 3])
    failures = f"rank@{rank_at},node@{node_at},all@{all_at}"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tierpoint.demo", "--width=32", f"--failures={failures}"],
            capture_output=True,
            text=True,
            timeout=400,  # below pytest's, so that a stuck run shows the demo's own output
            env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="160", TMPDIR=str(logs)),
        )
    except subprocess.TimeoutExpired as e:
        _remove(_demo_dir(e.stdout))  # a killed demo cannot remove its RAM files itself
        raise
    out = proc.stdout
    work = _demo_dir(out)
    if proc.returncode != 0:
        _remove(work)  # kept by the demo for inspection: the output says why
    assert proc.returncode == 0, f"{failures}\n{out}\n{proc.stderr[-3000:]}"
    resumes = [line for line in out.splitlines() if "resumed at step" in line]
    assert [line.split(" tier ")[0].split()[-1] for line in resumes] == [
        "local",
        "peers",
        "persistent",
    ], out
    assert "parameters equal the uninterrupted run bit for bit (4 ranks)" in out
    assert "restore from peers took" in out  # and the report compares the two restores
    # The demo removes what it wrote: its own directory (on /dev/shm where there is one). Only
    # that one is checked: another demo (a user's, another test run's) may be running beside it.
    assert work is not None and work.name.startswith("tierpoint-demo-"), out
    if os.path.isdir("/dev/shm"):
        assert work.parent == Path("/dev/shm"), work
    assert not work.exists(), sorted(work.rglob("*"))
    assert not list(logs.iterdir())  # torchrun's logs too


def test_a_failed_node_stops_the_other_nodes_job_instead_of_leaving_it_waiting() -> None:
    """torchrun on a node whose workers all succeeded waits 300 s at its exit barrier for a node
    that failed; the demo stops it after a grace period and reports the failure."""
    start = time.monotonic()
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    codes = _wait_all([failed, waiting], grace=1)
    assert codes[0] == 3 and codes[1] != 0
    assert time.monotonic() - start < 30


def test_bad_failure_lists_are_refused_before_anything_runs() -> None:
    # node@3, all@6: no checkpoint of the tier they resume from (local and persistent every 3
    # and 6 steps) can be committed before them; each once ran the demo and failed at its end
    for bad in ("disk@3", "node@40", "all@9,node@6", "node@3", "rank@2", "node@4,all@6"):
        proc = subprocess.run(
            [sys.executable, "-m", "tierpoint.demo", f"--failures={bad}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and "--failures" not in proc.stdout, proc.stderr
        assert "failure" in proc.stderr


def test_bad_sizes_are_refused_before_anything_runs() -> None:
    """Each once ran the whole demo and failed at its end, or crashed in every rank."""
    bad_sizes = ("--steps=0", "--local-every=0", "--persistent-every=0", "--layers=0", "--width=6")
    for bad in (*bad_sizes, "--nodes=3"):  # 3 nodes: unreplicated, the node failure found nothing
        proc = subprocess.run(
            [sys.executable, "-m", "tierpoint.demo", bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and not proc.stdout, (bad, proc.stdout)
        assert bad.split("=")[0] in proc.stderr.splitlines()[-1], (bad, proc.stderr)


def test_a_persistent_location_that_holds_files_is_refused_before_anything_runs(tmp_path) -> None:
    """The demo run again on the --persistent of an earlier run resumed there at its last step,
    never reached its first failure and reported 'the failure did not happen'."""
    (tmp_path / "run" / "step-18").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    for where, said in (
        (tmp_path / "run", "is not empty (step-18)"),
        (tmp_path / "file", "a file"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "tierpoint.demo", f"--persistent={where}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and not proc.stdout, (where, proc.stdout)
        assert said in proc.stderr.splitlines()[-1], proc.stderr


def _demo_dir(out: str | bytes | None) -> Path | None:
    """The demo's directory, which its first lines name (``<dir>/ckpt/node<N>``)."""
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    found = re.search(r" (\S+)/ckpt/node<N> ", out or "")
    return Path(found.group(1)) if found else None


def _remove(work: Path | None) -> None:
    if work is not None and work.name.startswith("tierpoint-demo-"):
        shutil.rmtree(work, ignore_errors=True)
