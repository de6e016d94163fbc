"""Shared test set-up. Multi-rank tests use :func:`tierpoint.spawn.run_ranks`."""

import logging
import shutil
import tempfile
from pathlib import Path

import pytest

logging.getLogger("tierpoint").setLevel(logging.DEBUG)


@pytest.fixture(params=["disk", "ram"])
def tier_root(request, tmp_path):
    """A node-local tier root on a disk file system (tmp_path) or on the /dev/shm tmpfs (removed
    afterwards): async saves stage through a memfd on the first and into the part files on the second."""
    if request.param == "disk":
        yield tmp_path
        return
    root = Path(tempfile.mkdtemp(prefix="tierpoint-test-", dir="/dev/shm"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
