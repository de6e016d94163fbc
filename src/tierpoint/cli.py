"""The ``tierpoint`` command: look into checkpoints without writing a line of Python.

Subcommands (each reads only; none runs code from a file):

- ``tierpoint ls [ROOT]``: the local tier under ROOT (default ``/dev/shm/tierpoint-<uid>``): per
  session, every iteration with the ranks whose parts exist somewhere (own or replica) and whether it
  is complete;
- ``tierpoint verify FILE...``: check part files completely (header and every tensor checksum);
  exit status 1 if any fails;
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

from . import fileformat
from .errors import CheckpointingError
from .local.naming import default_root, parse_part_name


def _ls(root: Path) -> int:
    if not root.is_dir():
        print(f"{root}: no such directory", file=sys.stderr)
        return 1
    for session in sorted(p for p in root.iterdir() if p.is_dir()):
        origins: dict[int, set[int]] = {}
        worlds: dict[int, set[int]] = {}
        for holder in sorted(p for p in session.iterdir() if p.is_dir()):
            for name in os.listdir(holder):
                parsed = parse_part_name(name)
                if parsed is None:
                    continue
                iteration, origin = parsed
                try:
                    world = fileformat.read_header(holder / name).extra.get("world_size")
                except (OSError, CheckpointingError) as e:
                    print(f"  unreadable: {holder / name}: {e}")
                    continue
                origins.setdefault(iteration, set()).add(origin)
                worlds.setdefault(iteration, set()).add(world)
        print(f"session {session.name!r} ({session})")
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
    return 0


def _verify(paths: Sequence[str]) -> int:
    failed = 0
    for path in paths:
        try:
            header = fileformat.verify(path)
        except (OSError, CheckpointingError) as e:
            print(f"FAIL {path}: {e}")
            failed += 1
            continue
        print(f"ok   {path}: {len(header.records)} tensors, {header.file_size} bytes")
    return 1 if failed else 0


def _inspect(path: str) -> int:
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
    ls = sub.add_parser("ls", help="list local-tier checkpoints and their completeness")
    ls.add_argument("root", nargs="?", default=str(default_root()))
    verify = sub.add_parser("verify", help="check part files completely")
    verify.add_argument("files", nargs="+")
    inspect = sub.add_parser("inspect", help="show a part file's metadata and tensors")
    inspect.add_argument("file")
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
