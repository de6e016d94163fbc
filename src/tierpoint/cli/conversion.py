"""``tierpoint convert``: a part file, a local-tier iteration, a DCP step, a ``.safetensors`` or a
``.pt`` file to one ``.safetensors`` or ``.pt`` file, or back to a DCP checkpoint.

Call order: :func:`cmd_convert` reads the source's state (its kind from
:func:`~tierpoint.cli.locate.classify` and the file's suffix), then writes it in the kind of
``DST``'s suffix (none: a DCP checkpoint) and prints one line.

Invariants: nothing is replaced or written into without ``--force`` (a DCP ``DST`` must be missing
or an empty directory), and ``SRC`` never, even with it (a ``DST`` naming ``SRC`` or a directory
holding it is refused); a file ``DST`` appears whole or not at all (dirty name, fsync, rename);
``.safetensors`` and ``.pt`` files are written locally only; every kind of ``DST`` gets its missing
parent directories; a safetensors file written here keeps the state's structure in its metadata,
so converting it back restores the same tree.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointingError
from ..files import write_whole
from .files import is_part_metadata, kind_of_file, load_pt, safetensors_metadata
from .listing import local_rows, newest_whole_save
from .locate import classify, find_dcp_dir, store_options
from .output import CommandError


def cmd_convert(args: argparse.Namespace) -> int:
    """``tierpoint convert``: ``args.src`` written as ``args.dst``; 0 on success."""
    from .. import storage

    options = store_options(args)
    dst = args.dst
    out_kind = kind_of_file(dst) or "dcp"
    if out_kind != "dcp" and not storage.is_local(dst):
        raise CommandError(f"{dst}: a .safetensors or .pt file is written locally only")
    if out_kind != "dcp":
        dst = storage.local_path(dst)  # a file:// URL names the same file
    if args.force and _holds_source(args.src, dst):  # it would replace SRC, or write over it
        raise CommandError(f"{dst}: is SRC or holds it; convert to another path (nothing written)")
    if out_kind != "dcp" and os.path.exists(dst) and not args.force:
        raise CommandError(f"{dst}: exists (--force to replace it)")
    if out_kind == "dcp":
        _check_dcp_target(dst, options, args.force)
    state, source = _read_state(args, options)
    if out_kind != "dcp":  # missing parent directories are made, as a DCP save makes them
        os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    if out_kind == "dcp":
        how = _write_dcp(state, dst, options, args.force)
    else:
        how = _write_file(state, dst, out_kind)
    tensors, nbytes = _count_tensors(state)
    print(f"{source} -> {dst} ({how}): {tensors} tensors, {nbytes} bytes")
    return 0


def _holds_source(src: str, dst: str) -> bool:
    """Whether ``dst`` names ``src`` or a directory above it (a link or a URL's spelling too): a
    DCP save there would sit over the step directories it holds."""
    from .. import storage

    if storage.is_local(src) != storage.is_local(dst):
        return False
    if not storage.is_local(src):
        src, dst = src.rstrip("/") + "/", dst.rstrip("/") + "/"
        return src.startswith(dst)
    here, there = Path(storage.local_path(src)), Path(storage.local_path(dst))
    if not there.exists() or not here.exists():
        return False
    here, there = here.resolve(), there.resolve()
    return here == there or there in here.parents


def _read_state(args: argparse.Namespace, options: Mapping[str, Any]) -> tuple[Any, str]:
    """The state held by ``args.src`` and a description of it."""
    try:
        return _read_source(args, options)
    except CheckpointingError as e:
        if args.src in str(e):
            raise
        raise CommandError(f"{args.src}: {e}") from e  # an error that does not name the file


def _read_source(args: argparse.Namespace, options: Mapping[str, Any]) -> tuple[Any, str]:
    src = args.src
    kind, entries = classify(src, options)
    if kind not in ("local", "dcp-base") and (args.iteration is not None or args.rank is not None):
        raise CommandError(  # (else ignored: a DCP step would be converted whole)
            f"{src}: --iteration and --rank choose within a local-tier directory; this is a "
            + ("file" if kind == "part" else "DCP checkpoint, converted whole")
        )
    if kind == "part":
        file_kind = kind_of_file(src)
        if file_kind == "pt":
            return load_pt(src), "torch.save file"
        return _read_safetensors(src)
    if kind in ("dcp-step", "olmo-step"):
        return _read_dcp(find_dcp_dir(src, entries, options), options), "DCP checkpoint"
    if kind == "local":
        return _read_iteration(src, args.iteration, args.rank)
    from ..dcp.step_dirs import step_path

    such = f", such as {step_path(src, args.iteration)}" if args.iteration is not None else ""
    raise CommandError(f"{src}: a DCP base directory: convert one of its steps{such}")


def _read_safetensors(path: str) -> tuple[Any, str]:
    """A tierpoint part file (checked, its skeleton restored) or any safetensors file."""
    from .. import fileformat

    meta = safetensors_metadata(path)
    if is_part_metadata(meta):
        return fileformat.read(path), "part file"
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise CommandError(
            f"{path}: not a tierpoint part file; reading other safetensors files needs the "
            "safetensors package"
        ) from e
    try:
        tensors = load_file(path)
    except Exception as e:  # noqa: BLE001 - a damaged file: one line
        raise CommandError(f"{path}: not a readable safetensors file: {e}") from e
    if "tierpoint_skeleton" in meta:  # written by `tierpoint convert`: the structure comes back
        from ..tree import unflatten

        names = json.loads(meta["tierpoint_names"])
        state = unflatten(json.loads(meta["tierpoint_skeleton"]), [tensors[n] for n in names])
        return state, "safetensors file"
    return tensors, "safetensors file"


def _read_dcp(path: str, options: Mapping[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..dcp.loading import load
    from ..dcp.reader import read_metadata

    metadata = read_metadata(path, storage_options=options)
    state: dict[str, Any] = {}
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        is_tensor = isinstance(md, TensorStorageMetadata)
        state[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if is_tensor else None
    load(state, path, storage_options=options)
    return state


def _read_iteration(root: str, iteration: int | None, rank: int | None) -> tuple[Any, str]:
    """One local-tier iteration (the newest complete by default): ``{"rank<r>": state}`` for every
    rank, or one rank's state."""
    from ..local.naming import parse_part_name

    rows = [r for r in local_rows(root) if iteration is None or r.step == iteration]
    sessions = {r.where for r in rows}
    if len(sessions) > 1:
        raise CommandError(f"{root}: holds sessions {sorted(sessions)}: name one's directory")
    complete = [r for r in rows if r.status == "complete" or (rank is not None and rank in r.ranks)]
    if not complete:
        if iteration is not None and rows:  # it is there, but not whole (or not this rank's)
            why = rows[0].status + (f" ({rows[0].detail})" if rows[0].detail else "")
            hint = "" if rank is not None else "; --rank converts one rank's part"
            raise CommandError(f"{root}: iteration {iteration} is {why}{hint}")
        which = f"iteration {iteration}" if iteration is not None else "complete iteration"
        raise CommandError(f"{root}: no {which} to convert")
    row = max(complete, key=lambda r: r.step)
    parts: dict[int, list[Path]] = {}  # origin rank -> its copies
    for p in sorted(Path(root).glob("**/*")):
        parsed = parse_part_name(p.name)
        if parsed is not None and parsed[0] == row.step:
            parts.setdefault(parsed[1], []).append(p)
    for origin, copies in parts.items():  # the origin's own directory's copy first, then replicas
        copies.sort(key=lambda p, origin=origin: p.parent.name != str(origin))
    ranks = [rank] if rank is not None else sorted(parts)
    if any(r not in parts for r in ranks):
        raise CommandError(f"{root}: iteration {row.step} has no part of rank {rank}")
    elsewhere = sorted(set(range(row.world_size or 0)) - set(parts))
    if rank is None and elsewhere:  # one rank's directory: the others' parts are not under it
        raise CommandError(
            f"{root}: iteration {row.step}'s parts of ranks {elsewhere} are not under it: convert "
            "from the session's directory, or one rank's part with --rank"
        )
    newer = sorted({r.step: r for r in rows if r.step > row.step}.items())
    passed = "".join(  # why a newer iteration was not taken
        f"; newer iteration {step} not taken: {r.status}" + (f" ({r.detail})" if r.detail else "")
        for step, r in newer
    )
    save = _newest_whole_save(parts, row.step, ranks)
    if rank is not None:
        part = _read_part(parts[rank], row.step, rank, save)
        return part, f"iteration {row.step}, rank {rank}{passed}"
    state = {f"rank{r}": _read_part(parts[r], row.step, r, save) for r in ranks}
    return state, f"iteration {row.step}, ranks {ranks[0]}..{ranks[-1]}{passed}"


def _newest_whole_save(parts: dict[int, list[Path]], iteration: int, ranks: list[int]) -> Any:
    """The newest save with an intact header of every one of ``ranks``' parts (None: none)."""
    from ..local.naming import part_metadata

    saves: dict[str, set[int]] = {}
    for origin in ranks:
        for path in parts[origin]:
            try:
                meta = part_metadata(path, iteration, origin)
            except (CheckpointingError, OSError):
                continue
            saves.setdefault(str(meta.get("save")), set()).add(origin)
    return newest_whole_save(saves, ranks)


def _read_part(copies: list[Path], iteration: int, origin: int, save: str | None) -> Any:
    """One rank's part, from the first of its ``copies`` that is intact, whose metadata agrees
    with its name and that comes from ``save`` (when known), as the manager loads it: a damaged
    replica, a file under another part's name or a copy of another save is passed over."""
    from .. import fileformat
    from ..local.naming import part_metadata

    errors: list[Exception] = []
    for path in copies:
        try:
            meta = part_metadata(path, iteration, origin)
            if save is not None and str(meta.get("save")) != save:
                raise CommandError(f"{path}: a copy of another save of the iteration than {save}")
            return fileformat.read(path)
        except (CheckpointingError, OSError, CommandError) as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    raise CommandError(
        f"no intact copy of rank {origin}'s part of iteration {iteration} ({len(errors)} tried): "
        + "; ".join(str(e) for e in errors)
    )


def _write_file(state: Any, dst: str, kind: str) -> str:
    """``state`` as a ``.safetensors`` or ``.pt`` file under a dirty name, fsynced, renamed over
    ``dst`` once whole: a failure (a full disk) leaves no partial file at ``dst`` and the file
    ``--force`` was to replace intact."""
    import torch

    def write(tmp: str) -> str:
        if kind == "safetensors":
            return _write_safetensors(state, tmp)
        torch.save(state, tmp)
        return "torch.save"

    try:
        return write_whole(dst, write)
    except Exception as e:
        try:  # (pseudo and read-only file systems, /proc or a squashfs, show no free blocks)
            fs = os.statvfs(os.path.dirname(os.path.abspath(dst)))
            full = fs.f_blocks > 0 and fs.f_bavail == 0 and not fs.f_flag & os.ST_RDONLY
        except OSError:
            full = False
        why = "no space left on device; " if full else ""
        raise CommandError(f"writing {dst} failed ({why}nothing written): {e}") from e


def _write_safetensors(state: Any, dst: str) -> str:
    from .. import fileformat
    from ..fileformat.header import NATIVE_CODES
    from ..fileformat.plan import _unique_names
    from ..tree import flatten

    flat = flatten(state)
    names = _unique_names(flat.paths)
    try:
        from safetensors.torch import save_file
    except ImportError:
        save_file = None
    if save_file is None or any(t.dtype not in NATIVE_CODES for t in flat.tensors):
        # the same layout, with checksums and skeleton; readable by others as the umask allows
        fileformat.write(dst, state, mode=0o666)
        return "safetensors layout, by tierpoint.fileformat"
    metadata = {
        "format": "pt",
        "tierpoint_skeleton": json.dumps(flat.skeleton),
        "tierpoint_names": json.dumps(names),
    }
    tensors = {n: t.detach().cpu().contiguous().clone() for n, t in zip(names, flat.tensors)}
    save_file(tensors, dst, metadata=metadata)
    umask = os.umask(0)  # safetensors makes its files private: give it torch.save's permissions
    os.umask(umask)
    os.chmod(dst, 0o666 & ~umask)
    return "safetensors"


def _check_dcp_target(dst: str, options: Mapping[str, Any], force: bool) -> None:
    """Refuse a DCP destination that is a file, or (without ``--force``) one that holds anything:
    a checkpoint, a run's step, a user's files."""
    from .. import storage
    from ..dcp import step_dirs

    if storage.is_local(dst) and os.path.isfile(storage.local_path(dst)):
        raise CommandError(f"{dst}: a file, not a directory for a DCP checkpoint")
    if force:
        return
    names = storage.listdir(dst, options)  # empty: missing, or an empty directory
    if step_dirs.METADATA_NAME in names:
        raise CommandError(f"{dst}: holds a DCP checkpoint already (--force to replace it)")
    if names:
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise CommandError(f"{dst}: exists and is not empty ({shown}) (--force to write into it)")


def _write_dcp(state: Any, dst: str, options: Mapping[str, Any], force: bool) -> str:
    from ..dcp.saving import save

    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        state = {"state": state}
    save(state, dst, storage_options=options, overwrite=force)
    return "DCP"


def _count_tensors(state: Any) -> tuple[int, int]:
    from ..tree import flatten

    tensors = flatten(state).tensors
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)
