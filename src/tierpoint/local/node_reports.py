"""What a node's ranks report during a restore, merged into one small record per node.

Call order (inside a collective find_latest or load, see :func:`tierpoint.dist.gather_by_node`):
every rank sends its report (its committed parts, or its :class:`HolderStatus` for the iteration
being loaded) to its node's leader; the leader calls :func:`merge_listings` or
:func:`merge_statuses`; every rank receives every node's record and expands it again
(:func:`listing_parts`, :func:`expand_statuses`).

Invariants:
- A record lists ranks as ranges (``[first, last]``, inclusive), so it stays about as small as one
  rank's report when the node's ranks report alike: its own ranks' parts and the replicas it holds
  for the ranks of other nodes are runs of consecutive ranks. What restores receive then grows
  with the number of nodes, not of ranks.
- Texts (errors, the reason a part could not be read) are kept for the ranks that have one only.
- Expanding a merge gives back exactly what was reported (a pure function; every rank computes
  the same).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointingError
from ..rank_ranges import expand, ranges


def merge_listings(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One node's committed parts from its ranks' reports ``{"rank", "parts": [[iteration, origin,
    world], ...], "error"}``: ``{"parts": [[iteration, world, origin ranges], ...], "errors":
    {rank: error status}}``."""
    origins: dict[tuple[int, int], set[int]] = {}
    for report in reports:
        for iteration, origin, world in report["parts"]:
            origins.setdefault((iteration, world), set()).add(origin)
    return {
        "parts": [[i, w, ranges(o)] for (i, w), o in sorted(origins.items())],
        "errors": {str(r["rank"]): r["error"] for r in reports if r["error"] is not None},
    }


def listing_parts(record: dict[str, Any]) -> list[list[int]]:
    """A node's parts as ``[iteration, origin, world]`` again."""
    return [[i, origin, w] for i, w, spans in record["parts"] for origin in expand(spans)]


def merge_statuses(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One node's holder statuses from its ranks' reports (``rank``, the fields of a
    ``HolderStatus``, and optionally ``reason`` / ``kind``). Ranks whose status is the same but for
    their own number (each holds the parts of the ranks at the same distance, from the same saves)
    form one group: ``{"groups": [[own_ok, held offsets, bad sources, rank ranges, saves], ...],
    "texts": {rank: [reason, kind]}}``."""
    groups: dict[tuple, list[int]] = {}
    texts: dict[str, list[Any]] = {}
    for report in reports:
        rank = report["rank"]
        key = (
            bool(report["own_ok"]),
            tuple(h - rank for h in report["holds"]),
            tuple(tuple(b) for b in report["bad_sources"]),
            tuple(report.get("saves") or ()),
        )
        groups.setdefault(key, []).append(rank)
        if report.get("reason") or report.get("kind"):
            texts[str(rank)] = [report.get("reason"), report.get("kind")]
    return {
        "groups": [
            [own_ok, list(offsets), [list(b) for b in bad], ranges(members), list(saves)]
            for (own_ok, offsets, bad, saves), members in groups.items()
        ],
        "texts": texts,
    }


def expand_statuses(records: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """Every rank's status again, in rank order, from every node's :func:`merge_statuses`."""
    statuses: list[dict[str, Any] | None] = [None] * world_size
    for record in records:
        for own_ok, offsets, bad, spans, saves in record["groups"]:
            for rank in expand(spans):
                statuses[rank] = {
                    "own_ok": own_ok,
                    "holds": [rank + o for o in offsets],
                    "bad_sources": [list(b) for b in bad],
                    "saves": list(saves),
                    "reason": None,
                    "kind": None,
                }
        for rank, (reason, kind) in record["texts"].items():
            entry = statuses[int(rank)]
            if entry is not None:
                entry["reason"], entry["kind"] = reason, kind
    missing = [r for r, s in enumerate(statuses) if s is None]
    if missing:
        raise CheckpointingError(f"no status came from ranks {ranges(missing)}")
    return [s for s in statuses if s is not None]
