"""Fixtures of the Checkpointer tests: a small model, optimizer and scheduler, and a Checkpointer."""

from __future__ import annotations

import pytest
import torch

from tierpoint import BasicTrainModule, Checkpointer


def trained_module(seed: int = 0) -> BasicTrainModule:
    """A Linear with AdamW state after one step, and a StepLR that has stepped once."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    model(torch.randn(2, 6)).sum().backward()
    optim.step()
    scheduler.step()
    return BasicTrainModule(model, optim, scheduler)


def fresh_module(seed: int = 1) -> BasicTrainModule:
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return BasicTrainModule(model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=1))


@pytest.fixture
def checkpointer(tmp_path) -> Checkpointer:
    return Checkpointer(work_dir=tmp_path / "work")
