"""The bytes of ``.metadata``: torch's ``Metadata`` pickled, from a template while the layout stays.

Call order (the coordinator's commit, :meth:`~tierpoint.dcp.writer.Writer.commit`):
:func:`metadata_bytes` for the write results every rank sent (or the coordinator remembers), as
rows (:mod:`tierpoint.dcp.write_results`), torch's own flow :func:`pickled` for its ``WriteResult``
objects; then :func:`tierpoint.dcp.metadata_file.publish_metadata` writes them.

Pickling torch's ``Metadata`` costs about 14 us an item on the training thread of the coordinator,
where the commit runs (16 ms a save for a state of 1150 tensors, more than its snapshot copy). Saves
of an unchanged layout commit the same global metadata object and the very same rows; their
pickles differ only in a few strings: the save's file token in the data files' names, the step
directory and the save id. So the second commit of a layout pickles it with placeholders in those
places, and from then on each commit puts its own strings there: the bytes are the template's,
spliced (one pass over them, no object made per item). Written by hand because pickle offers no way
to reuse the bytes of an unchanged object graph.

Invariants:
- A template is used only where it makes what pickling would: it is pickled twice with different
  placeholders, and the second pickle must equal the first spliced with the second's strings (so
  each placeholder stands exactly where its string goes, and nowhere else). Else, and for strings
  that are not ASCII, the commit pickles as usual.
- Each placeholder is as long as the string it stands for (a new template for a new length), so the
  pickle's length prefixes and frames stay valid.
- A template belongs to one global metadata object and one list of rows, held with it (a recycled
  ``id`` never finds it); the metadata and rows are never changed in place (both are rebuilt for a
  new layout).
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from .plan_data import PlanMemo
from .write_results import Row, decoded

try:  # the version string torch's own writer records
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    CURRENT_DCP_VERSION = None

Rows = Sequence[Sequence[Row]]
"""Every rank's write results, as rows (coordinator's order)."""


def pickled(
    metadata: Metadata, storage_data: Mapping[Any, Any], storage_meta: StorageMeta | None
) -> bytes:
    """``metadata`` (the global plan's) completed with the save's ``storage_data`` and
    ``storage_meta`` (and the version torch's own writer records), pickled."""
    md = dataclasses.replace(metadata, storage_data=dict(storage_data), storage_meta=storage_meta)
    if CURRENT_DCP_VERSION is not None:
        md.version = CURRENT_DCP_VERSION
    if hasattr(metadata, "all_local_plans"):  # NVRx's attribute (see tierpoint.dcp.planning)
        md.all_local_plans = metadata.all_local_plans  # type: ignore[attr-defined]
    return pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)


def storage_data(rows: Rows, token: str) -> dict[MetadataIndex, _StorageInfo]:
    """Each item's place, from every rank's ``rows``, the data files named for the save ``token``."""
    return {index: place for rank_rows in rows for index, _, place in decoded(rank_rows, token)}


def file_names(rows: Rows) -> set[str]:
    """The data files ``rows`` name (without the save's token)."""
    return {row[4] for rank_rows in rows for row in rank_rows}


@dataclasses.dataclass
class _Layout:
    """What is known of commits of one metadata object, rows and string lengths."""

    rows: Rows  # held: its id is part of the key
    commits: int = 0
    template: _Template | None = None


@dataclasses.dataclass(frozen=True)
class _Template:
    pieces: tuple[bytes, ...]
    """The pickle split where the strings go: ``pieces[0] s0 pieces[1] s1 ...``."""
    slots: tuple[int, ...]
    """Which string goes after each piece but the last (an index into the save's strings)."""

    def splice(self, strings: Sequence[bytes]) -> bytes:
        parts = [self.pieces[0]]
        for slot, piece in zip(self.slots, self.pieces[1:]):
            parts += (strings[slot], piece)
        return b"".join(parts)


_LAYOUTS: PlanMemo[_Layout] = PlanMemo(size=4)


def metadata_bytes(
    metadata: Metadata, rows: Rows, token: str, storage_meta: StorageMeta | None
) -> bytes:
    """The pickled ``Metadata`` of a save whose write results are ``rows`` and whose data files
    carry ``token``: as :func:`pickled` makes it, from a template where one fits (see the module
    docstring)."""
    strings = _strings(token, storage_meta)
    if strings is None:
        return pickled(metadata, storage_data(rows, token), storage_meta)
    key = (id(rows), tuple(len(s) for s in strings))
    layout = _LAYOUTS.get(metadata, key, lambda: _Layout(rows))
    layout.commits += 1
    if layout.commits == 2:  # not for a layout committed once only
        assert storage_meta is not None  # _strings has them
        layout.template = _template(metadata, rows, storage_meta, [len(s) for s in strings])
    if layout.template is not None:
        return layout.template.splice(strings)
    return pickled(metadata, storage_data(rows, token), storage_meta)


def _strings(token: str, meta: StorageMeta | None) -> list[bytes] | None:
    """The save's own strings (token, step directory, save id), or None where no template can
    stand for them (not ASCII, not strings, or a storage meta with other values than the
    defaults: a torch whose storage meta gets a value per save is then pickled as usual)."""
    if meta is None or meta != StorageMeta(checkpoint_id=meta.checkpoint_id, save_id=meta.save_id):
        return None
    strings = (token, meta.checkpoint_id, meta.save_id)
    if not all(isinstance(s, str) and s and s.isascii() for s in strings):
        return None
    return [s.encode("ascii") for s in strings]  # type: ignore[union-attr]


def _template(
    metadata: Metadata, rows: Rows, meta: StorageMeta, lengths: Iterable[int]
) -> _Template | None:
    """The template for saves of these string lengths, or None where placeholders do not fit."""
    lengths = list(lengths)
    first = _placeholders(lengths)
    second = _placeholders(lengths, unlike=first)
    made = [_pickle_with(metadata, rows, meta, strings) for strings in (first, second)]
    where = {s: k for k, s in enumerate(first)}
    pieces, slots, at = [], [], 0
    for found in re.finditer(b"|".join(re.escape(s) for s in first), made[0]):
        pieces.append(made[0][at : found.start()])
        slots.append(where[found.group()])
        at = found.end()
    pieces.append(made[0][at:])
    template = _Template(tuple(pieces), tuple(slots))
    if sorted(set(slots)) != list(range(len(first))) or template.splice(second) != made[1]:
        return None
    return template


def _placeholders(lengths: Sequence[int], unlike: Sequence[bytes] = ()) -> list[bytes]:
    """Random hex strings of ``lengths`` (ASCII, so as long in bytes), all different, and each
    different from the one at its place in ``unlike``."""
    while True:
        out = [secrets.token_hex(n)[:n].encode("ascii") for n in lengths]
        if len(set(out)) == len(out) and not any(a == b for a, b in zip(out, unlike)):
            return out


def _pickle_with(metadata: Metadata, rows: Rows, meta: StorageMeta, strings: list[bytes]) -> bytes:
    token, checkpoint_id, save_id = (s.decode("ascii") for s in strings)
    return pickled(
        metadata,
        storage_data(rows, token),
        dataclasses.replace(meta, checkpoint_id=checkpoint_id, save_id=save_id),
    )
