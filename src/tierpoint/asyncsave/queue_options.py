"""The constructor arguments of :class:`~tierpoint.asyncsave.AsyncCallsQueue`, checked before its
worker starts.

NVRx's arguments are accepted as NVRx names them. Three change nothing but must be bools:
``persistent`` (the worker is always a persistent process); ``is_daemon`` (NVRx: start its worker
as a daemon process, so that it dies with the trainer but cannot start children; tierpoint's worker
always dies with its trainer (a pidfd watch, else ``PR_SET_PDEATHSIG``) and may start children); ``cpu_shm_mode``
(NVRx: stage into CPU shared memory and keep CUDA out of the worker; tierpoint always does).
``cpu_priority`` (0-19) and ``io_priority`` (0-3) are the worker's nice value and I/O class.
tierpoint's own: ``max_in_flight`` (an int >= 1).

Call order: the queue calls these checks first in its constructor. Invariant: a wrong argument
raises ``TypeError`` or ``ValueError`` naming it, before anything is started.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from .. import dist as tpdist


def checked_arguments(
    nvrx_flags: Mapping[str, object],
    overlap_snapshot: object,
    cpu_priority: object,
    io_priority: object,
    sigterm_timeout: object,
    max_in_flight: object,
) -> tuple[int | None, int | None, float, int]:
    """Check the queue's arguments in the order they are listed (``nvrx_flags``: NVRx's bools by
    name); returns ``(cpu_priority, io_priority, sigterm_timeout, max_in_flight)`` as the queue
    keeps them."""
    for name, flag in (*nvrx_flags.items(), ("overlap_snapshot", overlap_snapshot)):
        check_bool(name, flag)
    return (
        check_priority("cpu_priority", cpu_priority, 19),
        check_priority("io_priority", io_priority, 3),
        tpdist.timeout_or(sigterm_timeout, 30.0),
        check_max_in_flight(max_in_flight),
    )


def check_bool(name: str, value: object) -> None:
    """``value`` must be a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_priority(name: str, value: object, highest: int) -> int | None:
    """``None``, or an int from 0 to ``highest``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    if not 0 <= value <= highest:
        raise ValueError(f"{name} must be between 0 and {highest}, got {value}")
    return int(value)


def check_max_in_flight(value: object) -> int:
    """An int >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"max_in_flight must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {value}")
    return int(value)
