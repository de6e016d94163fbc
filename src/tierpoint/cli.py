"""The ``tierpoint`` command: look into, check and convert checkpoints without writing Python.

Subcommands (``tierpoint <command> --help`` for each):

- ``ls PATH|URL``: every checkpoint under a local-tier root, session or rank directory, a DCP base
  directory or step (a directory or ``s3://`` URL), or an OLMo-core-style run directory
  (``step<N>/model_and_optim``): step, tier, ranks present, replicas, size, age, status
  (complete / incomplete / corrupt, from headers and metadata: ``verify`` reads every byte) and
  the newest restorable one;
- ``inspect FILE|DIR``: a part file's tensors (name, dtype, shape, bytes, checksum), its stored
  non-tensor values and skeleton; a DCP step's metadata items and values; a ``.pt`` file's (loaded
  with ``weights_only=True``) or another writer's ``.safetensors`` file's (its header) tensors;
- ``verify PATH|URL...``: every checksum of part files, of a directory of them, of a DCP step or of
  every step of a DCP base (an uncommitted step is skipped: it is never loaded); exit status 0
  only when everything verified (a DCP step without checksum manifests, written by plain torch, is
  read completely and reported unverified; ``--strict`` fails it);
- ``convert SRC DST``: a part file, a local-tier iteration or a DCP checkpoint to one
  ``.safetensors`` or ``torch.save`` ``.pt`` file, and such a file back to a DCP checkpoint;
- ``bench [NAME]``: the benchmark suite (``benchmarks/*_bench.py``) at small sizes, one table,
  JSON, and a PNG chart where matplotlib is installed;
- ``demo``: the fault-tolerant training demo (:mod:`tierpoint.demo`).

Call order: :func:`main` parses the arguments (argparse, without importing torch: ``--help`` and
``--version`` answer at once), then runs one command, which imports what it needs.

Invariants:
- Nothing runs code from a checkpoint: part files and DCP metadata are read without pickle,
  ``.pt`` files with ``torch.load(weights_only=True)``, skeleton pickles are never loaded.
- URLs stay strings (``s3://`` is never a ``Path``); ``--endpoint-url`` and the ``AWS_*``
  environment configure S3.
- A command that cannot do its job (a bad path, an unreachable store, a damaged file) prints one
  line on stderr naming the path and the reason and exits non-zero, never with a traceback
  (``TIERPOINT_DEBUG=1`` shows it); ``verify`` prints one line per target checked on stdout
  (``ok`` / ``FAIL`` and why). ``ls``, ``inspect`` and ``verify`` write nothing.
- The library's log level is raised to ERROR only while a command runs (retries are not news).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .errors import CheckpointingError

_OLMO_STEP = re.compile(r"^step(\d+)$")
_OLMO_DCP = "model_and_optim"
_DATA_FILE = re.compile(r"^__(\d+)_\d+(?:\.[0-9a-f]+)?\.distcp$")


class CommandError(Exception):
    """A failure the command reports as one line (the message) and exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------- output


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Not a terminal (a pipe, a file, a test): wide lines, no colours, nothing cut.
    return Console(file=stream, width=None if stream.isatty() else 200, highlight=False)


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    return table


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _age(mtime: float | None) -> str:
    if mtime is None:
        return "-"
    seconds = max(0.0, time.time() - mtime)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _progress(console: Any, enabled: bool) -> Any:
    """A rich progress bar on a terminal, else a stand-in that shows nothing."""
    if enabled and console.is_terminal:
        from rich.progress import Progress

        return Progress(console=console, transient=True)
    return _NoProgress()


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None


# -------------------------------------------------------------------------------------- storage


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """fsspec storage options from ``--endpoint-url`` (s3fs reads ``AWS_*`` itself)."""
    url = getattr(args, "endpoint_url", None)
    return {"endpoint_url": url} if url else {}


@dataclass
class _Entry:
    name: str
    size: int
    mtime: float | None
    is_dir: bool


def _entries(url: str, options: Mapping[str, Any]) -> dict[str, _Entry]:
    """What is directly under ``url`` (a directory or URL prefix), with sizes and times."""
    from . import storage

    names = storage.listdir(url, options)  # clear errors: a missing bucket, an unreachable store
    if storage.is_local(url):
        out = {}
        for name in names:
            try:
                st = os.stat(os.path.join(storage.local_path(url), name))
            except OSError:
                continue  # removed meanwhile
            is_dir = os.path.isdir(os.path.join(storage.local_path(url), name))
            out[name] = _Entry(name, 0 if is_dir else st.st_size, st.st_mtime, is_dir)
        return out
    if not names:
        return {}
    try:
        fs, path = storage.filesystem(url, options)
        listed = fs.ls(path, detail=True)
    except Exception as e:  # noqa: BLE001 - reported with the URL
        raise storage.failure("listing", url, e) from e
    out = {}
    for e in listed:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        stamp = e.get("LastModified") or e.get("mtime")
        mtime = stamp.timestamp() if hasattr(stamp, "timestamp") else None
        is_dir = e.get("type") == "directory"
        out[name] = _Entry(name, int(e.get("size") or 0), mtime, is_dir)
    return {n: out[n] for n in names if n in out} | {
        n: _Entry(n, 0, None, True) for n in names if n not in out
    }


def _join(url: str, *names: str) -> str:
    from . import storage

    return storage.join(url, *names)


def _step_number(name: str) -> int | None:
    """The step of a DCP ``step-<N>`` (ML Flashpoint: ``step-<N>_ckpt``) or an OLMo-core
    ``step<N>`` directory name."""
    from .dcp import layout

    step = layout.step_dir_of(name)
    if step is None and (m := _OLMO_STEP.match(name)):
        step = int(m.group(1))
    return step


def _is_dcp_step(names: Sequence[str]) -> bool:
    from .dcp import layout

    return any(
        n == layout.METADATA_NAME or n.startswith(layout.MARKER_PREFIX) or n.endswith(".distcp")
        for n in names
    )


def _classify(path: str, options: Mapping[str, Any]) -> tuple[str, dict[str, _Entry]]:
    """What ``path`` is: ``"part"`` (a file), ``"dcp-step"``, ``"olmo-step"``, ``"dcp-base"``
    (step directories under it) or ``"local"`` (a local-tier root, session or rank directory)."""
    from . import storage

    if storage.is_local(path):
        local = storage.local_path(path)
        if not os.path.exists(local):
            raise CommandError(f"{path}: no such file or directory")
        if os.path.isfile(local):
            return "part", {}
    entries = _entries(path, options)
    if not entries and not storage.is_local(path):
        raise CommandError(f"{path}: nothing there (no checkpoint, no objects under this prefix)")
    if _is_dcp_step(list(entries)):
        return "dcp-step", entries
    if _OLMO_DCP in entries and entries[_OLMO_DCP].is_dir:
        return "olmo-step", entries
    if any(_step_number(n) is not None and e.is_dir for n, e in entries.items()):
        return "dcp-base", entries
    if not storage.is_local(path):
        raise CommandError(f"{path}: neither a DCP checkpoint nor a directory of step-<N> ones")
    return "local", entries


# ------------------------------------------------------------------------------------------- ls


@dataclass
class Row:
    """One checkpoint as ``ls`` shows it."""

    tier: str
    where: str
    step: int
    ranks: list[int]
    world_size: int | None
    replicas: int
    size: int
    mtime: float | None
    status: str
    detail: str = ""
    path: str = ""


def _cmd_ls(args: argparse.Namespace) -> int:
    options = _options(args)
    path = args.path
    kind, entries = _classify(path, options)
    if kind == "part":
        raise CommandError(f"{path}: a file; `tierpoint inspect` shows one part file")
    rows = _local_rows(path) if kind == "local" else _dcp_rows(path, kind, entries, options)
    newest: dict[str, Row] = {}
    for row in rows:
        if row.status == "complete" and (
            row.where not in newest or row.step > newest[row.where].step
        ):
            newest[row.where] = row
    if args.json:
        _print_json(
            {
                "path": path,
                "checkpoints": [asdict(r) for r in rows],
                "newest_restorable": {w: r.path for w, r in newest.items()},
            }
        )
        return 0
    console = _console()
    if not rows:
        console.print(f"{path}: no checkpoints")
        return 0
    columns = ["where", "step", "tier", "ranks", "replicas", "size", "age", "status"]
    table_rows = [
        (
            r.where,
            r.step,
            r.tier,
            _ranks_text(r),
            r.replicas if r.tier == "local" else "-",
            _size(r.size),
            _age(r.mtime),
            r.status + (f": {r.detail}" if r.detail else ""),
        )
        for r in rows
    ]
    console.print(_table(f"checkpoints under {path}", columns, table_rows))
    for where in dict.fromkeys(r.where for r in rows):
        found = newest.get(where)
        unit = "iteration" if found and found.tier == "local" else "step"
        text = f"{found.tier} {unit} {found.step}: {found.path}" if found else "none"
        console.print(f"newest restorable ({where}): {text}")
    return 0


def _ranks_text(row: Row) -> str:
    if row.world_size is None:
        return ",".join(map(str, row.ranks)) or "-"
    return f"{len(row.ranks)}/{row.world_size}"


def _local_rows(root: str) -> list[Row]:
    """Every iteration of every session under a local-tier root, session or rank directory."""
    from .local.naming import parse_part_name

    base = Path(root)
    subdirs = sorted(p for p in base.iterdir() if p.is_dir())

    def holds(directory: Path) -> bool:
        return any(parse_part_name(n) is not None for n in os.listdir(directory))

    if holds(base):  # a rank's directory
        return _session_rows(base.parent.name, [base])
    holders = [p for p in subdirs if holds(p)]
    rows = _session_rows(base.name, holders) if holders else []  # a session's directory
    for session in (p for p in subdirs if p not in holders):  # a root of sessions
        rows += _session_rows(session.name, sorted(p for p in session.iterdir() if p.is_dir()))
    return rows


def _session_rows(session: str, holders: Sequence[Path]) -> list[Row]:
    from .local.naming import parse_part_name, part_world_size

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
        size, mtime = 0, 0.0
        for origin, path in files[iteration]:
            try:
                st = path.stat()
                worlds.add(part_world_size(path, iteration, origin))
            except (OSError, CheckpointingError) as e:
                damaged.setdefault(origin, f"{path}: {e}")
                continue
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


def _dcp_rows(path: str, kind: str, entries: dict[str, _Entry], options: Any) -> list[Row]:
    if kind in ("dcp-step", "olmo-step"):
        return [_step_row(path, path, entries, options)]
    from .dcp import layout

    steps = {
        n: step for n, e in entries.items() if e.is_dir and (step := _step_number(n)) is not None
    }
    outside = layout.sibling_markers(list(entries))  # ML Flashpoint's, next to the directories
    return [
        _step_row(path, _join(path, name), None, options, outside.get(name, []))
        for name in sorted(steps, key=steps.__getitem__, reverse=True)
    ]


def _step_row(
    where: str,
    step_dir: str,
    entries: dict[str, _Entry] | None,
    options: Any,
    sibling_markers: Sequence[int] = (),
) -> Row:
    from . import storage
    from .checkpointer.metadata import METADATA_FNAME as OLMO_METADATA
    from .dcp import layout

    step = _step_number(storage.basename(step_dir))
    step_entries = entries if entries is not None else _entries(step_dir, options)
    dcp_dir = _dcp_dir(step_dir, step_entries, options)
    olmo = dcp_dir != step_dir
    found = _entries(dcp_dir, options) if olmo else step_entries
    ranks = sorted(
        {int(m.group(1)) for n in found if (m := _DATA_FILE.match(n))}
        | {r for n in found if (r := layout.marker_rank(n)) is not None}
    )
    markers = sorted(
        {r for n in found if (r := layout.marker_rank(n)) is not None} | set(sibling_markers)
    )
    meta = found.get(layout.METADATA_NAME)
    size = sum(e.size for e in found.values() if not e.is_dir)
    times = [e.mtime for e in found.values() if e.mtime is not None]
    detail = ""
    if meta is None:
        status, detail = "incomplete", "no .metadata: the save never committed"
    elif markers:
        status, detail = "incomplete", f"unfinished on ranks {markers}"
    elif olmo and OLMO_METADATA not in step_entries:
        status, detail = "incomplete", f"no {OLMO_METADATA}: the Checkpointer's save never finished"
    else:
        status, detail = _check_step(dcp_dir, found, options)
    return Row(
        tier="persistent",
        where=where,
        step=-1 if step is None else step,
        ranks=ranks,
        world_size=None,
        replicas=0,
        size=size,
        mtime=meta.mtime if meta and meta.mtime else (max(times) if times else None),
        status=status,
        detail=detail,
        path=dcp_dir,
    )


def _dcp_dir(step_dir: str, entries: dict[str, _Entry] | None, options: Any) -> str:
    """The DCP directory of a step: the step itself, or its ``model_and_optim`` (OLMo-core)."""
    if entries is None:
        entries = _entries(step_dir, options)
    if _OLMO_DCP in entries and not _is_dcp_step(list(entries)):
        return _join(step_dir, _OLMO_DCP)
    return step_dir


def _check_step(dcp_dir: str, found: dict[str, _Entry], options: Any) -> tuple[str, str]:
    """Cheap checks of a committed step: metadata readable, every data file it names there and
    long enough, checksum manifests for all data files or none."""
    from .dcp.checksums import manifest_name
    from .dcp.reader import read_metadata

    try:
        metadata = read_metadata(dcp_dir, storage_options=options)
    except (OSError, CheckpointingError) as e:
        return "corrupt", str(e)
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        if name not in found:
            return "corrupt", f"data file {name} missing"
        if found[name].size < end:
            return "corrupt", f"{name} truncated ({found[name].size} of {end} bytes)"
    manifests = [manifest_name(n) in found for n in ends]
    if any(manifests) and not all(manifests):
        return "corrupt", "a checksum manifest is missing"
    return "complete", "" if all(manifests) else "no checksum manifests (written by plain torch)"


# ---------------------------------------------------------------------------------------- verify


@dataclass
class _Check:
    target: str
    kind: str
    run: Callable[[], tuple[str, str]] | None
    """Returns (status, detail); None: skipped (see ``detail``)."""
    detail: str = ""


def _cmd_verify(args: argparse.Namespace) -> int:
    options = _options(args)
    checks: list[_Check] = []
    results: list[dict[str, Any]] = []
    for path in args.paths:  # a path that is not there is one line on stderr; the others go on
        try:
            checks += _checks(path, options)
        except (CommandError, CheckpointingError, OSError) as e:
            print(f"tierpoint verify: {' '.join(str(e).split())}", file=sys.stderr)
            results.append({"target": path, "kind": "?", "status": "FAIL", "detail": str(e)})
    console = _console()
    with _progress(console, not args.json) as progress:
        task = progress.add_task("verifying", total=len(checks))
        for check in checks:
            progress.update(task, description=f"verifying {check.target}")
            if check.run is None:
                status, detail = "skipped", check.detail
            else:
                try:
                    status, detail = check.run()
                except (OSError, CheckpointingError, ValueError) as e:
                    status, detail = "FAIL", str(e)
            results.append({"target": check.target, "kind": check.kind, "status": status,
                            "detail": detail})  # fmt: skip
            if not args.json:
                console.print(f"{_MARKS[status]} {check.target}: {detail}", soft_wrap=True)
            progress.update(task, advance=1)
    passing = ("ok", "skipped") if args.strict else ("ok", "skipped", "unverified")
    ok = all(r["status"] in passing for r in results)
    if args.json:
        _print_json({"ok": ok, "results": results})
    else:
        counts = {s: sum(r["status"] == s for r in results) for s in _MARKS}
        console.print(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing checked")
    return 0 if ok else 1


_MARKS = {"ok": "ok  ", "unverified": "ok  ", "skipped": "skip", "FAIL": "FAIL"}
"""Each status's mark at the start of its line (an unverified checkpoint read fine)."""


def _checks(path: str, options: Mapping[str, Any]) -> list[_Check]:
    from . import storage

    if storage.is_local(path) and path.endswith(".distcp"):
        parent = os.path.dirname(path) or "."
        raise CommandError(f"{path}: a DCP data file: verify its checkpoint directory ({parent})")
    kind, entries = _classify(path, options)
    if kind == "part":
        return [_Check(path, "part", lambda: _verify_part(path))]
    if kind in ("dcp-step", "olmo-step"):
        step_dir = _dcp_dir(path, entries, options)
        return [_Check(step_dir, "dcp", lambda: _verify_dcp(step_dir, options))]
    if kind == "dcp-base":
        checks = []
        for row in _dcp_rows(path, kind, entries, options):
            if row.status == "incomplete":
                checks.append(_Check(row.path, "dcp", None, f"not committed ({row.detail})"))
            else:
                checks.append(_Check(row.path, "dcp", lambda p=row.path: _verify_dcp(p, options)))
        return checks
    from .local.naming import parse_part_name

    local = Path(path)
    parts = sorted(  # a rank's directory, a session's or a root's
        p
        for pattern in ("*", "*/*", "*/*/*")
        for p in local.glob(pattern)
        if parse_part_name(p.name) is not None and p.is_file()
    )
    if not parts:
        raise CommandError(
            f"{path}: neither a DCP checkpoint (no .metadata) nor a directory of part files"
        )
    return [_Check(str(p), "part", lambda p=p: _verify_part(str(p))) for p in parts]


def _verify_part(path: str) -> tuple[str, str]:
    from . import fileformat
    from .local.naming import parse_part_name, part_world_size

    header = fileformat.verify(path)
    parsed = parse_part_name(os.path.basename(path))
    if parsed is not None:  # a part file's name must agree with its metadata, as the manager checks
        part_world_size(path, *parsed)
    return "ok", f"{len(header.records)} tensors, {header.file_size} bytes, every checksum matches"


def _verify_dcp(path: str, options: Mapping[str, Any]) -> tuple[str, str]:
    from .dcp.verify import verify_checkpoint

    summary = verify_checkpoint(path, storage_options=options)
    read = (
        f"{summary.tensors} tensors ({summary.tensor_bytes} bytes) and {summary.values} other "
        "values read and decoded"
    )
    if summary.verified:
        return "ok", f"DCP checkpoint: {read}; every item matches its checksum"
    return (
        "unverified",
        f"DCP checkpoint: {read}; unverified: no checksum manifest (not written by tierpoint)",
    )


# --------------------------------------------------------------------------------------- inspect


def _cmd_inspect(args: argparse.Namespace) -> int:
    options = _options(args)
    kind, entries = _classify(args.path, options)
    if kind == "part":
        doc = _inspect_file(args.path)
    elif kind in ("dcp-step", "olmo-step"):
        doc = _inspect_dcp(_dcp_dir(args.path, entries, options), options)
    else:
        raise CommandError(
            f"{args.path}: inspect shows one part file or one DCP step; for a directory of "
            "checkpoints use `tierpoint ls` or `tierpoint verify`",
            code=2,
        )
    if args.json:
        _print_json(doc)
        return 0
    console = _console()
    columns = ["name", "dtype", "shape", "bytes", "checksum"]
    rows = [(t["name"], t["dtype"], t["shape"], t["bytes"], t["checksum"]) for t in doc["tensors"]]
    head = f"{doc['path']}: {doc['kind']}, {_size(doc['size'])}"
    if doc.get("extra"):
        head += f", metadata {json.dumps(doc['extra'])}"
    console.print(head, soft_wrap=True)
    console.print(_table(f"{len(rows)} tensors", columns, rows))
    if doc["values"]:
        values = [(k, json.dumps(v, default=str)) for k, v in doc["values"].items()]
        console.print(_table(f"{len(values)} other values", ["name", "value"], values))
    if doc.get("skeleton") is not None:
        console.print("skeleton: " + json.dumps(_skeleton_view(doc), default=str), soft_wrap=True)
    return 0


def _inspect_file(path: str) -> dict[str, Any]:
    """A part file, another safetensors file (its header only) or a ``torch.save`` file."""
    if _file_kind(path) == "pt":
        return _state_doc(path, "torch.save file", _load_pt(path))
    header = _safetensors_header(path)
    meta = header.pop("__metadata__", None) or {}
    if isinstance(meta, dict) and meta.get("format") == "tierpoint":
        return _inspect_part(path)
    tensors = []
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            tensors.append({"name": name, "dtype": entry["dtype"], "shape": list(entry["shape"]),
                            "bytes": end - begin, "checksum": "-"})  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise CommandError(f"{path}: not a safetensors file: entry {name!r}: {e}") from e
    size = os.path.getsize(path)
    doc = {"path": path, "kind": "safetensors file", "size": size, "extra": meta}
    return doc | {"tensors": tensors, "values": {}, "skeleton": None}


def _state_doc(path: str, kind: str, state: Any) -> dict[str, Any]:
    """What ``inspect`` shows of a loaded state: its tensors (checksums computed), values,
    skeleton."""
    from .fileformat import byte_view, checksum
    from .fileformat.plan import _unique_names
    from .tree import flatten

    flat = flatten(state)
    tensors = [
        {
            "name": name,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "bytes": t.numel() * t.element_size(),
            "checksum": checksum(byte_view(t.detach().cpu().contiguous())),
        }
        for name, t in zip(_unique_names(flat.paths), flat.tensors)
    ]
    values: dict[str, Any] = {}
    _skeleton_values(flat.skeleton, "", values)
    size = os.path.getsize(path)
    doc = {"path": path, "kind": kind, "size": size, "extra": None, "tensors": tensors}
    return doc | {"values": values, "skeleton": flat.skeleton}


def _inspect_part(path: str) -> dict[str, Any]:
    from . import fileformat

    header = fileformat.read_header(path)
    tensors = [
        {
            "name": r.name,
            "dtype": str(r.dtype).removeprefix("torch."),
            "shape": list(r.shape),
            "bytes": r.nbytes,
            "checksum": r.checksum,
            "device": r.device,
        }
        for r in header.records
    ]
    values: dict[str, Any] = {}
    _skeleton_values(header.skeleton, "", values)
    return {
        "path": path,
        "kind": "part file",
        "size": header.file_size,
        "extra": header.extra,
        "tensors": tensors,
        "values": values,
        "skeleton": header.skeleton,
    }


def _skeleton_values(node: Any, path: str, out: dict[str, Any]) -> None:
    """The non-tensor leaves of a part file's skeleton, by key path, as JSON (never unpickled)."""
    from .tree import _child_path

    if isinstance(node, list):
        for i, v in enumerate(node):
            _skeleton_values(v, _child_path(path, i), out)
    elif isinstance(node, dict):
        tag = node.get("~")
        if tag in ("dict", "odict"):
            for k, v in zip(node.get("k", []), node.get("v", [])):
                _skeleton_values(
                    v, _child_path(path, k if isinstance(k, (str, int)) else str(k)), out
                )
        elif tag == "tuple":
            for i, v in enumerate(node.get("v", [])):
                _skeleton_values(v, _child_path(path, i), out)
        elif tag in ("tensor", "dtensor", "ndarray"):
            return
        elif tag == "pickle":
            out[path or "<root>"] = "<a pickled object: not loaded>"
        elif tag in ("int", "float"):
            out[path or "<root>"] = node.get("v")
        elif tag == "bytes":
            out[path or "<root>"] = f"<bytes, {len(node.get('v', '')) * 3 // 4} bytes>"
        else:
            out[path or "<root>"] = f"{tag}({node.get('dtype') or node.get('v')})"
    else:
        out[path or "<root>"] = node


def _skeleton_view(doc: dict[str, Any]) -> Any:
    """The skeleton with each tensor node shown as ``tensor <name>``."""
    names = [t["name"] for t in doc["tensors"]]

    def view(node: Any) -> Any:
        if isinstance(node, list):
            return [view(v) for v in node]
        if isinstance(node, dict):
            if node.get("~") in ("tensor", "dtensor", "ndarray") and isinstance(node.get("i"), int):
                i = node["i"]
                return f"<{node['~']} {names[i] if 0 <= i < len(names) else i}>"
            return {k: view(v) for k, v in node.items()}
        return node

    return view(doc["skeleton"])


def _inspect_dcp(path: str, options: Mapping[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp.loading import load
    from .dcp.reader import Reader

    reader = Reader(path, storage_options=options)
    metadata = reader.read_metadata()
    storage = metadata.storage_data or {}
    tensors, value_names, size = [], [], 0
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            value_names.append(fqn)
            continue
        dtype = md.properties.dtype
        nbytes = math.prod(md.size) * dtype.itemsize
        size += nbytes
        sums = [_item_checksum(reader, index, info) for index, info in storage.items()
                if index.fqn == fqn]  # fmt: skip
        tensors.append(
            {
                "name": fqn,
                "dtype": str(dtype).removeprefix("torch."),
                "shape": list(md.size),
                "bytes": nbytes,
                "checksum": sums[0] if len(sums) == 1 else f"{len(sums)} chunks",
                "chunks": len(md.chunks),
            }
        )
    values: dict[str, Any] = {name: None for name in value_names}
    if values:
        load(values, path, storage_options=options)  # decoded with weights_only=True
    return {
        "path": path,
        "kind": "DCP checkpoint",
        "size": size,
        "tensors": tensors,
        "values": {k: _json_value(v) for k, v in values.items()},
        "skeleton": None,
    }


def _item_checksum(reader: Any, index: Any, info: Any) -> str:
    manifest = reader.manifest(info.relative_path)
    if manifest is None:
        return "-"
    return manifest.files.get(info.relative_path, {}).get((info.offset, info.length), "-")


def _json_value(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


# --------------------------------------------------------------------------------------- convert


def _cmd_convert(args: argparse.Namespace) -> int:
    from . import storage

    options = _options(args)
    dst = args.dst
    out_kind = _file_kind(dst) or "dcp"
    if out_kind != "dcp" and not storage.is_local(dst):
        raise CommandError(f"{dst}: a .safetensors or .pt file is written locally only")
    if out_kind != "dcp" and os.path.exists(dst) and not args.force:
        raise CommandError(f"{dst}: exists (--force to replace it)")
    state, source = _read_state(args, options)
    if out_kind == "safetensors":
        how = _write_safetensors(state, dst)
    elif out_kind == "pt":
        import torch

        torch.save(state, dst)
        how = "torch.save"
    else:
        how = _write_dcp(state, dst, options, args.force)
    tensors, nbytes = _count_tensors(state)
    print(f"{source} -> {dst} ({how}): {tensors} tensors, {nbytes} bytes")
    return 0


def _file_kind(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith((".pt", ".pth")):
        return "pt"
    return None


def _read_state(args: argparse.Namespace, options: Mapping[str, Any]) -> tuple[Any, str]:
    """The state held by ``args.src`` and a description of it."""
    try:
        return _read_source(args, options)
    except CheckpointingError as e:
        if args.src in str(e):
            raise
        raise CommandError(f"{args.src}: {e}") from e  # an error that does not name the file


def _read_source(args: argparse.Namespace, options: Mapping[str, Any]) -> tuple[Any, str]:
    src = args.src
    kind, entries = _classify(src, options)
    if kind == "part":
        file_kind = _file_kind(src)
        if file_kind == "pt":
            return _load_pt(src), "torch.save file"
        return _read_safetensors(src)
    if kind in ("dcp-step", "olmo-step"):
        return _read_dcp(_dcp_dir(src, entries, options), options), "DCP checkpoint"
    if kind == "local":
        return _read_iteration(src, args.iteration, args.rank)
    raise CommandError(f"{src}: a DCP base directory: convert one of its steps")


def _read_safetensors(path: str) -> tuple[Any, str]:
    """A tierpoint part file (checked, its skeleton restored) or any safetensors file."""
    from . import fileformat

    meta = _safetensors_metadata(path)
    if meta.get("format") == "tierpoint":
        return fileformat.read(path), "part file"
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise CommandError(
            f"{path}: not a tierpoint part file; reading other safetensors files needs the "
            "safetensors package"
        ) from e
    try:
        tensors = load_file(path)
    except Exception as e:  # noqa: BLE001 - a damaged file: one line
        raise CommandError(f"{path}: not a readable safetensors file: {e}") from e
    if "tierpoint_skeleton" in meta:  # written by `tierpoint convert`: the structure comes back
        from .tree import unflatten

        names = json.loads(meta["tierpoint_names"])
        state = unflatten(json.loads(meta["tierpoint_skeleton"]), [tensors[n] for n in names])
        return state, "safetensors file"
    return tensors, "safetensors file"


def _safetensors_metadata(path: str) -> dict[str, Any]:
    """The ``__metadata__`` of a safetensors file's header."""
    meta = _safetensors_header(path).get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise CommandError(f"{path}: not a safetensors file: __metadata__ is not a map")
    return meta


def _safetensors_header(path: str) -> dict[str, Any]:
    """A safetensors file's JSON header (its length checked against the file before reading)."""
    from .fileformat import MAX_HEADER_BYTES

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header length of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        return header
    except ValueError as e:
        raise CommandError(f"{path}: not a safetensors file: {e}") from e


def _load_pt(path: str) -> Any:
    """A ``torch.save`` file's state, loaded with ``weights_only=True`` (no code runs)."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a damaged or unsafe file: one line
        raise CommandError(f"{path}: cannot load with weights_only=True: {e}") from e


def _read_dcp(path: str, options: Mapping[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp.loading import load
    from .dcp.reader import read_metadata

    metadata = read_metadata(path, storage_options=options)
    state: dict[str, Any] = {}
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        is_tensor = isinstance(md, TensorStorageMetadata)
        state[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if is_tensor else None
    load(state, path, storage_options=options)
    return state


def _read_iteration(root: str, iteration: int | None, rank: int | None) -> tuple[Any, str]:
    """One local-tier iteration (the newest complete by default): ``{"rank<r>": state}`` for every
    rank, or one rank's state."""
    from . import fileformat
    from .local.naming import parse_part_name

    rows = [r for r in _local_rows(root) if iteration is None or r.step == iteration]
    sessions = {r.where for r in rows}
    if len(sessions) > 1:
        raise CommandError(f"{root}: holds sessions {sorted(sessions)}: name one's directory")
    complete = [r for r in rows if r.status == "complete" or (rank is not None and rank in r.ranks)]
    if not complete:
        which = f"iteration {iteration}" if iteration is not None else "a complete iteration"
        raise CommandError(f"{root}: no {which} to convert")
    row = max(complete, key=lambda r: r.step)
    parts: dict[int, Path] = {}
    for p in sorted(Path(root).glob("**/*")):
        parsed = parse_part_name(p.name)
        if parsed is not None and parsed[0] == row.step:
            parts.setdefault(parsed[1], p)
    ranks = [rank] if rank is not None else sorted(parts)
    if any(r not in parts for r in ranks):
        raise CommandError(f"{root}: iteration {row.step} has no part of rank {rank}")
    if rank is not None:
        return fileformat.read(parts[rank]), f"iteration {row.step}, rank {rank}"
    state = {f"rank{r}": fileformat.read(parts[r]) for r in ranks}
    return state, f"iteration {row.step}, ranks {ranks[0]}..{ranks[-1]}"


def _write_safetensors(state: Any, dst: str) -> str:
    from . import fileformat
    from .fileformat.header import NATIVE_CODES
    from .fileformat.plan import _unique_names
    from .tree import flatten

    flat = flatten(state)
    names = _unique_names(flat.paths)
    try:
        from safetensors.torch import save_file
    except ImportError:
        save_file = None
    if save_file is None or any(t.dtype not in NATIVE_CODES for t in flat.tensors):
        fileformat.write(dst, state)  # the same layout, with tierpoint's checksums and skeleton
        return "safetensors layout, by tierpoint.fileformat"
    metadata = {
        "format": "pt",
        "tierpoint_skeleton": json.dumps(flat.skeleton),
        "tierpoint_names": json.dumps(names),
    }
    tensors = {n: t.detach().cpu().contiguous().clone() for n, t in zip(names, flat.tensors)}
    save_file(tensors, dst, metadata=metadata)
    return "safetensors"


def _write_dcp(state: Any, dst: str, options: Mapping[str, Any], force: bool) -> str:
    from . import storage
    from .dcp import layout
    from .dcp.saving import save

    if storage.exists(storage.join(dst, layout.METADATA_NAME), options) and not force:
        raise CommandError(f"{dst}: holds a DCP checkpoint already (--force to replace it)")
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        state = {"state": state}
    save(state, dst, storage_options=options, overwrite=force)
    return "DCP"


def _count_tensors(state: Any) -> tuple[int, int]:
    from .tree import flatten

    tensors = flatten(state).tensors
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------------------- bench

_QUICK_ARGS = {
    "async": ["--gib", "0.1", "--reps", "2"],
    "dcp": ["--gib", "0.1", "--reps", "1"],
    "format": ["--gib", "0.1", "--reps", "2"],
    "gpu": ["--reps", "1"],
    "local": ["--mib", "32", "--reps", "2"],
    "replication": ["--mib", "32", "--reps", "2"],
}
"""Small sizes for benches without ``--quick`` (from their docstrings' quick runs)."""


def _bench_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def _cmd_bench(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else _bench_dir()
    available = {p.name.removesuffix("_bench.py"): p for p in directory.glob("*_bench.py")}
    if not available:
        raise CommandError(f"{directory}: no benchmarks (*_bench.py) there")
    names = args.names or sorted(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise CommandError(
            f"no benchmark {unknown[0]!r}; there are: {', '.join(sorted(available))}"
        )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    console = _console(stderr=args.json)
    results = []
    if not args.names and any(n in _NEEDS_CUDA for n in names):
        import torch

        if not torch.cuda.is_available():  # the whole suite here: those are not for this machine
            results += [_skipped(n, "no CUDA device") for n in names if n in _NEEDS_CUDA]
            names = [n for n in names if n not in _NEEDS_CUDA]
    for name in names:
        with console.status(f"running {name}_bench.py") if console.is_terminal else _NoProgress():
            results.append(_run_bench(name, available[name], args.full, args.timeout))
        if not args.json:
            console.print(f"{name}: {results[-1]['status']} in {results[-1]['seconds']:.1f} s")
    doc = {"tierpoint": __version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "results": results}  # fmt: skip
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    chart = _chart(results, out_dir / "bench.png")
    if args.json:
        _print_json(doc | {"json": str(json_path), "chart": chart})
    else:
        columns = ["bench", "status", "seconds", "section", "contender", "figure"]
        console.print(_table("benchmarks (quick sizes)" if not args.full else "benchmarks",
                             columns, _bench_rows(results)))  # fmt: skip
        console.print(f"results: {json_path}")
        console.print(f"chart: {chart}" if chart.endswith(".png") else chart)
    return (
        0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results) else 1
    )


_NEEDS_CUDA = {"gpu"}
"""Benches that need a GPU: skipped in a run of the whole suite without one (run when named)."""


def _skipped(name: str, why: str) -> dict[str, Any]:
    return {"bench": name, "args": [], "status": f"skipped ({why})", "seconds": 0.0,
            "contenders": [], "last_line": "", "figures": None, "output": ""}  # fmt: skip


def _run_bench(name: str, script: Path, full: bool, timeout: float | None) -> dict[str, Any]:
    text = script.read_text()
    extra = [] if full else (["--quick"] if '"--quick"' in text else _QUICK_ARGS.get(name, []))
    with tempfile.TemporaryDirectory(prefix="tierpoint-bench-") as tmp:
        figures_path = Path(tmp) / "figures.json"
        json_args = ["--json", str(figures_path)] if '"--json"' in text else []
        command = [sys.executable, str(script), *extra, *json_args]
        start = time.perf_counter()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False
            )
            status = "ok" if done.returncode == 0 else f"failed (exit status {done.returncode})"
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            status, output = f"timed out after {timeout} s", str(e.stdout or "")
        seconds = time.perf_counter() - start
        figures = None
        if figures_path.exists():
            try:
                figures = json.loads(figures_path.read_text())
            except ValueError:
                figures = None
    lines = [line for line in output.splitlines() if line.strip()]
    return {
        "bench": name,
        "args": extra,
        "status": status,
        "seconds": seconds,
        "contenders": _contenders(output),
        "last_line": lines[-1].strip()[:100] if lines else "",
        "figures": figures,
        "output": output[-20_000:],
    }


_NUMBER = re.compile(r"^(.*?\S)\s+(-?\d+(?:\.\d+)?)(?=\s|x|$)")


def _contenders(output: str) -> list[dict[str, Any]]:
    """The rows of the benches' comparison tables: a header line starting with ``contender``
    (columns apart by 2+ spaces), then one row per contender (name, then its first figure), up to a
    blank line; the section is the nearest line above the header."""
    found: list[dict[str, Any]] = []
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("contender"):
            continue
        header = re.split(r"\s{2,}", line.strip())
        label = header[1] if len(header) > 1 else "figure"
        above = [
            x.strip() for x in lines[max(0, i - 3) : i] if x.strip() and set(x.strip()) != {"-"}
        ]
        section = above[-1][:60] if above else ""
        for row in lines[i + 1 :]:
            if not row.strip():
                break
            m = _NUMBER.match(row.rstrip())
            if set(row.strip()) == {"-"} or m is None:
                continue
            found.append({"section": section, "name": m.group(1).strip(), "label": label,
                          "value": float(m.group(2))})  # fmt: skip
    return found


def _bench_rows(results: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """The one table: a row per contender of every bench (its last line where it has none)."""
    rows: list[tuple[Any, ...]] = []
    for r in results:
        head = (r["bench"], r["status"], f"{r['seconds']:.1f}")
        if not r["contenders"]:
            rows.append((*head, "", "", r["last_line"]))
        for k, c in enumerate(r["contenders"]):
            rows.append((*(head if k == 0 else ("", "", "")), c["section"], c["name"],
                         f"{c['value']:g} {c['label']}"))  # fmt: skip
    return rows


def _chart(results: Sequence[Mapping[str, Any]], path: Path) -> str:
    """Bars of every contender's figure, one panel per table of each bench (tierpoint's bars
    in another colour), or each bench's run time where none printed a table; the file's path,
    or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib not installed"
    panels: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        for c in r["contenders"]:
            panels.setdefault(f"{r['bench']}: {c['section']} ({c['label']})", []).append(c)
    if not panels:
        panels = {"run time (s)": [{"name": r["bench"], "value": r["seconds"]} for r in results]}
    heights = [0.6 + 0.3 * len(v) for v in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights) + 0.5), squeeze=False,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    for ax, (title, bars) in zip(axes[:, 0], panels.items()):
        colours = ["tab:orange" if "tierpoint" in b["name"] else "tab:blue" for b in bars]
        ax.barh([b["name"] for b in bars], [b["value"] for b in bars], color=colours)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierpoint", description="Look into, check and convert tierpoint checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"tierpoint {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str, *, store: bool = True, json_flag: bool = True) -> Any:
        p = sub.add_parser(name, help=text, description=text)
        if json_flag:
            p.add_argument("--json", action="store_true", help="print JSON instead of tables")
        if store:
            p.add_argument(
                "--endpoint-url", help="S3 endpoint for s3:// URLs (else AWS_* as s3fs reads them)"
            )
        return p

    ls = command("ls", "list checkpoints: step, tier, ranks, replicas, size, age, status")
    ls.add_argument("path", metavar="PATH|URL", nargs="?", default=None,
                    help="local-tier root (default /dev/shm/tierpoint-<uid>), session or rank "
                         "directory, DCP base or step, OLMo-style run directory, s3:// URL")  # fmt: skip
    inspect = command("inspect", "show a part file's or a DCP step's tensors and values")
    inspect.add_argument("path", metavar="FILE|DIR", help="a part file or a DCP step (or URL)")
    verify = command("verify", "check every checksum; exit status 0 only if all verify")
    verify.add_argument(
        "--strict", action="store_true", help="fail DCP checkpoints without checksum manifests"
    )
    verify.add_argument("paths", metavar="PATH|URL", nargs="+",
                        help="part file, directory of part files, DCP step or base directory")  # fmt: skip
    convert = command("convert", "convert to one .safetensors or .pt file, or back to DCP",
                      json_flag=False)  # fmt: skip
    convert.add_argument("src", metavar="SRC", help="part file, local-tier directory, DCP step, "
                         ".safetensors or .pt file")  # fmt: skip
    convert.add_argument("dst", metavar="DST", help="a .safetensors or .pt file, else a DCP step")
    convert.add_argument("--iteration", type=int, help="local tier: which iteration (newest)")
    convert.add_argument("--rank", type=int, help="local tier: one rank's part (default all)")
    convert.add_argument("--force", action="store_true", help="replace DST if it exists")
    bench = command("bench", "run the benchmark suite at small sizes; table, JSON, chart",
                    store=False)  # fmt: skip
    bench.add_argument("names", metavar="NAME", nargs="*", help="benchmarks to run (default all)")
    bench.add_argument("--full", action="store_true", help="the benchmarks' default sizes")
    bench.add_argument("--out", default="tierpoint-bench", help="where bench.json and bench.png go")
    bench.add_argument("--dir", help="directory of *_bench.py scripts (default: the repository's)")
    bench.add_argument("--timeout", type=float, default=None, help="seconds per benchmark")
    sub.add_parser("demo", help="run the fault-tolerant training demo", add_help=False)
    return parser


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": _cmd_ls,
    "inspect": _cmd_inspect,
    "verify": _cmd_verify,
    "convert": _cmd_convert,
    "bench": _cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tierpoint`` command; returns the exit status."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "ls" and args.path is None:
        from .local.naming import default_root

        args.path = str(default_root())
        if not os.path.isdir(args.path):
            print(f"tierpoint ls: no local tier at the default root {args.path}; name a PATH or "
                  "URL", file=sys.stderr)  # fmt: skip
            return 1
    for name in ("path", "src", "dst"):
        if isinstance(getattr(args, name, None), str):
            setattr(args, name, _normal_path(getattr(args, name), name != "dst"))
    if getattr(args, "paths", None):
        args.paths = [_normal_path(p, True) for p in args.paths]
    # Retries and the like are the library's WARNINGs: a command reports its outcome itself.
    library_logger = logging.getLogger("tierpoint")
    level = library_logger.level
    library_logger.setLevel(logging.ERROR)
    try:
        return _COMMANDS[args.command](args)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"tierpoint {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        if os.environ.get("TIERPOINT_DEBUG"):
            raise
        code = e.code if isinstance(e, CommandError) else 1
        known = isinstance(e, (CommandError, CheckpointingError, OSError))
        text = str(e) if known else f"{type(e).__name__}: {e}"
        print(f"tierpoint {args.command}: {' '.join(text.split())}", file=sys.stderr)
        return code
    finally:
        library_logger.setLevel(level)


def _normal_path(value: str, source: bool) -> str:
    """``file://`` URLs as local paths; a DCP step's ``.metadata`` (to read) as its directory."""
    if value.startswith("file://"):
        value = value[len("file://") :]
    if source and os.path.basename(value) == ".metadata":
        value = os.path.dirname(value) or "."
    return value


if __name__ == "__main__":
    sys.exit(main())
