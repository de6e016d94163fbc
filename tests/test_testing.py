"""tierpoint.testing.run_ranks: interrupted (a bench stopped by SIGTERM, a Ctrl-C), it stops its
ranks before the exception leaves it, so the caller's clean-up never races a rank still writing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_DRIVER = """
import signal, sys
from pathlib import Path
from tierpoint.testing import run_ranks
from tests.test_testing import _write_pid_and_sleep, _alive

out = Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
try:
    run_ranks(_write_pid_and_sleep, 2, out, timeout=120)
except SystemExit:
    pids = [int(p.read_text()) for p in out.glob("*.pid")]
    print("alive after run_ranks:", [pid for pid in pids if _alive(pid)], flush=True)
    raise
"""


def _write_pid_and_sleep(rank: int, world: int, out: Path) -> None:
    (out / f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(100)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_an_interrupted_run_stops_its_ranks_before_it_raises(tmp_path: Path) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'src'}"},
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(tmp_path.glob("*.pid"))) == 2, "the ranks did not start"
        driver.terminate()
        out, _ = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 3
    assert "alive after run_ranks: []" in out, out
    assert not [p for p in tmp_path.glob("*.pid") if _alive(int(p.read_text()))]
