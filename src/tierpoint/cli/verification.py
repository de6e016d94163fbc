"""``tierpoint verify``: check every checksum of part files, directories of them, DCP steps and
DCP bases; exit status 0 only when nothing failed (unverified fails only with ``--strict``).

Call order: :func:`cmd_verify` turns each path into checks (one per part file or DCP step; an
uncommitted step is skipped; an OLMo-core step adds one for its ``.metadata.json``, one per
trainer-state file and one failing per missing one, from :mod:`tierpoint.cli.olmo`; a ``train/``
directory is its trainer-state files), runs them with a progress bar, prints one line per check
(``ok`` / ``skip`` / ``FAIL`` and why) and a summary, or JSON.

Invariants: a path that cannot be checked is one line on stderr and the others go on; a DCP step
without checksum manifests (plain torch) is read completely and reported unverified, as is another
writer's intact safetensors file (no checksums); a ``torch.save`` file's zip records are checked
against their CRC-32s; unverified fails only with ``--strict``, and then
its line is marked ``FAIL``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointingError
from .files import check_pt_crcs, is_plain_safetensors, kind_of_file
from .listing import dcp_rows
from .locate import OLMO_DCP, classify, find_dcp_dir, store_options
from .olmo import is_train_dir, step_checks, train_dir_checks
from .output import CommandError, make_console, print_json, progress_bar


@dataclass
class _Check:
    target: str
    kind: str
    run: Callable[[], tuple[str, str]] | None
    """Returns (status, detail); None: skipped (see ``detail``)."""
    detail: str = ""


def cmd_verify(args: argparse.Namespace) -> int:
    """``tierpoint verify``: check ``args.paths``; 0 only when nothing failed."""
    options = store_options(args)
    checks: list[_Check] = []
    results: list[dict[str, Any]] = []
    for path in args.paths:  # a path that is not there is one line on stderr; the others go on
        try:
            checks += _checks(path, options)
        except (CommandError, CheckpointingError, OSError) as e:
            print(f"tierpoint verify: {' '.join(str(e).split())}", file=sys.stderr)
            results.append({"target": path, "kind": "?", "status": "FAIL", "detail": str(e)})
    passing = ("ok", "skipped") if args.strict else ("ok", "skipped", "unverified")
    console = make_console()
    with progress_bar(console, not args.json) as progress:
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
                mark = _MARKS[status] if status in passing else _MARKS["FAIL"]
                console.print(f"{mark} {check.target}: {detail}", soft_wrap=True)
            progress.update(task, advance=1)
    ok = all(r["status"] in passing for r in results)
    if args.json:
        print_json({"ok": ok, "results": results})
    else:
        counts = {s: sum(r["status"] == s for r in results) for s in _MARKS}
        if args.strict:  # (their lines say FAIL)
            counts["unverified (failed: --strict)"] = counts.pop("unverified")
        console.print(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing checked")
    return 0 if ok else 1


_MARKS = {"ok": "ok  ", "unverified": "ok  ", "skipped": "skip", "FAIL": "FAIL"}
"""Each status's mark at the start of its line (an unverified checkpoint read fine; with
``--strict`` it fails, and its line says so)."""


def _checks(path: str, options: Mapping[str, Any]) -> list[_Check]:
    from .. import storage

    if storage.is_local(path) and path.endswith(".distcp"):
        parent = os.path.dirname(path) or "."
        raise CommandError(f"{path}: a DCP data file: verify its checkpoint directory ({parent})")
    kind, entries = classify(path, options)
    if kind == "part":
        return [_Check(path, "part", lambda: _verify_part(path))]
    if kind in ("dcp-step", "olmo-step"):
        return _step_checks(path, find_dcp_dir(path, entries, options), options)
    if kind == "dcp-base":
        checks = []
        for row in dcp_rows(path, kind, entries, options):
            if row.status == "incomplete":
                checks.append(_Check(row.path, "dcp", None, f"not committed ({row.detail})"))
            else:
                olmo = storage.basename(row.path) == OLMO_DCP
                step_dir = row.path[: -len(OLMO_DCP)].rstrip("/") if olmo else row.path
                checks += _step_checks(step_dir, row.path, options)
        return checks
    if is_train_dir(list(entries)):  # an OLMo-core step's trainer state
        return [_Check(*check) for check in train_dir_checks(path, options)]
    from ..local.naming import parse_part_name

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


def _step_checks(step_dir: str, dcp_dir: str, options: Mapping[str, Any]) -> list[_Check]:
    """A DCP step's check; an OLMo-core step's (``dcp_dir`` is its ``model_and_optim``) also
    checks its ``.metadata.json`` and every trainer-state file."""
    checks = [_Check(dcp_dir, "dcp", lambda: _verify_dcp(dcp_dir, options))]
    if dcp_dir != step_dir:
        checks += [_Check(*check) for check in step_checks(step_dir, options)]
    return checks


def _verify_part(path: str) -> tuple[str, str]:
    from .. import fileformat
    from ..local.naming import parse_part_name, part_world_size

    if kind_of_file(path) == "pt":
        return check_pt_crcs(path)
    try:
        header = fileformat.verify(path)
    except CheckpointingError:
        if not is_plain_safetensors(path):
            raise
        return "unverified", "a plain safetensors file (no tierpoint checksums): nothing to verify"
    parsed = parse_part_name(os.path.basename(path))
    if parsed is not None:  # a part file's name must agree with its metadata, as the manager checks
        part_world_size(path, *parsed)
    return "ok", f"{len(header.records)} tensors, {header.file_size} bytes, every checksum matches"


def _verify_dcp(path: str, options: Mapping[str, Any]) -> tuple[str, str]:
    from ..dcp.verify import verify_checkpoint

    summary = verify_checkpoint(path, storage_options=options)
    read = (
        f"{summary.tensors} tensors ({summary.tensor_bytes} bytes) and {summary.values} other "
        f"values read{'' if summary.needs_trust else ' and decoded'}"
    )
    if summary.verified:
        trust = summary.needs_trust
        note = (
            f"; {len(trust)} of the values need code from the checkpoint to load (the default "
            f"load refuses them; planner=DefaultLoadPlanner() trusts them): {', '.join(trust[:5])}"
            + (", ..." if len(trust) > 5 else "")
            if trust
            else ""
        )
        return "ok", f"DCP checkpoint: {read}; every item matches its checksum{note}"
    return (
        "unverified",
        f"DCP checkpoint: {read}; unverified: no checksum manifest (not written by tierpoint)",
    )
