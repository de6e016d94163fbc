"""Runs every ```python block of README.md and of every docs/*.md, so that the docs cannot rot.

Conventions (stated in docs/migrating.md): a block runs in this process, in a fresh namespace,
unless the line before its fence is ``<!-- ranks: N -->``; then it runs on N real processes joined
by a gloo group (:func:`tierpoint.testing.run_ranks`). Every block gets ``ROOT`` (a fresh directory
under /dev/shm, for the local tier) and ``BASE`` (a fresh temporary directory, for persistent
checkpoints), both ``pathlib.Path`` and removed afterwards. A block passes when it runs to its end:
each one asserts what a user relies on (loaded state equal to the saved one, the latest step, ...).
Blocks in other languages (bash, text) are not run; a Python block must be fenced ```python.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed

from tierpoint.testing import run_ranks

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_RANKS = re.compile(r"^<!--\s*ranks:\s*(\d+)\s*-->$")
_PYTHON_FENCE = re.compile(r"^```\s*(py|python|python3|pycon)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the first line of code in its file
    ranks: int  # 1: this process, without torch.distributed
    source: str
    path: Path


def doc_blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path``, with the rank count of each."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i] != "```python":
            i += 1
            continue
        marker = _RANKS.match(lines[i - 1].strip()) if i > 0 else None
        end = lines.index("```", i + 1)  # ValueError (a test error) if a fence is unclosed
        ranks = int(marker.group(1)) if marker else 1
        blocks.append(Block(i + 2, ranks, "\n".join(lines[i + 1 : end]), path))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCS for block in doc_blocks(path)]


def _execute(source: str, line: int, root: str, base: str, path: Path) -> None:
    """Run one block; tracebacks name its file and line numbers."""
    code = compile("\n" * (line - 1) + source, str(path), "exec")
    name = f"{path.stem}_md_line_{line}"
    exec(code, {"__name__": name, "ROOT": Path(root), "BASE": Path(base)})


def _execute_on_rank(
    rank: int, world_size: int, source: str, line: int, root: str, base: str, path: Path
) -> None:
    _execute(source, line, root, base, path)


def _close_default_dcp_queue() -> None:
    """``dcp.async_save`` without a queue starts a process-wide one: end it after each block."""
    from tierpoint.dcp import saving

    saving._close_default_queue()


@pytest.fixture
def dirs():
    root = tempfile.mkdtemp(prefix="tierpoint-docs-", dir="/dev/shm")
    base = tempfile.mkdtemp(prefix="tierpoint-docs-")
    try:
        yield root, base
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def test_every_doc_has_blocks_that_check_something() -> None:
    assert {b.path.name for b in BLOCKS} >= {"README.md", "migrating.md", "format.md"}
    assert any(b.ranks > 1 for b in BLOCKS) and any(b.ranks == 1 for b in BLOCKS)
    for block in BLOCKS:
        assert "assert " in block.source, (
            f"{block.path.name}:{block.line}: the block checks nothing"
        )


def test_python_blocks_are_fenced_so_that_they_run() -> None:
    """A block fenced ```py, ``` python or indented would silently not run."""
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line != "```python":
                assert not _PYTHON_FENCE.match(line.strip()), f"{path.name}:{n}: fence it ```python"


@pytest.mark.parametrize(
    "block", BLOCKS, ids=lambda b: f"{b.path.stem}-line{b.line}-ranks{b.ranks}"
)
def test_block_runs(block: Block, dirs: tuple[str, str], monkeypatch) -> None:
    root, base = dirs
    monkeypatch.chdir(base)  # a block writing to a relative path writes into BASE
    if block.ranks == 1:
        assert not torch.distributed.is_initialized()  # "one process, without torch.distributed"
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        try:
            _execute(block.source, block.line, root, base, block.path)
        finally:
            _close_default_dcp_queue()
    else:
        env = {"TIERPOINT_TIMEOUT": "60"}
        run_ranks(
            _execute_on_rank, block.ranks, block.source, block.line, root, base, block.path, env=env
        )
    assert os.path.isdir(root) and os.path.isdir(base)  # the block left its directories in place
