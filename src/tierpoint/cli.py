"""The ``tierpoint`` command: look into checkpoints without writing a line of Python.

Subcommands (each reads only; none runs code from a file):

- ``tierpoint ls [ROOT]``: the local tier under ROOT (default ``/dev/shm/tierpoint-<uid>``; ROOT
  may also be one session's directory, as with the empty session id): per session, every iteration with the ranks whose parts exist somewhere (own or replica) and whether it
  is complete; for a DCP base directory (holding ``step-<N>`` directories), every step, committed or
  which ranks never finished it, and the latest complete one;
- ``tierpoint verify PATH...``: check part files completely (header, every tensor checksum, and that
  a part's name agrees with its metadata), every part file under a rank's, session's or root's
  directory, or a DCP checkpoint directory (metadata and every item read, decoded and checked
  against its checksum; a checkpoint written without checksum manifests, by plain torch, is
  reported unverified); exit status 1 if any fails;
- ``tierpoint inspect FILE``: a part file's metadata and tensors (name, dtype, shape, checksum);
- ``tierpoint demo``: the fault-tolerant training demo (``python -m tierpoint.demo``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import fileformat
from .dcp import layout
from .dcp.verify import verify_checkpoint
from .errors import CheckpointingError
from .local.naming import default_root, parse_part_name, part_world_size


def _ls(root: Path) -> int:
    if not root.is_dir():
        print(f"{root}: no such directory", file=sys.stderr)
        return 1
    if any(layout.step_of(p.name) is not None for p in root.iterdir() if p.is_dir()):
        return _ls_dcp(root)
    subdirs = sorted(p for p in root.iterdir() if p.is_dir())
    holders = [p for p in subdirs if _holds_parts(p)]
    if holders:  # ROOT is one session's directory (the empty session id, or ROOT/<session>)
        print(f"rank directories under {root}")
        _ls_iterations(holders)
    for session in (p for p in subdirs if p not in holders):
        print(f"session {session.name!r} ({session})")
        _ls_iterations(sorted(p for p in session.iterdir() if p.is_dir()))
    return 0


def _holds_parts(directory: Path) -> bool:
    return any(parse_part_name(name) is not None for name in os.listdir(directory))


def _ls_iterations(holders: Sequence[Path]) -> None:
    """Every iteration whose parts the holder directories of one session hold, newest first."""
    origins: dict[int, set[int]] = {}
    worlds: dict[int, set[int]] = {}
    for holder in holders:
        for name in os.listdir(holder):
            parsed = parse_part_name(name)
            if parsed is None:
                continue
            iteration, origin = parsed
            try:
                world = part_world_size(holder / name, iteration, origin)
            except (OSError, CheckpointingError) as e:
                print(f"  unreadable: {holder / name}: {e}")
                continue
            origins.setdefault(iteration, set()).add(origin)
            worlds.setdefault(iteration, set()).add(world)
    if not origins:
        print("  no checkpoints")
    for iteration in sorted(origins, reverse=True):
        sizes = worlds[iteration]
        world = next(iter(sizes)) if len(sizes) == 1 else None
        have = origins[iteration]
        complete = isinstance(world, int) and have >= set(range(world))
        missing = sorted(set(range(world)) - have) if isinstance(world, int) else []
        state = "complete" if complete else f"INCOMPLETE (missing ranks {missing or '?'})"
        print(f"  iteration {iteration}: world size {world}, {state}")


def _ls_dcp(base: Path) -> int:
    view = layout.local_view(base)
    complete = layout.complete_steps([view])
    print(f"DCP checkpoints under {base}")
    for step, _, markers in reversed(view):
        if step in complete:
            state = "complete"
        elif markers:
            state = f"INCOMPLETE (unfinished on ranks {markers})"
        else:
            state = "INCOMPLETE (no .metadata: the save never committed)"
        print(f"  step {step}: {state}")
    latest = layout.step_path(base, complete[0]) if complete else "none"
    print(f"latest complete: {latest}")
    return 0


def _verify(paths: Sequence[str]) -> int:
    failed = 0
    for path in paths:
        for target, check in _verifications(Path(path)):
            try:
                print(f"ok   {target}: {check()}")
            except (OSError, CheckpointingError) as e:
                print(f"FAIL {target}: {e}")
                failed += 1
    return 1 if failed else 0


def _verifications(path: Path) -> list[tuple[Path, Any]]:
    """``(what, check)`` pairs for a path: a part file, a DCP checkpoint, or a directory of parts."""
    if path.is_dir() and (path / layout.METADATA_NAME).exists():
        return [(path, lambda: _verify_dcp(path))]
    if path.is_dir():
        parts = sorted(  # a rank's directory, a session's or a root's
            p
            for pattern in ("*", "*/*", "*/*/*")
            for p in path.glob(pattern)
            if parse_part_name(p.name) is not None and p.is_file()
        )
        return [(p, lambda p=p: _verify_part(p)) for p in parts] or [
            (
                path,
                _refused("neither a DCP checkpoint (no .metadata) nor a directory of part files"),
            )
        ]
    if path.suffix == ".distcp":
        return [
            (path, _refused(f"a DCP data file: verify its checkpoint directory ({path.parent})"))
        ]
    return [(path, lambda: _verify_part(path))]


def _verify_part(path: Path) -> str:
    header = fileformat.verify(path)
    parsed = parse_part_name(path.name)
    if parsed is not None:  # a part file's name must agree with its metadata, as the manager checks
        part_world_size(path, *parsed)
    return f"{len(header.records)} tensors, {header.file_size} bytes"


def _verify_dcp(path: Path) -> str:
    summary = verify_checkpoint(path)
    checked = (
        "every item matches its checksum"
        if summary.verified
        else "unverified: no checksum manifest (not written by tierpoint)"
    )
    return (
        f"DCP checkpoint: {summary.tensors} tensors ({summary.tensor_bytes} bytes) and "
        f"{summary.values} other values read and decoded; {checked}"
    )


def _refused(message: str) -> Any:
    """A check that fails with ``message``: the path is not something ``verify`` can check."""

    def check() -> str:
        raise CheckpointingError(message)

    return check


def _inspect(path: str) -> int:
    if os.path.isdir(path) or path.endswith((".distcp", ".metadata")):
        print(
            f"{path}: inspect shows one local-tier part file; for DCP checkpoints and "
            "directories use `tierpoint ls` or `tierpoint verify`",
            file=sys.stderr,
        )
        return 2
    try:
        header = fileformat.read_header(path)
    except (OSError, CheckpointingError) as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 1
    print(f"{path}: {header.file_size} bytes, metadata {json.dumps(header.extra)}")
    for r in header.records:
        print(f"  {r.name}  {r.dtype}  {list(r.shape)}  xxh3 {r.checksum}  ({r.device})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list local-tier or DCP checkpoints and their completeness")
    ls.add_argument(
        "root", nargs="?", default=str(default_root()), help="local-tier root or DCP base directory"
    )
    verify = sub.add_parser("verify", help="check part files or DCP checkpoints completely")
    verify.add_argument(
        "files", nargs="+", metavar="PATH", help="part file, directory of part files, DCP directory"
    )
    inspect = sub.add_parser("inspect", help="show a part file's metadata and tensors")
    inspect.add_argument("file", metavar="FILE", help="a local-tier part file")
    sub.add_parser("demo", help="run the fault-tolerant training demo", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "ls":
        return _ls(Path(args.root))
    if args.command == "verify":
        return _verify(args.files)
    return _inspect(args.file)


if __name__ == "__main__":
    sys.exit(main())
