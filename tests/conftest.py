"""Shared test set-up. Multi-rank tests use :func:`tierpoint.testing.run_ranks`."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tierpoint import fileformat

logging.getLogger("tierpoint").setLevel(logging.DEBUG)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run first, so that parallel workers (``./run test`` runs several) end
    together rather than one finishing a long scenario alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def shm_dir():
    """A fresh directory on the /dev/shm tmpfs, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="tierpoint-test-", dir="/dev/shm"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["disk", "ram"])
def tier_root(request, tmp_path):
    """A node-local tier root on a disk file system (tmp_path) or on the /dev/shm tmpfs (removed
    afterwards): async saves stage through a memfd on the first and into the part files on the second."""
    if request.param == "disk":
        yield tmp_path
        return
    yield request.getfixturevalue("shm_dir")


def good_state() -> dict:
    """A small state whose part file the file-format tests know byte for byte."""
    return {
        "w": torch.arange(16, dtype=torch.float32).reshape(4, 4),  # data bytes 64..128
        "b": torch.arange(8, dtype=torch.int64),  # 0..64
        "z": torch.tensor([1 + 2j, -0.5j, 3.0], dtype=torch.complex64),  # 128..152, stored as U8
        "e": torch.empty(0),  # 128..128
        "step": 7,
    }


@pytest.fixture
def good_part(tmp_path: Path) -> Path:
    path = tmp_path / "rank0.part"
    fileformat.write(path, good_state())
    return path
