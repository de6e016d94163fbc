"""A small real tmpfs mounted for a test, to fill a disk for real (needs root; skips otherwise)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, size: str = "1m") -> Iterator[Path]:
    mount_point.mkdir(parents=True, exist_ok=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode:
            # busy (a mapping not collected yet): detached now, freed once its last user is gone
            subprocess.run(["umount", "-l", str(mount_point)], check=False)
