"""A small training job the tiered-manager tests run on several ranks: a model, AdamW, an LR
schedule, a per-rank RNG state and a data position, trained data-parallel over gloo."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierpoint import RankLocal


class RngHolder:
    """A stateful per-rank random generator (the data order), as a data loader would keep one."""

    def __init__(self, rank: int) -> None:
        self.generator = torch.Generator().manual_seed(100 + rank)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.generator.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.generator.set_state(sd["rng"])


def make_state(rank: int, width: int = 16) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)
    return {
        "model": model,
        "optimizer": optimizer,
        "schedule": schedule,
        "data": RankLocal(RngHolder(rank)),
        "position": {"samples": 0},
    }


def train_step(state: dict[str, Any], world: int) -> None:
    model, optimizer = state["model"], state["optimizer"]
    x = torch.randn(4, model[0].in_features, generator=state["data"].value.generator)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    optimizer.step()
    state["schedule"].step()
    state["position"]["samples"] += 4


def fingerprint(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a resumed job must have bit for bit: parameters, optimizer and schedule state,
    this rank's generator and the data position."""
    opt = state["optimizer"].state_dict()
    return {
        "params": [t.detach().clone() for t in state["model"].state_dict().values()],
        "moments": [
            v.clone() for s in opt["state"].values() for v in s.values() if torch.is_tensor(v)
        ],
        "lr": opt["param_groups"][0]["lr"],
        "schedule": state["schedule"].state_dict()["last_epoch"],
        "rng": state["data"].value.generator.get_state(),
        "position": dict(state["position"]),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list):
            assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y)), key
        elif torch.is_tensor(x):
            assert torch.equal(x, y), key
        else:
            assert x == y, key


def as_node(rank: int, ranks_per_node: int = 2) -> int:
    """Make this process count as node ``rank // ranks_per_node``; returns the node."""
    node = rank // ranks_per_node
    os.environ["TIERPOINT_NODE_ID"] = f"node{node}"
    return node


def wipe(path: str | Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


SLOW_WRITE = 0.3
"""Seconds :func:`slow_write_staged` waits before a persistent save's job reads anything."""


def slow_write_staged(*args: Any, **kwargs: Any) -> int:
    """The persistent tier's worker job, slowed down (the worker imports it from here)."""
    import time

    from tierpoint.dcp.jobs import write_staged

    time.sleep(float(os.environ.get("TEST_SLOW_WRITE", SLOW_WRITE)))
    return write_staged(*args, **kwargs)


def slow_down_persistent_writes() -> None:
    """Make this process's persistent saves run :func:`slow_write_staged` in the worker."""
    from tierpoint.dcp import writer

    writer.write_staged = slow_write_staged


def failing_write_staged(*args: Any, **kwargs: Any) -> int:
    """The persistent tier's worker job, failing (the worker imports it from here)."""
    raise OSError("the persistent store is gone")


def fail_persistent_writes() -> None:
    """Make this process's persistent saves fail in the worker."""
    from tierpoint.dcp import writer

    writer.write_staged = failing_write_staged


def failing_local_write(*args: Any, **kwargs: Any) -> int:
    """The local tier's worker job, failing as on a full RAM disk (imported by the worker)."""
    raise OSError(28, "No space left on device")


def fail_local_writes(monkeypatch: Any) -> None:
    """Make this process's local async saves fail in the worker (until ``monkeypatch`` undoes it)."""
    from tierpoint.local import saving

    monkeypatch.setattr(saving, "write_staged_part", failing_local_write)
    monkeypatch.setattr(saving, "seal_staged_part", failing_local_write)


def replica_warnings(run: Any) -> list[str]:
    """The WARNINGs naming values that differ between ranks, logged while ``run()`` runs."""
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tierpoint").addHandler(handler)
    try:
        run()
    finally:
        logging.getLogger("tierpoint").removeHandler(handler)
    return [m for m in warned if "differ between ranks" in m]
