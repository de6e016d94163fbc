"""What the tiered manager reports: one record per save and per restore, and their summary.

Call order: the manager builds a :class:`SaveRecord` when it schedules a save and completes it when
the save is committed (or failed, also in its finalize steps: :func:`finalize_or_fail`), a
:class:`RestoreRecord` when a restore ends; each finished record goes to :meth:`EventLog.emit`,
which logs it at INFO, hands it to the user's ``on_event`` callback and keeps the counts behind
:meth:`EventLog.summary` (``manager.stats()``).

Invariant: a callback that raises is logged and otherwise ignored: monitoring never fails a save.
"""

from __future__ import annotations

import logging
import statistics
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
    request to the commit: observed when the manager finalizes, at the next ``maybe_save``).
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
        self._saves: list[SaveRecord] = []
        self._restores: list[RestoreRecord] = []

    def emit(self, record: SaveRecord | RestoreRecord) -> None:
        if isinstance(record, SaveRecord):
            self._saves.append(record)
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
        """Counts, blocking time per save and time to durable, per tier (medians and maxima)."""
        tiers: dict[str, Any] = {}
        for tier in sorted({r.tier for r in self._saves}):
            records = [r for r in self._saves if r.tier == tier]
            done = [r for r in records if r.ok]
            tiers[tier] = {
                "saves": len(records),
                "failed": len(records) - len(done),
                "bytes": sum(r.bytes for r in done),
                "blocking_s": _spread([_blocking(r) for r in records]),
                "durable_s": _spread([r.phases["durable"] for r in done if "durable" in r.phases]),
            }
        return {
            "tiers": tiers,
            "restores": [r.as_dict() for r in self._restores],
        }


BLOCKING_PHASES = ("snapshot", "copy_from_local")
"""The phases of a save that the training loop waits for."""


def _blocking(record: SaveRecord) -> float:
    return sum(record.phases.get(phase, 0.0) for phase in BLOCKING_PHASES)


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": 0.0, "max": 0.0, "total": 0.0}
    return {"median": statistics.median(values), "max": max(values), "total": sum(values)}
