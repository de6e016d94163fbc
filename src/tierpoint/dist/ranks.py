"""This process's place in the job: distributed or not, its rank and the world size.

Call order: any time; :func:`get_rank` / :func:`get_world_size` answer rank 0 of 1 when
``torch.distributed`` is not initialised, after :func:`refuse_uninitialised_launch` made sure no
launcher started several processes. :func:`log_progress` speaks as rank 0 (INFO) or another (DEBUG).

Invariants: nothing here runs a collective; a multi-process launch without an initialised process
group is refused, never treated as a single process.
"""

from __future__ import annotations

import logging
import os
import time

import torch.distributed as dist

from ..errors import CheckpointingError

_logger = logging.getLogger("tierpoint")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    if is_distributed():
        return dist.get_rank()
    refuse_uninitialised_launch()
    return 0


def get_world_size() -> int:
    if is_distributed():
        return dist.get_world_size()
    refuse_uninitialised_launch()
    return 1


def log_progress(what: str, nbytes: int, start: float) -> None:
    """One progress line for an operation that moved ``nbytes`` since ``time.perf_counter()`` was
    ``start``: INFO on rank 0, DEBUG on the others (one line per operation, not per rank)."""
    seconds = max(time.perf_counter() - start, 1e-9)
    level = logging.INFO if get_rank() == 0 else logging.DEBUG
    _logger.log(
        level,
        "%s: %.1f MiB in %.3f s, %.2f GB/s",
        what,
        nbytes / 2**20,
        seconds,
        nbytes / seconds / 1e9,
    )


def refuse_uninitialised_launch() -> None:
    """A launcher (torchrun, ...) started several processes but ``torch.distributed`` is not
    initialised: as "rank 0 of 1" every process would write the same files, so refuse."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise CheckpointingError(
            f"WORLD_SIZE={launched} is set but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() before using tierpoint (after "
            "destroy_process_group(), make new managers and queues once a new group is up; or "
            "unset WORLD_SIZE for a single-process job)"
        )
