"""The training states of the fault suite: tiny, a pure function of (rank, step, job), so that any
restored state can be checked bit for bit against what the job that saved it saved.

A state has a tensor every rank shares (``w``), a rank-local tensor (``mine``, bfloat16), the job
number as a tensor (so that the parts of one step saved by two jobs are told apart) and the step.
"""

from __future__ import annotations

from typing import Any

import torch

from tierpoint import RankLocal

NUMEL = 4096
"""16 KiB of float32 shared + 2 KiB of bfloat16 per rank: trials stay cheap."""


def make_state(rank: int, step: int, job: int = 0) -> dict[str, Any]:
    """What ``job`` saves as ``rank``'s state at ``step`` (``step`` 0: a fresh template)."""
    shared = torch.Generator().manual_seed((job * 100_003 + step) * 2)
    own = torch.Generator().manual_seed(((job * 100_003 + step) * 64 + rank) * 2 + 1)
    return {
        "w": torch.randn(NUMEL, generator=shared),
        "mine": RankLocal(torch.randn(NUMEL // 4, generator=own).to(torch.bfloat16)),
        "job": torch.tensor(job),
        "step": step,
    }


def fingerprint(state: dict[str, Any]) -> dict[str, Any]:
    """What a restore must give back bit for bit (plain tensors and values)."""
    return {
        "w": state["w"].clone(),
        "mine": state["mine"].value.clone(),
        "job": int(state["job"]),
        "step": state["step"],
    }


def matches(state: dict[str, Any], rank: int, step: int) -> tuple[bool, int]:
    """Whether ``state`` is bit-equal to what its job saved as ``rank``'s ``step``; and that job."""
    from .corruptions import same

    job = int(state["job"])
    return same(fingerprint(state), fingerprint(make_state(rank, step, job))), job
