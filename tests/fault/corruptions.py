"""The corruption engine of the fault suite: seeded mutations of the files tierpoint writes, and the
one check that says whether a damaged file is seen.

Used by ``tests/fault/test_corruption.py`` (CI) and ``benchmarks/fault_runner.py`` (the long run).

Call order::

    files = catalogue(root)                    # every file of a kind tierpoint writes, sorted
    mutation = draw(seed, files, root)         # seeded: the same seed, the same mutation
    undo = apply(mutation, root)               # the file(s) damaged on disk
    outcome = inspect(mutation, root, before)  # "detected" / "harmless" / "silent"
    undo()                                     # the bytes as they were

File kinds (:func:`kind_of`): ``part`` (a local part, ``iter_<N>_<r>_local.safetensors``),
``distcp`` (DCP data), ``metadata`` (DCP ``.metadata``), ``manifest`` (``.checksums-<r>.<t>.json``),
``marker`` (a step's ``.unfinished-<r>``: never present in a committed step, so the mutation of that
kind plants a stale one in a committed step), ``trainer`` (a checkpointer's per-rank trainer state,
``<step>/train/rank<r>.safetensors``). Mutations (:data:`MUTATIONS`): ``flip`` (1-3 bits of
one byte; half of them in the first 512 bytes, where headers are), ``truncate`` (to a random
shorter length, 0 included), ``append`` (1-64 random bytes), ``swap_rank`` (the contents of the same
kind of file of another rank of the same step, in the same directory, exchanged), ``swap_step`` (the
same with the same rank's file of another step), ``plant`` (a marker). A swap with no partner on
disk becomes a flip. Every mutation names its seed: ``draw(seed, ...)`` replays it exactly on the
same checkpoint files.

Outcomes (:func:`inspect`): ``detected`` (reading the damaged file through tierpoint's own checks
raised a :class:`~tierpoint.errors.CheckpointingError`, or the damaged step no longer counts as
complete), ``harmless`` (the checks pass and every value read is bit-equal to the values before
the damage: appended bytes nobody reads, a swap of equal bytes), ``silent`` (the checks pass and a
value differs: the failure the suite exists to catch).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierpoint import dcp, fileformat
from tierpoint.checkpointer import trainer_state
from tierpoint.checkpointer.metadata import METADATA_FNAME, read_metadata
from tierpoint.dcp.step_dirs import MARKER_PREFIX, complete_steps, local_view, step_of
from tierpoint.errors import CheckpointingError
from tierpoint.local import naming

MUTATIONS = ("flip", "truncate", "append", "swap_rank", "swap_step")
KINDS = ("part", "distcp", "metadata", "manifest", "marker")
"""The kinds a tiered checkpoint holds (``trainer``: a checkpointer's, drawn when asked for)."""

_PART = re.compile(r"^iter_(\d+)_(\d+)_local\.safetensors$")
_DISTCP = re.compile(r"^__(\d+)_(\d+)\.([0-9a-f]+)\.distcp$")
_MANIFEST = re.compile(r"^\.checksums-(\d+)\.([0-9a-f]+)\.json$")
_TRAINER = re.compile(r"^rank(\d+)\.safetensors$")


def kind_of(path: Path) -> str | None:
    """The kind of file ``path`` is (see the module docstring), ``None`` for other files."""
    name = path.name
    if _PART.match(name):
        return "part"
    if _TRAINER.match(name) and path.parent.name == "train":
        return "trainer"
    if _DISTCP.match(name):
        return "distcp"
    if name == ".metadata":
        return "metadata"
    if _MANIFEST.match(name):
        return "manifest"
    if name.startswith(MARKER_PREFIX):
        return "marker"
    return None


def rank_of(path: Path) -> int | None:
    """The rank whose data a file holds (a part's origin, a data file's or manifest's writer)."""
    for pattern in (_PART, _DISTCP, _MANIFEST, _TRAINER):
        m = pattern.match(path.name)
        if m:
            return int(m.group(2) if pattern is _PART else m.group(1))
    return None


def step_of_file(path: Path) -> int | None:
    """The step (iteration) a file belongs to."""
    m = _PART.match(path.name)
    if m:
        return int(m.group(1))
    return step_of(_step_dir(path).name)


def _step_dir(path: Path) -> Path:
    """The step directory of a persistent file (a trainer state lies in its ``train/``)."""
    return path.parent.parent if kind_of(path) == "trainer" else path.parent


def _holder(path: Path) -> Path:
    """Where the files a file may be swapped with lie: a part's holder directory, the base of a
    persistent file's steps."""
    return path.parent if kind_of(path) == "part" else _step_dir(path).parent


def catalogue(root: Path) -> list[Path]:
    """Every file under ``root`` of a kind tierpoint writes, sorted (relative order = replay)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and kind_of(p) is not None)


@dataclass(frozen=True)
class Mutation:
    """One seeded damage: ``kind`` done to ``target`` (relative to the root), with ``partner`` for
    swaps, and what exactly (``detail``) for the report."""

    seed: int
    kind: str
    file_kind: str
    target: str
    partner: str | None = None
    offset: int = 0
    bits: int = 0
    length: int = 0
    detail: str = ""

    def describe(self) -> str:
        return f"seed {self.seed}: {self.kind} {self.target} ({self.file_kind}) {self.detail}"


def _partner(path: Path, files: list[Path], same_step: bool) -> Path | None:
    """The file of the same kind of another rank in the same step (``same_step``), or of the same
    rank in another step of the same directory tree."""
    kind, rank, step = kind_of(path), rank_of(path), step_of_file(path)
    found = []
    for other in files:
        if other == path or kind_of(other) != kind or _holder(other) != _holder(path):
            continue
        if same_step and step_of_file(other) == step and rank_of(other) != rank:
            found.append(other)
        elif not same_step and step_of_file(other) != step and rank_of(other) == rank:
            found.append(other)
    return found[0] if found else None


def draw(
    seed: int,
    files: list[Path],
    root: Path,
    kinds: tuple[str, ...] = KINDS,
    mutations: tuple[str, ...] = MUTATIONS,
) -> Mutation:
    """The mutation of seed ``seed`` over ``files`` (from :func:`catalogue`), of a file kind in
    ``kinds``; a ``marker`` draw plants a stale marker in a committed step."""
    rng = random.Random(seed)
    kind = rng.choice(kinds)
    if kind == "marker":
        steps = sorted({p.parent for p in files if kind_of(p) == "metadata"})
        if steps:
            step_dir = rng.choice(steps)
            rank = rng.randrange(2)
            target = step_dir / f"{MARKER_PREFIX}{rank}"
            return Mutation(seed, "plant", "marker", str(target.relative_to(root)))
        kind = "part"
    pool = [p for p in files if kind_of(p) == kind] or files
    path = rng.choice(pool)
    rel = str(path.relative_to(root))
    size = path.stat().st_size
    what = rng.choice(mutations)
    if what in ("swap_rank", "swap_step"):
        other = _partner(path, files, same_step=what == "swap_rank")
        if other is not None:
            return Mutation(
                seed, what, kind_of(path) or "", rel, str(other.relative_to(root)), detail="<->"
            )
        what = "flip"
    if what == "truncate" and size > 0:
        length = rng.randrange(size)
        return Mutation(seed, what, kind_of(path) or "", rel, length=length, detail=f"to {length}")
    if what == "append":
        length = rng.randint(1, 64)
        return Mutation(seed, what, kind_of(path) or "", rel, length=length, detail=f"+{length} B")
    high = size if rng.random() < 0.5 else min(size, 512)
    offset = rng.randrange(max(high, 1))
    bits = 0
    while not bits:
        bits = sum(1 << b for b in rng.sample(range(8), rng.randint(1, 3)))
    return Mutation(
        seed, "flip", kind_of(path) or "", rel, offset=offset, bits=bits, detail=f"@{offset}^{bits}"
    )


def apply(m: Mutation, root: Path) -> Callable[[], None]:
    """Damage the file(s) of ``m`` under ``root``; returns the function that undoes it."""
    target = root / m.target
    if m.kind == "plant":
        target.write_bytes(b"")

        def unplant() -> None:
            target.unlink(missing_ok=True)

        return unplant
    saved = {target: target.read_bytes()}
    if m.partner is not None:
        partner = root / m.partner
        saved[partner] = partner.read_bytes()
        _rewrite(target, saved[partner])
        _rewrite(partner, saved[target])
    elif m.kind == "truncate":
        os.truncate(target, m.length)
    elif m.kind == "append":
        with open(target, "ab") as f:
            f.write(random.Random(m.seed).randbytes(m.length))
    else:
        data = bytearray(saved[target])
        if data:
            data[m.offset] ^= m.bits
        _rewrite(target, bytes(data))

    def undo() -> None:
        for path, data in saved.items():
            _rewrite(path, data)

    return undo


def _rewrite(path: Path, data: bytes) -> None:
    """Replace a file's bytes in place (same inode: a reader's cache sees the change only by size
    and mtime, as after real damage)."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))


# ------------------------------------------------------------------------------------ reading


def read_values(path: Path, root: Path) -> Any:
    """Everything tierpoint would load from the file's checkpoint, through its own checks: a
    part's state (its name checked against its metadata), or every item of a DCP step (verified
    against the manifests; ``None`` when the step does not count as complete). Raises
    :class:`CheckpointingError` on damage it sees."""
    kind = kind_of(path)
    if kind == "trainer":
        step_dir = _step_dir(path)
        meta = read_metadata(str(step_dir)) if (step_dir / METADATA_FNAME).exists() else None
        world = meta.world_size if meta else None
        return trainer_state.read(
            str(step_dir),
            rank_of(path) or 0,
            world_size=world or 1,
            saved_world_size=world,
            save_id=meta.save_id if meta else None,
            allow_pickle=False,
            work_dir=str(root),
        )
    if kind == "part":
        m = _PART.match(path.name)
        assert m
        naming.part_world_size(path, int(m.group(1)), int(m.group(2)))
        fileformat.verify(path)
        return fileformat.read(path)
    step_dir = path.parent
    step = step_of(step_dir.name)
    if step not in complete_steps([local_view(step_dir.parent)]):
        return None
    dcp.verify_checkpoint(step_dir)
    metadata = dcp.read_metadata(str(step_dir))
    template: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if hasattr(meta, "size") and hasattr(meta, "properties"):
            template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            template[key] = None
    dcp.load(template, str(step_dir))
    return template


def inspect(m: Mutation, root: Path, before: Any) -> tuple[str, str]:
    """``(outcome, reason)`` of the damaged file (see the module docstring); ``before`` is
    :func:`read_values` of the same file before the damage."""
    path = root / m.target
    try:
        after = read_values(path, root)
    except CheckpointingError as e:
        return "detected", f"{type(e).__name__}: {e}"
    if after is None:
        return "detected", "the step no longer counts as complete"
    if same(after, before):
        return "harmless", "every value read is bit-equal"
    return "silent", "read without an error, but the values differ"


def same(a: Any, b: Any) -> bool:
    """Bit equality of nested dicts/lists/tensors/values (NaNs equal to themselves)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return _raw(a) == _raw(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
