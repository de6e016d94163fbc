"""What the tiered manager reports: one record per save and per restore, and their summary.

Call order: the manager builds a :class:`SaveRecord` when it schedules a save and completes it when
the save is committed (or failed, also in its finalize steps: :func:`finalize_or_fail`), a
:class:`RestoreRecord` when a restore ends; each finished record goes to :meth:`EventLog.emit`,
which logs it at INFO, hands it to the user's ``on_event`` callback and keeps the counts behind
:meth:`EventLog.summary` (``manager.stats()``).

Invariants: a callback that raises is logged and otherwise ignored: monitoring never fails a save.
The log keeps sums and the last :data:`RECENT` values, never every record: a job saving every few
steps for days holds as much as one that just started.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..asyncsave.request import run_finalize_fns
from ..errors import error_text

logger = logging.getLogger("tierpoint")


def finalize_or_fail(
    fns: list[Callable[[], Any]],
    record: SaveRecord,
    committed: Callable[[], None],
    failed: Callable[[], None],
) -> Callable[[], None]:
    """A save's one finalize function: ``fns`` (as the queue runs them), then ``committed``. When
    one of them raises (a commit that failed on every rank: ``.metadata`` on a full disk), the
    queue runs no abort function; ``failed`` runs instead, ``record.error`` saying why, and the
    error goes on."""

    def run() -> None:
        try:
            run_finalize_fns(fns, record.tier + " save")
        except Exception as e:
            record.error = error_text(e)
            failed()
            raise
        committed()

    return run


@dataclass
class SaveRecord:
    """One save to one tier.

    ``phases`` holds seconds: ``snapshot`` or ``copy_from_local`` (what training waited for),
    ``write`` (the worker: write, hash, fsync and rename, or upload), ``replicate`` (this rank's
    copies to and from peers), ``commit`` (from this rank's part done to the commit on every rank:
    the slowest rank, the next poll, then ``.metadata`` or retirement), ``durable`` (from the
    request to the commit: observed when the manager finalizes, at the next ``maybe_save`` that
    polls, every ``poll_every`` steps or at a step due to save).
    The persistent retention that follows a commit runs on a thread of rank 0 and logs the steps it
    removed at INFO.
    """

    tier: str
    step: int
    bytes: int = 0
    ok: bool = True
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    kind: str = "save"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RestoreRecord:
    """The outcome of one restore: which step, from which tier (``"local"``, ``"peers"`` or
    ``"persistent"``; ``None`` when nothing was found), how long it took, how many bytes this rank
    loaded, and each newer step that was skipped with the reason."""

    step: int | None
    tier: str | None
    seconds: float
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    kind: str = "restore"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class EventLog:
    """Emits records and summarises them (see the module docstring)."""

    def __init__(self, on_event: Callable[[dict[str, Any]], Any] | None) -> None:
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable or None, got {on_event!r}")
        self.on_event = on_event
        self._tiers: dict[str, _TierSums] = {}
        self._restores: deque[RestoreRecord] = deque(maxlen=RECENT)

    def emit(self, record: SaveRecord | RestoreRecord) -> None:
        if isinstance(record, SaveRecord):
            self._tiers.setdefault(record.tier, _TierSums()).add(record)
            phases = " ".join(f"{k}={v:.3f}s" for k, v in record.phases.items())
            outcome = "ok" if record.ok else f"FAILED ({record.error})"
            logger.info(
                "tiered save: %s step %d %s, %d bytes, %s",
                record.tier,
                record.step,
                outcome,
                record.bytes,
                phases,
            )
        else:
            self._restores.append(record)
            logger.info(
                "tiered restore: step %s from %s in %.3f s (%d bytes)%s",
                record.step,
                record.tier,
                record.seconds,
                record.bytes,
                f"; skipped: {'; '.join(record.skipped)}" if record.skipped else "",
            )
        if self.on_event is not None:
            try:
                self.on_event(record.as_dict())
            except Exception:  # noqa: BLE001 - monitoring never fails a save
                logger.exception("the on_event callback raised (ignored)")

    def summary(self) -> dict[str, Any]:
        """Counts, blocking time per save and time to durable, per tier (medians of the last
        :data:`RECENT` saves; counts, maxima and totals of every save), and the last restores."""
        return {
            "tiers": {tier: self._tiers[tier].summary() for tier in sorted(self._tiers)},
            "restores": [r.as_dict() for r in self._restores],
        }


BLOCKING_PHASES = ("snapshot", "copy_from_local")
"""The phases of a save that the training loop waits for."""

RECENT = 1000
"""Saves per tier whose times the summary's medians are taken over, and restores it lists: a
job saving every few steps for days keeps sums, not every record."""


class _Spread:
    """Maximum and total of every value, median of the last :data:`RECENT`."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.max = 0.0
        self.total = 0.0

    def add(self, value: float) -> None:
        self.max = value if not self.recent else max(self.max, value)
        self.total += value
        self.recent.append(value)

    def summary(self) -> dict[str, float]:
        if not self.recent:
            return {"median": 0.0, "max": 0.0, "total": 0.0}
        return {"median": statistics.median(self.recent), "max": self.max, "total": self.total}


class _TierSums:
    """What the summary says of one tier's saves, kept as they are emitted."""

    def __init__(self) -> None:
        self.saves = self.failed = self.bytes = 0
        self.blocking = _Spread()
        self.durable = _Spread()

    def add(self, record: SaveRecord) -> None:
        self.saves += 1
        self.blocking.add(sum(record.phases.get(p, 0.0) for p in BLOCKING_PHASES))
        if not record.ok:
            self.failed += 1
            return
        self.bytes += record.bytes
        if "durable" in record.phases:
            self.durable.add(record.phases["durable"])

    def summary(self) -> dict[str, Any]:
        return {
            "saves": self.saves,
            "failed": self.failed,
            "bytes": self.bytes,
            "blocking_s": self.blocking.summary(),
            "durable_s": self.durable.summary(),
        }
