"""Phase tracing and phase-aimed SIGKILLs for the fault suite, in a rank's training process and in
its background worker (this directory is put on the rank's ``sys.path``: the worker inherits it as
``PYTHONPATH`` and its ``sitecustomize`` installs this module there).

Configured by the environment variable ``TIERPOINT_FAULT_PHASES`` (JSON)::

    {"log": "<dir>", "kill": {"phase": "local.fsync", "nth": 3, "rank": 1, "scope": "rank"}}

Every process of a rank appends ``<rank> <role> <phase> <count>`` lines to ``<log>/phases-<pid>``
(plain writes: a SIGKILL loses none). Phases, from file-system events (an audit hook and a wrapped
``os.fsync``) and from the tiered manager's own steps (wrapped by :func:`install_trainer`):

- ``snapshot`` (the save's copy, on the training thread), ``restore`` (every file read while
  restoring);
- ``local.write`` / ``persistent.write`` (a part or a ``.distcp`` / manifest opened for writing:
  the persistent one is the upload), ``local.fsync`` / ``persistent.fsync``, ``local.rename``
  (torch DCP writes its data files in place: the persistent tier's only rename is ``.metadata``'s,
  part of ``persistent.commit``; ``persistent.rename`` is noted if one ever appears, but is not in
  :data:`PHASES`, the phases a kill is aimed at);
- ``local.replicate`` (a part exchanged with the peer), ``local.commit`` (the local commit on every
  rank), ``persistent.commit`` (``.metadata`` written, markers removed);
- ``local.cleanup`` (retired parts removed or kept as spares), ``persistent.cleanup`` (retention of
  old steps).

With ``kill``: when the process of rank ``rank`` enters ``phase`` for the ``nth`` time it writes
a ``kill`` line, then SIGKILLs its rank (``scope`` ``rank``: the training process, whose worker dies
with it) or the whole job (``job``: the process group the job made itself), or SIGSTOPs its rank
(``stop``: the training process, and the worker when it is the one that entered the phase).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

ENV = "TIERPOINT_FAULT_PHASES"
PHASES = (
    "snapshot",
    "local.write",
    "local.fsync",
    "local.rename",
    "local.replicate",
    "local.commit",
    "local.cleanup",
    "persistent.write",
    "persistent.fsync",
    "persistent.commit",
    "persistent.cleanup",
    "restore",
)

_state: dict[str, Any] = {}


def _config() -> dict[str, Any] | None:
    raw = os.environ.get(ENV)
    return json.loads(raw) if raw else None


def enter(phase: str) -> None:
    """Note that this process entered ``phase``; kill here if configured to."""
    if not _state:
        return
    counts = _state["counts"]
    counts[phase] = counts.get(phase, 0) + 1
    line = f"{_state['rank']} {_state['role']} {phase} {counts[phase]} {time.time():.6f}\n"
    os.write(_state["fd"], line.encode())
    kill = _state["kill"]
    if (
        kill
        and kill["phase"] == phase
        and kill["nth"] == counts[phase]
        and kill["rank"] == _state["rank"]
    ):
        note = f"{_state['rank']} {_state['role']} kill {phase} 0 {time.time():.6f}\n"
        os.write(_state["fd"], note.encode())
        if kill["scope"] == "job":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        how = signal.SIGSTOP if kill["scope"] == "stop" else signal.SIGKILL
        trainer = os.getpid() if _state["role"] == "trainer" else os.getppid()
        os.kill(trainer, how)
        os.kill(os.getpid(), how)


def _tier(path: str) -> str | None:
    name = os.path.basename(path)
    if "_local.safetensors" in name or name.startswith("spare_"):
        return "local"
    if ".distcp" in name or name.startswith((".checksums-", ".metadata", ".unfinished-")):
        return "persistent"
    return None


def _audit(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = args
        if not isinstance(path, str):
            return
        tier = _tier(path)
        if tier is None:
            return
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        if not writing:
            if _state.get("restoring"):
                enter("restore")
            return
        _state["tier"] = tier
        if tier == "persistent" and ".metadata" in os.path.basename(path):
            enter("persistent.commit")
        else:
            enter(f"{tier}.write")
    elif event == "os.rename":
        src, dst = str(args[0]), str(args[1])
        tier = _tier(dst) or _tier(src)
        if tier is None:
            return
        if os.path.basename(dst).startswith("spare_"):
            enter("local.cleanup")
        elif ".metadata" in os.path.basename(dst):
            enter("persistent.commit")
        else:
            enter(f"{tier}.rename")
    elif event == "os.remove":
        path = str(args[0])
        tier = _tier(path)
        if tier == "persistent" and os.path.basename(path).startswith(".unfinished-"):
            enter("persistent.commit")
        elif tier is not None:
            enter(f"{tier}.cleanup")


def _fsync(fd: Any, _original: Any = os.fsync) -> None:
    tier = _state.get("tier")
    if tier is not None:
        enter(f"{tier}.fsync")
    _original(fd)


def install(role: str) -> bool:
    """Trace this process (``role``: ``trainer`` or ``worker``) when configured; idempotent."""
    config = _config()
    if config is None or _state:
        return False
    path = os.path.join(config["log"], f"phases-{os.getpid()}")
    _state.update(
        role=role,
        rank=int(os.environ.get("RANK", "0")),
        kill=config.get("kill"),
        counts={},
        fd=os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT),
    )
    sys.addaudithook(_audit)
    os.fsync = _fsync
    return True


def install_trainer(hooks_dir: str) -> None:
    """In a rank's training process: trace it and, through ``sys.path``, its worker; wrap the
    tiered manager's own phases."""
    if hooks_dir not in sys.path:
        sys.path.insert(0, hooks_dir)
    if not install("trainer"):
        return
    from tierpoint.local.saving import PartSaver
    from tierpoint.tiered import manager as tiered
    from tierpoint.tiered import saving

    def wrap(owner: Any, name: str, phase: str, flag: str | None = None) -> None:
        original = getattr(owner, name)

        def traced(*args: Any, **kwargs: Any) -> Any:
            enter(phase)
            if flag is not None:
                _state[flag] = True
            try:
                return original(*args, **kwargs)
            finally:
                if flag is not None:
                    _state[flag] = False

        setattr(owner, name, traced)

    wrap(tiered.TieredCheckpointManager, "_save_local", "snapshot")
    wrap(tiered.TieredCheckpointManager, "restore", "restore", flag="restoring")
    wrap(saving, "retire_persistent_steps", "persistent.cleanup")
    wrap(PartSaver, "replicate", "local.replicate")
    wrap(PartSaver, "commit", "local.commit")
