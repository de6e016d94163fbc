"""What the ``tierpoint`` commands print: rich consoles and tables, JSON, human sizes and ages,
progress bars, and :class:`CommandError`, the one-line failure.

Call order: a command builds its console with :func:`make_console`, prints tables made by
:func:`make_table` (or JSON with :func:`print_json`); :func:`tierpoint.cli.main` turns a
:class:`CommandError` into one line on stderr and its exit status.

Invariants: rich is imported only when something is printed (``--help`` stays fast); output that
is not a terminal gets wide lines, no colours and nothing cut.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any


class CommandError(Exception):
    """A failure the command reports as one line (the message) and exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


_UNBOUNDED = 1 << 16  # characters: wider than any line the commands print


def make_console(stderr: bool = False) -> Any:
    """A rich console on stdout (or stderr)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Not a terminal (a pipe, a file, a test): no colours, and lines as long as their text (a
    # table takes its natural width), so that no path is folded or cut.
    return Console(file=stream, width=None if stream.isatty() else _UNBOUNDED, highlight=False)


def make_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    """A rich table of ``rows`` (None shows as empty) under the line ``title``."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table()
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    # The title is a line of its own, not the table's: a table's title folds to the table's width.
    return Group(Text(title, style="italic"), table)


def print_json(doc: Any) -> None:
    """``doc`` as indented JSON on stdout (what JSON cannot hold, as text)."""
    print(json.dumps(doc, indent=2, default=str))


def human_size(n: int | None) -> str:
    """``n`` bytes as ``12.3 MiB``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def human_age(mtime: float | None) -> str:
    """How long ago ``mtime`` was, as ``3h ago``."""
    if mtime is None:
        return "-"
    seconds = max(0.0, time.time() - mtime)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def progress_bar(console: Any, enabled: bool) -> Any:
    """A rich progress bar on a terminal, else a stand-in that shows nothing."""
    if enabled and console.is_terminal:
        from rich.progress import Progress

        return Progress(console=console, transient=True)
    return NoProgress()


class NoProgress:
    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None
