"""DTensor descriptions read from a part file are untrusted: a description that cannot be rebuilt
here raises a tierpoint error, never one of torch's (1 gloo rank, a CPU-only process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierpoint import dtensors
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

DESCRIPTION = {
    "device_type": "cpu",
    "mesh": [0],
    "dim_names": None,
    "placements": [["replicate"]],
    "shape": [4],
    "stride": [1],
}
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA")
HOSTILE = [
    pytest.param({"placements": [["shard", 0]], "shape": [2**63 - 1]}, id="shard_of_int64_max"),
    pytest.param({"device_type": "cuda"}, id="cuda_mesh_without_cuda", marks=NO_CUDA),
]


def _rebuild(rank: int, world: int, changes: dict[str, Any]) -> str:
    try:
        dtensors.rebuild(torch.zeros(4), {**DESCRIPTION, **changes})
    except CheckpointingError as e:  # UnsupportedStateError: the device is not here
        return f"refused: {e}"
    except dtensors.SkeletonError as e:
        return f"refused: {e}"
    except Exception as e:  # noqa: BLE001 - what the test looks for
        return f"{type(e).__name__}: {e}"
    return "rebuilt"


def test_an_intact_description_rebuilds() -> None:
    assert run_ranks(_rebuild, 1, {}) == ["rebuilt"]


@pytest.mark.parametrize("changes", HOSTILE)
def test_a_description_that_cannot_be_rebuilt_here_is_refused(changes: dict[str, Any]) -> None:
    (outcome,) = run_ranks(_rebuild, 1, changes)
    assert outcome.startswith("refused: "), outcome
