"""How long tierpoint's collectives and waits may take: the default and the checks of a given value.

Call order: :func:`default_timeout` wherever a group or wait needs the job's timeout;
:func:`check_timeout` / :func:`timeout_or` on a user's ``timeout=`` argument.

Invariants: a timeout is a finite number of seconds > 0 (``TIERPOINT_TIMEOUT`` too, else a
:class:`CheckpointingError` naming it); nothing here runs a collective.
"""

from __future__ import annotations

import math
import numbers
import os
from datetime import timedelta

from ..errors import CheckpointingError

DEFAULT_TIMEOUT_S = 300.0
"""Timeout of tierpoint's collectives; override with ``TIERPOINT_TIMEOUT`` (seconds)."""


def default_timeout() -> timedelta:
    text = os.environ.get("TIERPOINT_TIMEOUT")
    if text is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise CheckpointingError(
            f"TIERPOINT_TIMEOUT must be a positive number of seconds, got {text!r}"
        )
    return timedelta(seconds=seconds)


def check_timeout(value: object) -> float:
    """``value`` as seconds, or ``TypeError`` / ``ValueError`` unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds (or None), got {type(value).__name__} {value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {value}")
    return float(value)


def timeout_or(value: object, default: float) -> float:
    """``value`` checked by :func:`check_timeout`, or ``default`` when it is ``None``."""
    return default if value is None else check_timeout(value)
