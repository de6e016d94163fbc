"""``tierpoint ls``: every checkpoint under a path, its step, tier, ranks, replicas, size, age and
status, and the newest restorable one.

Call order: :func:`cmd_ls` classifies the path (:mod:`tierpoint.cli.locate`), builds one
:class:`Row` per checkpoint (:func:`local_rows` for the local tier, :func:`dcp_rows` for DCP steps),
then prints a table or JSON. ``verify`` and ``convert`` reuse the row builders.

Invariants: only headers, listings, DCP metadata and ``.metadata.json`` are read (``verify`` reads
every byte); a status is ``complete``, ``incomplete`` (never committed, ranks missing) or
``corrupt`` with the reason in ``detail``. An OLMo-core step is complete only when the
Checkpointer's discovery takes it and each rank's trainer state is there
(:mod:`tierpoint.cli.olmo`). In one rank's directory of the local tier, an iteration whose other
ranks' parts are in the session's other directories gets the session's status (the detail says
so); its ranks, replicas and size are the directory's.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import rank_ranges
from ..errors import CheckpointingError
from .locate import (
    Entry,
    classify,
    find_dcp_dir,
    join_url,
    list_entries,
    step_number,
    store_options,
)
from .olmo import step_status
from .output import CommandError, human_age, human_size, make_console, make_table, print_json

_DATA_FILE = re.compile(r"^__([0-9]+)_[0-9]+(?:\.[0-9a-f]+)?\.distcp$")


@dataclass
class Row:
    """One checkpoint as ``ls`` shows it."""

    tier: str
    where: str
    step: int | None
    """None: a DCP checkpoint directory not named after a step (shown as ``-``; JSON null)."""
    ranks: list[int]
    world_size: int | None
    replicas: int
    size: int
    mtime: float | None
    status: str
    detail: str = ""
    path: str = ""


def cmd_ls(args: argparse.Namespace) -> int:
    """``tierpoint ls``: a table (or JSON) of the checkpoints under ``args.path``; 0 on success."""
    options = store_options(args)
    path = args.path
    kind, entries = classify(path, options)
    if kind == "part":
        raise CommandError(f"{path}: a file; `tierpoint inspect` shows one part file")
    rows = local_rows(path) if kind == "local" else dcp_rows(path, kind, entries, options)
    newest: dict[str, Row] = {}
    for row in rows:
        if row.status == "complete" and (
            row.where not in newest or _order(row) > _order(newest[row.where])
        ):
            newest[row.where] = row
    if args.json:
        print_json(
            {
                "path": path,
                "checkpoints": [asdict(r) for r in rows],
                "newest_restorable": {w: r.path for w, r in newest.items()},
            }
        )
        return 0
    console = make_console()
    if not rows:
        console.print(f"{path}: no checkpoints")
        return 0
    columns = ["where", "step", "tier", "ranks", "replicas", "size", "age", "status"]
    table_rows = [
        (
            r.where,
            _step_text(r),
            r.tier,
            _ranks_text(r),
            r.replicas if r.tier == "local" else "-",
            human_size(r.size),
            human_age(r.mtime),
            r.status + (f": {r.detail}" if r.detail else ""),
        )
        for r in rows
    ]
    console.print(make_table(f"checkpoints under {path}", columns, table_rows))
    for where in dict.fromkeys(r.where for r in rows):
        found = newest.get(where)
        unit = "iteration" if found and found.tier == "local" else "step"
        text = f"{found.tier} {unit} {_step_text(found)}: {found.path}" if found else "none"
        console.print(f"newest restorable ({where}): {text}")
    return 0


def _order(row: Row) -> int:
    return -1 if row.step is None else row.step


def _step_text(row: Row) -> str:
    return "-" if row.step is None else str(row.step)


def _ranks_text(row: Row) -> str:
    """``present/world`` where the world size is known; else how many ranks wrote files when they
    are ``0..n-1`` (a DCP step of ``n`` ranks), or which ranks did, as runs (``0-5,7``)."""
    if row.world_size is not None:
        return f"{len(row.ranks)}/{row.world_size}"
    if not row.ranks:
        return "-"
    if row.ranks == list(range(len(row.ranks))):
        return str(len(row.ranks))
    return rank_ranges.text(row.ranks)


def local_rows(root: str) -> list[Row]:
    """Every iteration of every session under a local-tier root, session or rank directory."""
    from ..local.naming import parse_part_name

    base = Path(root)
    subdirs = sorted(p for p in base.iterdir() if p.is_dir())

    def holds(directory: Path) -> bool:
        return any(parse_part_name(n) is not None for n in os.listdir(directory))

    if holds(base):  # a rank's directory: its parts, each iteration judged with the session's
        return _rank_dir_rows(base)
    holders = [p for p in subdirs if holds(p)]
    rows = _session_rows(base.name, holders) if holders else []  # a session's directory
    for session in (p for p in subdirs if p not in holders):  # a root of sessions
        rows += _session_rows(session.name, sorted(p for p in session.iterdir() if p.is_dir()))
    return rows


def _rank_dir_rows(rank_dir: Path) -> list[Row]:
    """The iterations with parts in one rank's directory: ranks, replicas and size of the parts
    there; the status of an iteration whose other ranks' parts are elsewhere is the session's (its
    sibling rank directories' headers read too), said in the detail."""
    from ..local.naming import parse_part_name

    here = _session_rows(rank_dir.parent.name, [rank_dir])
    siblings = [
        p
        for p in sorted(rank_dir.parent.iterdir())
        if p.is_dir() and any(parse_part_name(n) is not None for n in os.listdir(p))
    ]
    session = {r.step: r for r in _session_rows(rank_dir.parent.name, siblings)}
    for row in here:
        whole = session.get(row.step)
        if row.status != "incomplete" or whole is None:
            continue
        row.status = whole.status
        if whole.status == "complete":
            row.detail = f"one rank's directory: the other ranks' parts are in {rank_dir.parent}"
        else:
            row.detail = f"one rank's directory; with the session {rank_dir.parent}: {whole.detail}"
    return here


def _session_rows(session: str, holders: Sequence[Path]) -> list[Row]:
    from ..local.naming import parse_part_name, part_metadata

    files: dict[int, list[tuple[int, Path]]] = {}
    for holder in holders:
        for name in os.listdir(holder):
            parsed = parse_part_name(name)
            if parsed is not None:
                files.setdefault(parsed[0], []).append((parsed[1], holder / name))
    rows = []
    for iteration in sorted(files, reverse=True):
        present: dict[int, int] = {}  # origin rank -> good copies
        worlds: set[int] = set()
        damaged: dict[int, str] = {}  # origin rank -> a damaged copy and why
        saves: dict[str, set[int]] = {}  # save token -> the origin ranks it has a good copy of
        size, mtime = 0, 0.0
        for origin, path in files[iteration]:
            try:
                st = path.stat()
                meta = part_metadata(path, iteration, origin)
            except (OSError, CheckpointingError) as e:
                damaged.setdefault(origin, f"{path}: {e}")
                continue
            worlds.add(meta["world_size"])
            saves.setdefault(str(meta.get("save")), set()).add(origin)
            present[origin] = present.get(origin, 0) + 1
            size, mtime = size + st.st_size, max(mtime, st.st_mtime)
        world = next(iter(worlds)) if len(worlds) == 1 else None
        missing = sorted(set(range(world)) - set(present)) if world is not None else []
        if len(worlds) > 1:
            status, detail = "corrupt", f"parts disagree on the world size: {sorted(worlds)}"
        elif lost := sorted(set(damaged) - set(present)):  # no good copy of these ranks
            status, detail = "corrupt", f"rank {lost[0]}'s part damaged: {damaged[lost[0]]}"
        elif missing:
            status, detail = "incomplete", f"missing ranks {missing}"
        elif newest_whole_save(saves, range(world or 0)) is None:  # as the manager refuses it
            status, detail = (
                "incomplete",
                (
                    f"its parts come from {len(saves)} saves of this iteration and none holds every "
                    "rank's (a node back with an earlier save's parts)"
                ),
            )
        else:
            status = "complete"
            detail = f"damaged copies of ranks {sorted(damaged)} ignored" if damaged else ""
        rows.append(
            Row(
                tier="local",
                where=session,
                step=iteration,
                ranks=sorted(present),
                world_size=world,
                replicas=sum(present.values()) - len(present),
                size=size,
                mtime=mtime or None,
                status=status,
                detail=detail,
                path=str(holders[0].parent) if holders else "",
            )
        )
    return rows


def newest_whole_save(saves: dict[str, set[int]], ranks: Iterable[int]) -> str | None:
    """The newest save token (tokens sort by time) with a good copy of the part of every rank
    of ``ranks``: an iteration is loaded from one save's parts only, never from two."""
    wanted = set(ranks)
    whole = [save for save, origins in saves.items() if origins >= wanted]
    return max(whole) if whole else None


def dcp_rows(path: str, kind: str, entries: dict[str, Entry], options: Any) -> list[Row]:
    """One row per step of a DCP base, newest first, or the row of one DCP or OLMo-core step."""
    if kind in ("dcp-step", "olmo-step"):
        return [_step_row(path, path, entries, options)]
    from ..dcp import step_dirs

    steps = {
        n: step for n, e in entries.items() if e.is_dir and (step := step_number(n)) is not None
    }
    outside = step_dirs.sibling_markers(list(entries))  # ML Flashpoint's, next to the directories
    return [
        _step_row(path, join_url(path, name), None, options, outside.get(name, []))
        for name in sorted(steps, key=steps.__getitem__, reverse=True)
    ]


def _step_row(
    where: str,
    step_dir: str,
    entries: dict[str, Entry] | None,
    options: Any,
    sibling_markers: Sequence[int] = (),
) -> Row:
    from .. import storage
    from ..checkpointer.metadata import METADATA_FNAME as OLMO_METADATA
    from ..dcp import step_dirs

    step = step_number(storage.basename(step_dir))
    step_entries = entries if entries is not None else list_entries(step_dir, options)
    dcp_dir = find_dcp_dir(step_dir, step_entries, options)
    olmo = dcp_dir != step_dir
    found = list_entries(dcp_dir, options) if olmo else step_entries
    ranks = sorted(
        {int(m.group(1)) for n in found if (m := _DATA_FILE.match(n))}
        | {r for n in found if (r := step_dirs.marker_rank(n)) is not None}
    )
    markers = sorted(
        {r for n in found if (r := step_dirs.marker_rank(n)) is not None} | set(sibling_markers)
    )
    meta = found.get(step_dirs.METADATA_NAME)
    size = sum(e.size for e in found.values() if not e.is_dir)
    times = [e.mtime for e in found.values() if e.mtime is not None]
    detail, world = "", None
    if meta is None:
        status, detail = "incomplete", "no .metadata: the save never committed"
    elif markers:
        status, detail = "incomplete", f"unfinished on ranks {markers}"
    elif olmo and OLMO_METADATA not in step_entries:
        status, detail = "incomplete", f"no {OLMO_METADATA}: the Checkpointer's save never finished"
    else:
        status, detail = _check_step(dcp_dir, found, options)
        if olmo:  # its .metadata.json and trainer state, as the Checkpointer judges them
            olmo_status, olmo_detail, world = step_status(step_dir, options)
            if status == "complete" and olmo_status != "complete":
                status, detail = olmo_status, olmo_detail
    if storage.basename(step_dir).endswith("_ckpt") and (meta is None or "missing" in detail):
        detail += (  # (what one node's directory shows of a step saved across the nodes)
            " (ML Flashpoint's layout on node-local storage: other nodes hold the rest; list each "
            "node's directory, or load with tierpoint.dcp.flashpoint, which fetches it)"
        )
    return Row(
        tier="persistent",
        where=where,
        step=step,
        ranks=ranks,
        world_size=world,
        replicas=0,
        size=size,
        mtime=meta.mtime if meta and meta.mtime else (max(times) if times else None),
        status=status,
        detail=detail,
        path=dcp_dir,
    )


def lost_data_files(storage_data: Any, found: dict[str, Entry]) -> list[tuple[str, str]]:
    """``(name, what is wrong)`` of each data file a step's metadata (``storage_data``) locates
    bytes in that is not among the step's entries (``found``) or is shorter."""
    ends: dict[str, int] = {}
    for info in storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return [
        (name, "data file missing")
        if name not in found
        else (name, f"truncated ({found[name].size} of {end} bytes)")
        for name, end in sorted(ends.items())
        if name not in found or found[name].size < end
    ]


def _check_step(dcp_dir: str, found: dict[str, Entry], options: Any) -> tuple[str, str]:
    """Cheap checks of a committed step: metadata readable, every data file it names there and
    long enough, checksum manifests for all data files or none."""
    from ..dcp.checksums import manifest_name
    from ..dcp.reader import read_metadata

    try:
        metadata = read_metadata(dcp_dir, storage_options=options)
    except (OSError, CheckpointingError) as e:
        return "corrupt", str(e)
    storage_data = metadata.storage_data or {}
    lost_files = lost_data_files(storage_data, found)
    if lost_files:
        return "corrupt", "{}: {}".format(*lost_files[0])
    # (None among the manifests: torch's own writer, no checksums)
    manifests = {manifest_name(info.relative_path) for info in storage_data.values()}
    lost = sorted(m for m in manifests if m is not None and m not in found)
    if lost:
        return "corrupt", f"checksum manifest {lost[0]} missing"
    plain = None in manifests
    return "complete", "no checksum manifests (written by plain torch)" if plain else ""
