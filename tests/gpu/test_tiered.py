"""TieredCheckpointManager with a CUDA model and optimizer, as a training job runs it: local and
persistent saves on schedule (the persistent copy written from the held local part), plain,
overlapped and device snapshots; the state restores bit for bit onto the device from the local
tier, then, with the local tier gone, from the persistent tier."""

from __future__ import annotations

import shutil
import warnings
from typing import Any

import pytest
import torch

from tierpoint import TieredCheckpointManager

from .helpers import DEVICE, assert_same, cuda_still_works, needs_gpu

pytestmark = needs_gpu
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SNAPSHOTS = {
    "plain": {},
    "overlap": {"overlap_snapshot": True},
    "device": {"overlap_snapshot": True, "device_snapshot": True},
}


def _job(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)
    ).to(DEVICE)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def _train(state: dict[str, Any]) -> None:
    x = torch.randn(32, 64, device=DEVICE)
    loss = state["model"](x).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()


def _fingerprint(state: dict[str, Any]) -> dict[str, Any]:
    optimizer = state["optimizer"].state_dict()["state"]
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "moments": {
            f"{i}.{k}": v.clone()
            for i, s in optimizer.items()
            for k, v in s.items()
            if torch.is_tensor(v)
        },
    }


@pytest.mark.parametrize("snapshot", list(SNAPSHOTS))
def test_a_cuda_training_state_restores_bit_for_bit_from_each_tier(shm_dir, tmp_path, snapshot):
    local, persistent = shm_dir / "local", tmp_path / "persistent"

    def manager(**options: Any) -> TieredCheckpointManager:
        return TieredCheckpointManager(
            str(local), str(persistent), "job", local_every=2, persistent_every=4, **options
        )

    state = _job(0)
    with manager(**SNAPSHOTS[snapshot]) as saving:
        for step in range(1, 9):
            _train(state)
            saving.maybe_save(step, state)
            if step == 8:
                expected = _fingerprint(state)
            _train(state)  # the state moves on while the saves are in flight
    tiers = saving.stats()["tiers"]  # (every save committed by close)
    assert [(tiers[t]["saves"], tiers[t]["failed"]) for t in ("local", "persistent")] == [
        (4, 0),
        (2, 0),
    ], tiers
    for tier in ("local", "persistent"):
        restored = _job(1)
        _train(restored)  # its optimizer state exists, with other values
        with manager() as restoring:
            assert restoring.restore(restored) == 8
            assert restoring.last_restore.tier == tier
        assert_same(_fingerprint(restored), expected)
        if tier == "local":
            shutil.rmtree(local)  # the next restore finds the persistent tier alone
    cuda_still_works()
