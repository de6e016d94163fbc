"""PartStore: where each rank's part files live, which parts are committed, and what is known of
the complete iterations.

Call order: the manager makes one store (no collective, nothing touched on disk) and hands it to
its components (:mod:`~tierpoint.local.discovery`, :mod:`~tierpoint.local.recovery`,
:mod:`~tierpoint.local.saving`). They call :meth:`PartStore.scan` to list this rank's committed
parts, :func:`complete_iterations` on every rank's listing, :meth:`PartStore.part_path` /
:meth:`PartStore.move_parts` to write and exchange parts, and :meth:`PartStore.retire` /
:meth:`PartStore.remove_iteration` once every rank agreed what to keep. Nothing here is collective.

Invariants:
- Only a committed, structurally valid part is listed (its header checked once per file version,
  which also gives the save each part comes from: :meth:`PartStore.held_saves`).
- A spare (``spare_<n>.free``) is renamed away from its committed name before it is reused and is
  never a part of any checkpoint; a mapped file, or one held for a reader (:meth:`PartStore.hold`,
  see :mod:`tierpoint.local.holds`), is never made a spare nor handed out for reuse, and the
  mappings of files removed here are dropped (a mapping pins a file's pages).
- ``latest`` is an iteration every rank agreed on (found complete, loaded or committed) or ``None``
  when not known; ``unloadable`` holds the complete iterations a load found no good copy of (the
  next save removes them instead of being refused below them).
"""

from __future__ import annotations

import logging
import os
import stat
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .. import dist as tpdist
from .. import fileformat, peers
from ..errors import CheckpointingError, CorruptCheckpointError
from ..files import reserve, unlink_quietly
from ..peers import transfer
from . import naming
from .left_behind import LeftBehind, mark_node

logger = logging.getLogger("tierpoint")

Listing = list[list[int]]
"""One rank's (or node's) committed parts: ``[iteration, origin rank, world size]`` each."""


class PartStore:
    """This rank's part files under ``root/<session_id>/<rank>/`` (own parts and replicas), the
    places of the other ranks' files, and the mappings kept over them."""

    def __init__(self, root: Path, session_id: str) -> None:
        self.root = root
        self.session_id = session_id
        self.mappings = peers.MappingCache()
        self.latest: int | None = None
        self.unloadable: set[int] = set()
        self._scan_cache: dict[str, tuple[tuple[int, int, int] | None, list[int] | None, Any]] = {}
        self._held: Counter[tuple[int, int]] = Counter()  # (device, inode) -> holds
        self._spare_for_holds = 0  # 1 once a part was retired while held (see retire)
        self._marked: Path | None = None  # this rank's directory, once its node marker is written
        self.left_behind = LeftBehind(self.session_dir)

    # ------------------------------------------------------------------------------ places

    @property
    def rank(self) -> int:
        return tpdist.get_rank()

    @property
    def world_size(self) -> int:
        return tpdist.get_world_size()

    @property
    def session_dir(self) -> Path:
        return self.root / self.session_id

    def dir_of(self, holder: int) -> Path:
        """Where rank ``holder`` keeps its files (on its own node)."""
        return self.session_dir / str(holder)

    @property
    def directory(self) -> Path:
        """This rank's directory."""
        return self.dir_of(self.rank)

    def part_path(self, iteration: int, origin: int | None = None) -> Path:
        """Where this rank keeps the part of ``origin`` (default: its own) of ``iteration``."""
        return self.directory / naming.part_name(iteration, self.rank if origin is None else origin)

    def ensure_dir(self) -> None:
        path = self.directory
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        if self._marked != path:
            self._marked = mark_node(path)  # (see tierpoint.local.left_behind)

    # ------------------------------------------------------------------------------ listing

    def scan(self) -> Listing:
        """This rank's committed, structurally valid parts: ``[iteration, origin rank, world size]``.

        A header is validated once per file version (inode, size, mtime), so saves do not re-read it
        (and an unusable one is warned about once).
        """
        if not self.directory.is_dir():
            return []
        found = []
        seen: dict[str, tuple[tuple[int, int, int] | None, list[int] | None, Any]] = {}
        for entry in os.scandir(self.directory):
            parsed = naming.parse_part_name(entry.name)
            if parsed is None:
                continue
            try:
                version = naming.file_version(entry.stat())
            except OSError:  # a dangling link, a link loop: its validation says why, once
                version = None
            cached = self._scan_cache.get(entry.name)
            if cached is None or cached[0] != version:  # (an unusable file: warned once a version)
                cached = (version, *_validate_part(entry.path, *parsed))
            seen[entry.name] = cached
            if cached[1] is not None:
                found.append(cached[1])
        self._scan_cache = seen
        return found

    def remember_own_part(self, iteration: int) -> None:
        """Spare the next scan re-reading the header of the part this process just wrote."""
        path = self.part_path(iteration)
        version = naming.version_of(path)
        if version is not None:
            part = [iteration, self.rank, self.world_size]
            self._scan_cache[path.name] = (version, part, _UNREAD)

    def forget_scans(self) -> None:
        """Validate every header anew on the next scan (files arrived from peers)."""
        self._scan_cache.clear()

    def held_saves(self, iteration: int) -> dict[int, str]:
        """The origin ranks whose part of ``iteration`` this rank holds, and the save each copy
        comes from (its header's ``"save"`` token, as text; see :mod:`~tierpoint.local.agreement`)."""
        for name in [n for n, cached in self._scan_cache.items() if cached[2] is _UNREAD]:
            del self._scan_cache[name]  # remembered, its header not read: read by the scan
        self.scan()
        held = [
            (p[1], str(save)) for _, p, save in self._scan_cache.values() if p and p[0] == iteration
        ]
        return dict(sorted(held))

    def holds_parts(self) -> bool:
        try:
            return bool(self.scan())
        except (OSError, CheckpointingError):
            return False

    def other_ranks_with_parts(self) -> list[int]:
        """The other ranks whose directories under this session hold parts (``OSError`` when the
        session directory cannot be listed)."""
        return sorted(
            int(d.name)
            for d in os.scandir(self.session_dir)
            if d.name.isascii()
            and d.name.isdigit()
            and int(d.name) != self.rank
            and any(naming.parse_part_name(n) for n in os.listdir(d.path))
        )

    def part_files(self, dirty: bool = False) -> Iterator[tuple[os.DirEntry, int]]:
        """This rank's part files (own and replicas; with ``dirty``, unfinished ones too) and the
        iteration of each."""
        for entry in os.scandir(self.directory):
            name = entry.name.removesuffix(naming.DIRTY_SUFFIX) if dirty else entry.name
            parsed = naming.parse_part_name(name)
            if parsed is not None:
                yield entry, parsed[0]

    # ------------------------------------------------------------------------------ moving parts

    def part_moves(
        self, iteration: int, triples: Iterable[tuple[int, int, int]]
    ) -> list[peers.FileMove]:
        """``(source, destination, origin)`` -> moves of origin's part between the two directories."""
        name = naming.part_name
        return [
            peers.FileMove(
                src,
                dst,
                str(self.dir_of(src) / name(iteration, o)),
                str(self.dir_of(dst) / name(iteration, o)),
            )
            for src, dst, o in triples
        ]

    def move_parts(
        self, moves: list[peers.FileMove], group: Any, **options: Any
    ) -> peers.MoveStats:
        """Carry out ``moves`` over ``group`` (collective over it), each received part verified as
        it lands (:class:`ReceivedPart`); ``options``: more of :func:`tierpoint.peers.transfer.move_files`."""
        return transfer.move_files(
            moves,
            group,
            timeout=tpdist.default_timeout().total_seconds(),
            digest=False,  # the part file carries its own checksums, verified on receipt
            verify=ReceivedPart,
            mappings=self.mappings,
            **options,
        )

    # ------------------------------------------------------------------------------ removing

    def take_spare(self, leftovers: bool = True) -> Path | None:
        """A file whose pages a new file may reuse: a spare, or (``leftovers``) a stale dirty file."""
        for entry in os.scandir(self.directory):
            reusable = naming.is_spare_name(entry.name) or (
                leftovers and naming.is_dirty_name(entry.name)
            )
            if reusable and self._reusable(entry.path):
                return Path(entry.path)
        return None

    def hold(self, st: os.stat_result) -> tuple[int, int]:
        """Keep the file ``st`` describes from being made a spare or reused (its bytes do not
        change) until :meth:`release` of the key returned; its name may still be removed."""
        key = (st.st_dev, st.st_ino)
        self._held[key] += 1
        return key

    def release(self, key: tuple[int, int]) -> None:
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]

    def _is_held(self, path: str | os.PathLike) -> bool:
        st = _regular_file(path)
        return st is not None and (st.st_dev, st.st_ino) in self._held

    def _reusable(self, path: str) -> bool:
        """Whether the file's pages may be rewritten: a regular file (not a link, which a save
        would write through), not mapped by live tensors, not held."""
        st = _regular_file(path)
        if st is None or fileformat.is_mapped(path):
            return False
        return (st.st_dev, st.st_ino) not in self._held

    def retire(self, keep: set[int], max_spares: int) -> None:
        """Remove every file of this rank that no iteration in ``keep`` needs, keeping up to
        ``max_spares`` of them as spares. A part still held (:meth:`hold`) becomes a spare too, not
        counted: it is reused once released; and from then on one more spare is kept, so that the
        save after the next held part is retired finds one (else it makes a new file, which for
        CUDA states is pinned anew). Committed parts newer than every iteration in ``keep``
        stay if saved with this world size: this process's save removed such parts before it
        wrote, so another process committed them since (a rank of an earlier attempt of the job
        that was stopped or slow and woke up here, after the restarted job saved newer
        checkpoints); those of another world size were left by the save for its commit to retire
        (:meth:`remove_from`)."""
        directory = self.directory
        newest = max(keep, default=naming.NO_CHECKPOINT)
        other_world = self._other_world_after(newest)
        spares = [e.name for e in os.scandir(directory) if naming.is_spare_name(e.name)]
        while not max_spares and spares:  # not recycling: none stays (nothing takes them)
            unlink_quietly(directory / spares.pop())
        counted = sum(not self._is_held(directory / name) for name in spares)
        max_spares += self._spare_for_holds if max_spares else 0  # (recycling: see above)
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            parsed = naming.parse_part_name(entry.name)
            stale = naming.is_dirty_name(entry.name) or (
                parsed is not None
                and parsed[0] not in keep
                and (parsed[0] < newest or parsed in other_world)
            )
            if not stale:
                continue
            held = self._is_held(entry.path)
            self._spare_for_holds |= held
            if held or counted < max_spares and self._reusable(entry.path):
                spare = _unused_spare_name(spares)
                os.replace(entry.path, directory / spare)
                spares.append(spare)
                counted += not held
            else:
                unlink_quietly(entry.path)
        fileformat.fsync_dir(directory)
        self.forget_removed_files()

    def make_spares(self, nbytes: int, count: int, pin_for: int | None = None) -> int:
        """Add spares of ``nbytes`` (their space allocated) until this rank has ``count``, and map
        every spare of that size, its pages faulted in, into :attr:`mappings` (where a snapshot in
        place finds it: faulting a fresh mapping of 2 GiB in costs seconds here), page-locked for
        copies from CUDA device ``pin_for`` if given: ahead of the first saves, which then reuse
        pages and mappings. Stops, keeping what it made, at the first spare the tier has no room
        for; returns how many it made. Nothing may take spares meanwhile (the saver waits for
        this before saving)."""
        self.ensure_dir()
        directory = self.directory
        spares = [e.name for e in os.scandir(directory) if naming.is_spare_name(e.name)]
        made = 0
        while len(spares) < count:
            name = _unused_spare_name(spares)
            try:
                fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    reserve(fd, nbytes)
                finally:
                    os.close(fd)
            except OSError as e:
                unlink_quietly(directory / name)
                # the text, not the error: its traceback would keep this store's mappings alive
                logger.info("no room for a spare part file in %s (%s)", directory, str(e))
                break
            spares.append(name)
            made += 1
        for name in spares:
            st = _regular_file(directory / name)
            if st is not None and st.st_size == nbytes:
                entry = self.mappings.map(str(directory / name), nbytes, writable=True)
                if pin_for is not None:
                    self.mappings.pin(entry, pin_for)
        return made

    def _other_world_after(self, iteration: int) -> set[tuple[int, int]]:
        """``(iteration, origin)`` of this rank's parts newer than ``iteration`` saved with another
        world size."""
        world_size = self.world_size
        return {(i, o) for i, o, w in self.scan() if i > iteration and w != world_size}

    def remove_from(self, iteration: int) -> None:
        """Remove this rank's committed parts (own and replicas) of ``iteration`` and newer ones; a
        part that cannot be removed raises (``OSError``). A newer part saved with another world
        size stays (it may be the only checkpoint a job of that size can load, should this save
        fail): the commit of this save retires it (:meth:`retire`)."""
        other_world = self._other_world_after(iteration)
        removed = False
        for entry, saved in self.part_files():
            if saved >= iteration and naming.parse_part_name(entry.name) not in other_world:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
                removed = True
        if removed:
            fileformat.fsync_dir(self.directory)
            self.forget_removed_files()

    def remove_iteration(self, iteration: int) -> None:
        """Remove this rank's files of ``iteration``, unfinished ones too (quietly)."""
        if not self.directory.is_dir():
            return
        for entry, saved in self.part_files(dirty=True):
            if saved == iteration:
                unlink_quietly(entry.path)
        self.forget_removed_files()

    def forget_removed_files(self) -> None:
        """Unmap the files that no longer exist (a mapping pins their pages)."""
        if len(self.mappings):
            try:
                present = [e.path for e in os.scandir(self.directory)]
            except OSError:
                present = []
            self.mappings.retain(present)


def _regular_file(path: str | os.PathLike) -> os.stat_result | None:
    """``path``'s status when it is a regular file itself; ``None`` for a link (to anything: a spare
    written through it would overwrite a file outside the tier), a directory or a missing name."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _unused_spare_name(spares: list[str]) -> str:
    return next(n for k in range(len(spares) + 1) if (n := naming.spare_name(k)) not in spares)


def complete_iterations(listings: Iterable[Listing]) -> dict[int, int]:
    """Iterations whose parts exist for every rank of the world size they were saved with, and
    that world size."""
    origins: dict[int, set[int]] = {}
    worlds: dict[int, set[int]] = {}
    for listing in listings:
        for iteration, origin, world in listing:
            origins.setdefault(iteration, set()).add(origin)
            worlds.setdefault(iteration, set()).add(world)
    saved_with = {i: min(sizes) for i, sizes in worlds.items() if len(sizes) == 1}
    return {i: w for i, w in saved_with.items() if origins[i] >= set(range(w))}


_UNREAD = object()  # a scanned part's save token not read yet


def _validate_part(path: str, iteration: int, origin: int) -> tuple[list[int] | None, Any]:
    """``([iteration, origin, world size], save token)`` of a usable part, else ``(None, None)``."""
    try:
        meta = naming.part_metadata(path, iteration, origin)
    except (OSError, CheckpointingError) as e:
        logger.warning("ignoring unusable local part %s: %s", path, e)
        return None, None
    return [iteration, origin, meta["world_size"]], meta.get("save")


class ReceivedPart(fileformat.PartVerifier):
    """A part arriving from a peer: every checksum holds (checked as it lands) and it is the part
    its name says."""

    def __init__(self, move: peers.FileMove, data: memoryview) -> None:
        super().__init__(move.dst_path, data)
        self.move = move

    def finish(self) -> fileformat.PartHeader:
        header = super().finish()
        expected = naming.parse_part_name(Path(self.move.dst_path).name)
        meta = header.extra
        if expected is None or not naming.metadata_names(meta, *expected):
            raise CorruptCheckpointError(
                self.move.dst_path,
                f"rank {self.move.src} sent a part whose metadata does not match its name",
            )
        return header
