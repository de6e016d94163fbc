"""tierpoint's coordination group, and every collective run bounded: a timeout or a vanished peer
becomes one clear error that names the silent ranks where it can.

Call order: :func:`coordination_group` (lazily, once per default process group, on every rank at
the same call site); then every collective through :func:`run_collective` (``what`` names the
step). After a failure the group is marked broken: later collectives on it fail at once.

Invariants:
- The coordination group is a separate gloo group (also when the default group is NCCL): tierpoint
  never issues collectives on the training group, so background saves cannot deadlock training.
- A timeout raises :class:`CoordinationTimeoutError` (naming the ranks that did not report
  themselves alive through the job's store within a short grace), any other collective failure a
  :class:`CheckpointingError`; never a hang, never a raw ``RuntimeError``.
- :func:`step_kind` keeps only what all ranks at the same step share (no numbers, no paths).
- A gloo group tierpoint replaces or stops using is freed (:func:`destroy_group`): torch keeps
  every group it made until it is destroyed, each holding sockets and threads to every peer.
- Every gloo group tierpoint keeps is named to :func:`drop_at_exit`: a gloo group freed while the
  interpreter shuts down can abort the process (``terminate called without an active
  exception``, SIGABRT, which torchrun reports as a failed job), so tierpoint's references to
  them go at exit, while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import gc
import re
import threading
import time
import weakref
import zlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointingError, CoordinationTimeoutError
from .ranks import is_distributed
from .timeouts import default_timeout

_groups: dict[int, Any] = {}
_broken: dict[int, tuple[Any, str]] = {}  # id(group) -> (the group, kept alive; what failed)
_registries: list[dict] = [_groups, _broken]  # cleared at exit
_holders: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def drop_at_exit(holder: Any, *attributes: str) -> None:
    """Have tierpoint's references to gloo groups dropped at exit (see the module docstring):
    ``holder`` is a dict of them (cleared), or an object whose ``attributes`` hold them (set to
    ``None``; the object is held weakly)."""
    if isinstance(holder, dict):
        if not any(holder is r for r in _registries):
            _registries.append(holder)
    else:
        _holders.setdefault(holder, set()).update(attributes)


@atexit.register
def _drop_groups() -> None:
    for holder, attributes in list(_holders.items()):
        for name in attributes:
            setattr(holder, name, None)
    for registry in _registries:
        registry.clear()
    gc.collect()


def destroy_group(group: Any) -> None:
    """Free a gloo group tierpoint made and no longer uses: its sockets, threads and mappings
    (a group torch still lists is never freed otherwise). Local, not collective; an operation still
    in flight on it on another thread ends with its timeout. Quiet when it is gone already."""
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError, AssertionError):  # destroyed already, or torch's world gone
        pass


_SILENT_GRACE_S = 3.0


def coordination_group(timeout: timedelta | None = None) -> Any:
    """tierpoint's dedicated gloo group (``None`` when not distributed). Collective on first call."""
    if not is_distributed():
        return None
    key = id(dist.distributed_c10d._get_default_group())
    group = _groups.get(key)
    if group is None:
        group = run_collective(
            "creating tierpoint's coordination group",
            dist.new_group,
            backend="gloo",
            timeout=timeout or default_timeout(),
        )
        _groups[key] = group
    return group


def run_collective(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a collective on ``kwargs["group"]``), its failure as tierpoint's error."""
    group = kwargs.get("group")
    broken = _broken.get(id(group)) if group is not None else None
    if broken is not None:
        raise CheckpointingError(
            f"{what}: tierpoint's coordination group failed earlier ({broken[1]}) and a gloo group "
            "does not recover: restart the job (it resumes from the latest complete checkpoint)"
        )
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:  # gloo reports timeouts and dead peers as these
        text = str(e)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        who = ""
        if timed_out:
            silent = silent_ranks(what, group)
            if silent:
                names = "rank " if len(silent) == 1 else "ranks "
                ranks = ", ".join(map(str, silent))
                who = (
                    f"; no word from {names}{ranks} (stopped, too slow, or in another call: "
                    "every rank makes the same collective calls, polls included)"
                )
        if group is not None:  # a later call on the group names the silent ranks too
            _broken[id(group)] = (group, f"{what}{who}: {_first_line(text)}"[:300])
        if timed_out:
            raise CoordinationTimeoutError(
                f"{what}: ranks did not all arrive within the timeout{who} ({_first_line(text)})"
            ) from e
        raise CheckpointingError(
            f"{what}: collective failed, a peer rank is probably gone ({_first_line(text)})"
        ) from e


def silent_ranks(what: str, group: Any) -> list[int]:
    """After a collective on ``group`` timed out: the ranks that did not report themselves alive
    through the job's store within a short grace (gloo's timeout does not say who is missing).
    Only on this failure path: one key per rank, read back rank by rank. ``[]`` when unknown.

    The store may be silent itself: a job launched with env:// has rank 0 host it, and a stopped
    rank 0 answers no request, each of which then waits for the store's own timeout (30 minutes
    by default). So the store is asked on a thread, waited for a little longer than the grace;
    once it did not answer in time it is not asked again."""
    global _store_silent
    if _store_silent:
        return []
    found: list[list[int]] = []
    asking = threading.Thread(
        target=lambda: found.append(_ask_store(what, group)),
        name="tierpoint-silent-ranks",
        daemon=True,
    )
    asking.start()
    asking.join(_SILENT_GRACE_S + _STORE_SLACK_S)
    if not found:
        _store_silent = True
        return []
    return found[0]


_STORE_SLACK_S = 2.0
"""Seconds past the grace that the store's answers may take before it counts as silent."""
_store_silent = False
"""The job's store did not answer in time after a timeout (see :func:`silent_ranks`)."""


def _ask_store(what: str, group: Any) -> list[int]:
    """:func:`silent_ranks`' question to the job's store."""
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        if not ranks:
            ranks = list(range(dist.get_world_size()))
        step = zlib.crc32(f"{step_kind(what)}|{ranks}".encode()) & 0x7FFFFFFF
        prefix = f"tierpoint/alive/{step}/"
        store.set(prefix + str(dist.get_rank()), "1")
        missing = list(ranks)
        deadline = time.monotonic() + _SILENT_GRACE_S
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([prefix + str(r)])]
            if missing:
                time.sleep(0.1)
        return missing
    except Exception:  # noqa: BLE001 - naming the silent ranks is a courtesy; the timeout stands
        return []


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else "no detail"


def step_kind(what: str) -> str:
    """The kind of step ``what`` names: numbers and paths may differ between ranks (node-local
    directories, iterations they disagree on: the callers check those with a better message)."""
    return re.sub(r"\d+", "N", re.sub(r"\S*[/\\]\S*", "<path>", what))
