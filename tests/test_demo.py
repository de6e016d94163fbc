"""The demo as a multi-node test: torchrun --nnodes 2 --nproc-per-node 2 on 127.0.0.1, node 1 lost.

Both processes of node 1 are SIGKILLed and its local root wiped; the relaunched job must resume from
the newest iteration (fetched from the replicas on node 0), end bit-equal to an uninterrupted run,
and node 1 must hold replicas again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def test_lost_node_resumes_bit_equal_and_replicas_return() -> None:
    shm = Path("/dev/shm")
    before = set(shm.glob("tierpoint-demo-*")) if shm.is_dir() else set()
    logs = Path(tempfile.gettempdir())
    torchrun_logs = set(logs.glob("torchelastic_*"))
    proc = subprocess.run(
        [sys.executable, "-m", "tierpoint.demo", "--steps=24", "--save-every=8", "--crash-at=19"],
        capture_output=True,
        text=True,
        timeout=270,  # below pytest's 300 s, so that a stuck run shows the demo's own output
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "resumed from the checkpoint of step 16 (agreed by all 4 ranks)" in out
    # Ranks 2 and 3 (node 1) got their own parts and their replicas back from node 0.
    restoring = next(line for line in out.splitlines() if "restoring" in line)
    assert "rank 0 -> 2 (part of 2)" in restoring and "rank 1 -> 3 (part of 3)" in restoring
    assert "weights equal the uninterrupted run bit for bit" in out
    assert "rank 2: part of rank 0; rank 3: part of rank 1" in out
    if shm.is_dir():
        assert set(shm.glob("tierpoint-demo-*")) == before  # the demo removes what it wrote
    assert set(logs.glob("torchelastic_*")) == torchrun_logs  # torchrun's too


def test_a_failed_node_stops_the_other_nodes_job_instead_of_leaving_it_waiting() -> None:
    """torchrun on a node whose workers all succeeded waits 300 s at its exit barrier for a node
    that failed; the demo stops it after a grace period and reports the failure."""
    import time

    from tierpoint.demo import _wait_all

    start = time.monotonic()
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    codes = _wait_all([failed, waiting], grace=1)
    assert codes[0] == 3 and codes[1] != 0
    assert time.monotonic() - start < 30
