"""Fetching a DCP checkpoint's files from peers when it lives on node-local disks: every node gets
the files its ranks read.

When each node writes a checkpoint to its own disk, a node holds only its ranks' ``.distcp`` files,
and only the coordinator's node holds ``.metadata``. After a restart (ranks on other nodes, a
node that lost files) a node may lack what its ranks must read. :func:`retrieve_missing` fetches it
from the nodes that have it, over tierpoint's coordination group (:mod:`tierpoint.peers.transfer`:
bucketed, checksummed on receipt, committed atomically).

Call order: every rank calls :func:`retrieve_missing` for the same step directory (the path on its
own node). Each rank lists the directory; all listings are gathered; the lowest rank that holds
``.metadata`` reads it (through the safe reader), makes the plan and broadcasts it; every rank carries
out its moves; the outcome is agreed.

What a node needs: ``.metadata``, and, when the world size is the one the checkpoint was saved with,
the data files its ranks wrote (``__<rank>_*``) plus every file holding an item that is not a shard
(a whole tensor or a non-tensor value: torch DCP writes a key that several ranks hold once, from
one rank, and every rank reads it there) or a chunk several ranks held (a DTensor replicated over
part of the mesh, as with HSDP: written once too); with another world size (resharding) every data file;
with each data file, the checksum manifest of its writer (:mod:`tierpoint.dcp.checksums`) where some
node has it.
A file counts as present only if it is at least as long as ``.metadata`` says; an earlier save's
file into the same step never has the name of one of this save's (see :mod:`tierpoint.dcp.file_plan`). Sources are spread:
each file comes from the holder with the fewest transfers assigned so far, never from one rank alone.

Invariants: the plan is made once and broadcast; a checkpoint whose files exist nowhere is reported
not viable (``False`` on every rank) instead of failing half-way, and so is one whose nodes hold
different ``.metadata`` files (the step was saved into again and a node kept the earlier save's:
which save is the newer cannot be told); every wait is bounded.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .. import dist as tpdist
from .. import peers
from ..errors import CheckpointingError, error_text
from ..files import DIRTY_SUFFIX
from ..peers import transfer
from ..rank_ranges import expand, ranges
from .checksums import manifest_name
from .names import METADATA_NAME
from .reader import read_metadata

logger = logging.getLogger("tierpoint")

_WRITER = re.compile(r"^__([0-9]+)_")


def _writer_of(name: str) -> int | None:
    m = _WRITER.match(name)
    return int(m.group(1)) if m else None


def _listing(step_dir: str) -> dict[str, int]:
    """``{name: size}`` of the regular files in ``step_dir`` (empty if it does not exist)."""
    try:
        entries = list(os.scandir(step_dir))
    except FileNotFoundError:
        return {}
    return {
        e.name: e.stat().st_size
        for e in entries
        if e.is_file() and not e.name.endswith(DIRTY_SUFFIX)
    }


def _metadata_digest(step_dir: str) -> str | None:
    """xxh3-64 of this node's ``.metadata`` (``None`` if it has none, or it cannot be read)."""
    try:
        with open(os.path.join(step_dir, METADATA_NAME), "rb") as f:
            return xxhash.xxh3_64_hexdigest(f.read())
    except OSError:
        return None


def _required_sizes(step_dir: str) -> tuple[dict[str, int], set[str]]:
    """Every data file ``.metadata`` refers to, with the length it must have at least; and the
    files that hold an item every rank may read (not a shard: one chunk, or a non-tensor value)."""
    metadata = read_metadata(step_dir)
    entries = metadata.state_dict_metadata
    sizes: dict[str, int] = defaultdict(int)
    shared: set[str] = set()
    for index, info in (metadata.storage_data or {}).items():
        name = info.relative_path
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise CheckpointingError(f"{step_dir}: .metadata names an unsafe file {name!r}")
        sizes[name] = max(sizes[name], int(info.offset) + int(info.length))
        entry = entries.get(index.fqn)
        if not isinstance(entry, TensorStorageMetadata) or len(entry.chunks) <= 1:
            shared.add(name)
    return dict(sizes), shared | _replicated_chunk_files(metadata)


def _chunk_key(index: Any) -> tuple:
    offset = getattr(index, "offset", None)
    return (index.fqn, None if offset is None else tuple(int(x) for x in offset))


def _replicated_chunk_files(metadata: Any) -> set[str]:
    """The files holding a tensor chunk that several ranks held at the save (a DTensor replicated
    over part of the mesh, as HSDP's ``[Replicate(), Shard(0)]``): torch DCP writes such a chunk
    once, from one of its holders, and every holder reads it from there at a load with the same
    layout, on whatever node it runs. Known from the ranks' plans tierpoint records in
    ``.metadata`` (``all_local_plans``); without them, every chunk of a tensor that has fewer
    chunks than the checkpoint has writers counts (a tensor sharded over only some ranks then
    travels to every node too: more than needed, never less)."""
    storage_data = metadata.storage_data or {}
    plans = getattr(metadata, "all_local_plans", None)
    if plans:
        holders: dict[tuple, int] = defaultdict(int)
        for plan in plans:
            for key in {_chunk_key(item.index) for item in getattr(plan, "items", None) or ()}:
                holders[key] += 1
        return {
            info.relative_path
            for index, info in storage_data.items()
            if holders.get(_chunk_key(index), 0) > 1
        }
    writers = {_writer_of(info.relative_path) for info in storage_data.values()}
    entries = metadata.state_dict_metadata
    return {
        info.relative_path
        for index, info in storage_data.items()
        if isinstance(entry := entries.get(index.fqn), TensorStorageMetadata)
        and len(entry.chunks) < len(writers)
    }


def plan_moves(
    listings: list[dict[str, int]],
    required: dict[str, int],
    metadata_size: int,
    node_of_rank: list[str],
    shared: set[str] | frozenset[str] = frozenset(),
    all_files: bool = False,
) -> list[tuple[int, int, str]] | None:
    """``(source rank, destination rank, file name)`` moves, or ``None`` if some file exists nowhere.

    ``shared``: the files every rank may read (see :func:`_required_sizes`); ``all_files``: every
    node needs every data file, as at another world size."""
    world = len(listings)
    writers = {_writer_of(n) for n in required}
    same_world = writers == set(range(world)) and not all_files
    manifests = {n: manifest_name(n) for n in required}
    present = {m for m in manifests.values() if m and any(m in listing for listing in listings)}
    want = dict(required, **{METADATA_NAME: metadata_size}, **dict.fromkeys(present, 1))

    def needs(rank: int) -> list[str]:
        own = [n for n in required if not same_world or _writer_of(n) == rank or n in shared]
        checksums = {manifests[n] for n in own} & present
        return [METADATA_NAME, *sorted(own), *sorted(checksums)]

    holders: dict[str, list[int]] = defaultdict(list)  # ranks that have each wanted file
    for rank, listing in enumerate(listings):
        for name, size in listing.items():
            if size >= want.get(name, size + 1):
                holders[name].append(rank)
    load = [0] * world
    moves: list[tuple[int, int, str]] = []
    # (node, name): present on the node, or being fetched to it
    planned = {(node_of_rank[r], name) for name, ranks in holders.items() for r in ranks}
    for rank in range(world):
        node = node_of_rank[rank]
        for name in needs(rank):
            if (node, name) in planned:
                continue
            sources = [s for s in holders.get(name, []) if node_of_rank[s] != node]
            if not sources:
                return None
            src = min(sources, key=lambda s: (load[s], s))
            load[src] += 1
            moves.append((src, rank, name))
            planned.add((node, name))
    return moves


def _gather_listings(step_dir: str, layout: tpdist.NodeLayout) -> list[dict[str, Any]]:
    """Every rank's ``{"files": {name: size}, "metadata": digest}`` of ``step_dir``, in rank
    order. Collective. Each rank lists its directory; the listings travel once per node
    (:func:`tierpoint.dist.gather_by_node`): a node's ranks that see the same files (one directory
    per node) share one listing, whose files that carry a writer's rank are named by pattern and
    ranges of ranks (:func:`_merge_node_listings`). Each rank then receives O(nodes) bytes when
    the ranks' files are alike in size, as with evenly sharded states."""
    report = {
        "rank": layout.rank,
        "files": _listing(step_dir),
        "metadata": _metadata_digest(step_dir),
    }
    records = tpdist.gather_by_node(
        report, _merge_node_listings, f"listing {step_dir} on every rank"
    )
    seen: list[dict[str, Any] | None] = [None] * len(layout.node_of_rank)
    for record in records:
        for compressed, spans in record:
            listing = _expand_listing(compressed)
            for rank in expand(spans):
                seen[rank] = listing
    if any(v is None for v in seen):
        raise CheckpointingError(f"listing {step_dir}: some rank's listing did not arrive")
    return [v for v in seen if v is not None]


_RANKED = (re.compile(r"^(__)([0-9]+)(_.*)$"), re.compile(r"^(\.checksums-)([0-9]+)(\..*)$"))


def _merge_node_listings(reports: list[dict[str, Any]]) -> list[list[Any]]:
    """A node's listings, each distinct one once with the ranks that reported it: ``[[listing,
    rank ranges], ...]``; a listing is ``{"files": [[prefix, suffix, size, rank ranges], ...],
    "other": {name: size}, "metadata": digest}`` (names that carry a writer's rank, grouped)."""
    distinct: dict[str, tuple[dict[str, Any], list[int]]] = {}
    for report in reports:
        key = json.dumps([report["files"], report["metadata"]], sort_keys=True)
        if key not in distinct:
            distinct[key] = (report, [])
        distinct[key][1].append(report["rank"])
    return [[_compress(report), ranges(ranks)] for report, ranks in distinct.values()]


def _compress(report: dict[str, Any]) -> dict[str, Any]:
    groups: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    other: dict[str, int] = {}
    for name, size in report["files"].items():
        match = next((m for m in (p.match(name) for p in _RANKED) if m), None)
        if match is None:
            other[name] = size
        else:
            groups[(match.group(1), match.group(3), size)].append(int(match.group(2)))
    return {
        "files": [[p, x, size, ranges(ranks)] for (p, x, size), ranks in groups.items()],
        "other": other,
        "metadata": report["metadata"],
    }


def _expand_listing(compressed: dict[str, Any]) -> dict[str, Any]:
    files = dict(compressed["other"])
    for prefix, suffix, size, spans in compressed["files"]:
        files.update({f"{prefix}{rank}{suffix}": size for rank in expand(spans)})
    return {"files": files, "metadata": compressed["metadata"]}


def retrieve_missing(
    step_dir: str, *, timeout: float | None = None, all_files: bool = False
) -> bool:
    """Fetch the files this node's ranks need for ``step_dir`` from peers (``all_files``: every data
    file, for a load in another layout than the save's). Collective.

    Returns ``False`` on every rank when the checkpoint cannot be completed (a file exists nowhere,
    nobody has ``.metadata``, or nodes hold different ``.metadata`` files); raises the same
    :class:`CheckpointingError` on every rank when a transfer fails.
    """
    limit = tpdist.timeout_or(timeout, tpdist.default_timeout().total_seconds())
    step_dir = str(step_dir)
    layout = tpdist.node_layout()
    seen = _gather_listings(step_dir, layout)
    listings = [view["files"] for view in seen]
    holders = [r for r, listing in enumerate(listings) if METADATA_NAME in listing]
    if not holders:
        return False
    versions: dict[str | None, list[str]] = defaultdict(list)
    for r in holders:
        node = layout.node_of_rank[r]
        if node not in versions[seen[r]["metadata"]]:
            versions[seen[r]["metadata"]].append(node)
    if len(versions) > 1:
        # The step was saved into again: some node keeps an earlier save's .metadata. Which save
        # is the newer cannot be told.
        logger.warning(
            "%s: different .metadata files on %s: the step was saved into again and an earlier "
            "save's files are left; it is not loaded",
            step_dir,
            " and on ".join(", ".join(nodes) for nodes in versions.values()),
        )
        return False
    decider = holders[0]
    plan: Any = None
    if tpdist.get_rank() == decider:
        try:
            required, shared = _required_sizes(step_dir)
            moves = plan_moves(
                listings,
                required,
                listings[decider][METADATA_NAME],
                list(layout.node_of_rank),
                shared,
                all_files,
            )
            plan = {"moves": moves, "error": None}
        except (OSError, CheckpointingError) as e:
            plan = {"moves": None, "error": error_text(e)}
    plan = tpdist.broadcast_json(plan, decider, f"sharing the retrieval plan of {step_dir}")
    if plan["error"]:
        raise CheckpointingError(f"cannot plan the retrieval of {step_dir}: {plan['error']}")
    if plan["moves"] is None:
        logger.warning("%s: some files exist on no rank; the checkpoint is not viable", step_dir)
        return False
    moves = [
        # (as a DCP writer's files: readable by others where the umask allows)
        peers.FileMove(src, dst, os.path.join(step_dir, name), os.path.join(step_dir, name), 0o666)
        for src, dst, name in plan["moves"]
    ]
    if moves and tpdist.get_rank() == 0:
        logger.info(
            "%s: fetching %d file(s) from peers: %s",
            step_dir,
            len(moves),
            ", ".join(f"{m.dst_path.rsplit('/', 1)[-1]} rank {m.src} -> {m.dst}" for m in moves),
        )
    fetch_from_peers(moves, f"retrieving the missing files of {step_dir}", limit)
    return True


def fetch_from_peers(
    moves: Sequence[peers.FileMove], what: str, timeout: float | None = None
) -> None:
    """Carry out ``moves`` (the same list on every rank) over the coordination group, each file
    checked on receipt; a failure on any rank raises on every rank. Collective."""
    limit = tpdist.timeout_or(timeout, tpdist.default_timeout().total_seconds())
    with tpdist.agree(what):
        transfer.move_files(moves, tpdist.coordination_group(), timeout=limit, digest=True)
