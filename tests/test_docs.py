"""Runs every ```python block of docs/migrating.md, and the README's blocks marked as runnable, so
that the docs cannot rot.

Conventions (stated in the guide): a block runs in this process, in a fresh namespace, unless the
line before its fence is ``<!-- ranks: N -->``; then it runs on N real processes joined by a gloo
group (:func:`tierpoint.spawn.run_ranks`). Every block gets ``ROOT`` (a fresh directory under
/dev/shm, for the local tier) and ``BASE`` (a fresh temporary directory, for persistent
checkpoints), both ``pathlib.Path`` and removed afterwards. A block passes when it runs to its end:
each one asserts what a user relies on (loaded state equal to the saved one, the latest step, ...).
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

from tierpoint.spawn import run_ranks

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"
README = GUIDE.parents[1] / "README.md"
_RANKS = re.compile(r"^<!--\s*ranks:\s*(\d+)\s*-->$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the first line of code in the guide
    ranks: int  # 1: this process, without torch.distributed
    source: str
    path: Path = GUIDE


def guide_blocks(path: Path = GUIDE, marked_only: bool = False) -> list[Block]:
    """The ```python blocks of ``path``, with the rank count of each (with ``marked_only``, only
    the blocks with a ``<!-- ranks: N -->`` line before them)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        marker = _RANKS.match(lines[i - 1].strip()) if i > 0 else None
        end = lines.index("```", i + 1)  # ValueError (a test error) if a fence is unclosed
        ranks = int(marker.group(1)) if marker else 1
        if marker or not marked_only:
            blocks.append(Block(i + 2, ranks, "\n".join(lines[i + 1 : end]), path))
        i = end + 1
    return blocks


BLOCKS = guide_blocks() + guide_blocks(README, marked_only=True)


def _execute(source: str, line: int, root: str, base: str, path: Path = GUIDE) -> None:
    """Run one block; tracebacks name its file and line numbers."""
    code = compile("\n" * (line - 1) + source, str(path), "exec")
    exec(code, {"__name__": f"migrating_md_line_{line}", "ROOT": Path(root), "BASE": Path(base)})


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


def test_the_guide_has_blocks_that_check_something() -> None:
    assert len(BLOCKS) >= 5
    assert any(b.ranks > 1 for b in BLOCKS) and any(b.ranks == 1 for b in BLOCKS)
    for block in BLOCKS:
        assert "assert " in block.source, f"the block at line {block.line} checks nothing"


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
