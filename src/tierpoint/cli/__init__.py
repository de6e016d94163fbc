"""The ``tierpoint`` command: look into, check and convert checkpoints without writing Python.

Subcommands (``tierpoint <command> --help`` for each):

- ``ls PATH|URL``: every checkpoint under a local-tier root, session or rank directory, a DCP base
  directory or step (a directory or ``s3://`` URL), or an OLMo-core-style run directory
  (``step<N>/model_and_optim``): step, tier, ranks present, replicas, size, age, status
  (complete / incomplete / corrupt, from headers and metadata: ``verify`` reads every byte; an
  OLMo-core step as the Checkpointer's discovery judges it) and the newest restorable one;
- ``inspect FILE|DIR``: a part file's tensors (name, dtype, shape, bytes, checksum), its stored
  non-tensor values and skeleton; a DCP step's metadata items and values; a ``.pt`` file's (loaded
  with ``weights_only=True``) or another writer's ``.safetensors`` file's (its header) tensors;
- ``verify PATH|URL...``: every checksum of part files, of a directory of them, of a DCP step or of
  every step of a DCP base (an uncommitted step is skipped: it is never loaded), and of an
  OLMo-core step's ``.metadata.json`` and trainer-state files (or its ``train/``); exit status 0
  only when nothing failed (a DCP step without checksum manifests, written by plain torch, is
  read completely and reported unverified, as is a plain safetensors file; ``--strict`` fails
  them);
- ``convert SRC DST``: a part file, a local-tier iteration or a DCP checkpoint to one
  ``.safetensors`` or ``torch.save`` ``.pt`` file, and such a file back to a DCP checkpoint (an
  existing ``DST``, or a non-empty directory, only with ``--force``);
- ``bench [NAME]``: the benchmark suite (``benchmarks/*_bench.py`` of a source checkout, or
  ``--dir``) at small sizes, one table, JSON, and a PNG chart where matplotlib is installed;
- ``demo``: the fault-tolerant training demo (:mod:`tierpoint.demo`).

The package: this module holds :func:`main` (the parser and the dispatch); each command is one
module: ``listing`` (ls), ``inspection``, ``verification``, ``conversion``, ``bench``; they share
``locate`` (what a path is), ``files`` (``.pt`` and safetensors files), ``olmo`` (an OLMo-core
step's ``.metadata.json`` and trainer state, for ``ls`` and ``verify``) and ``output`` (consoles,
tables, JSON, :class:`CommandError`). ``python -m tierpoint.cli`` runs :func:`main`.

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
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .. import __version__
from ..errors import CheckpointingError
from .bench import cmd_bench
from .conversion import cmd_convert
from .inspection import cmd_inspect
from .listing import Row, cmd_ls
from .output import CommandError
from .verification import cmd_verify


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
    inspect.add_argument("path", metavar="FILE|DIR",
                         help="a part file, a DCP step (or URL), a .pt or .safetensors file")  # fmt: skip
    verify = command("verify", "check every checksum; exit status 0 only if none fails")
    verify.add_argument(
        "--strict", action="store_true", help="fail DCP checkpoints without checksum manifests"
    )
    verify.add_argument("paths", metavar="PATH|URL", nargs="+",
                        help="part file, directory of part files, DCP step or base directory, "
                        "OLMo-style step or its train/")  # fmt: skip
    convert = command("convert", "convert to one .safetensors or .pt file, or back to DCP",
                      json_flag=False)  # fmt: skip
    convert.add_argument("src", metavar="SRC", help="part file, local-tier directory, DCP step, "
                         ".safetensors or .pt file")  # fmt: skip
    convert.add_argument("dst", metavar="DST", help="a .safetensors or .pt file, else a DCP step")
    convert.add_argument("--iteration", type=int, help="local tier: which iteration (newest)")
    convert.add_argument("--rank", type=int, help="local tier: one rank's part (default all)")
    convert.add_argument(
        "--force", action="store_true", help="replace DST (write into a non-empty directory)"
    )
    bench = command("bench", "run the benchmark suite at small sizes; table, JSON, chart",
                    store=False)  # fmt: skip
    bench.add_argument("names", metavar="NAME", nargs="*", help="benchmarks to run (default all)")
    bench.add_argument("--full", action="store_true", help="the benchmarks' default sizes")
    bench.add_argument("--out", default="tierpoint-bench", help="where bench.json and bench.png go")
    bench.add_argument("--dir", help="directory of *_bench.py scripts (default: the repository's)")
    bench.add_argument("--timeout", type=_seconds, default=None,
                       help="seconds per benchmark (default 1800, with --full 14400)")  # fmt: skip
    sub.add_parser("demo", help="run the fault-tolerant training demo", add_help=False)
    return parser


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": cmd_ls,
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "convert": cmd_convert,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tierpoint`` command; returns the exit status."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from ..demo import main as demo_main

        return demo_main(rest, prog="tierpoint demo")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "ls" and args.path is None:
        from ..local.naming import default_root

        try:
            args.path = str(default_root())
        except CheckpointingError as e:
            print(f"tierpoint ls: {e}", file=sys.stderr)
            return 1
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
        if os.environ.get("TIERPOINT_DEBUG", "0") not in ("", "0"):
            raise
        code = e.code if isinstance(e, CommandError) else 1
        known = isinstance(e, (CommandError, CheckpointingError, OSError))
        text = str(e) if known else f"{type(e).__name__}: {e}"
        print(f"tierpoint {args.command}: {' '.join(text.split())}", file=sys.stderr)
        return code
    finally:
        library_logger.setLevel(level)


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _normal_path(value: str, source: bool) -> str:
    """``file://`` URLs as local paths; a DCP step's ``.metadata`` (to read) as its directory."""
    if value.startswith("file://"):
        value = value[len("file://") :]
    if source and os.path.basename(value) == ".metadata":
        value = os.path.dirname(value) or "."
    return value


__all__ = ["CommandError", "Row", "main"]
