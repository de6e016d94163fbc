"""What a path or URL given to a ``tierpoint`` command is, and what is under it.

:func:`classify` says whether a path is a part file, a DCP step, an OLMo-core step, a DCP base
(``step-<N>`` directories) or a local-tier root, session or rank directory, from a listing made by
:func:`list_entries` (local directories with ``os``, URLs with fsspec, sizes and times included).

Call order: ``store_options(args)`` (the fsspec options of ``--endpoint-url``) ->
``classify(path, options)`` -> the command's own reading; :func:`find_dcp_dir` gives the DCP
directory of a step (the step itself, or its OLMo-core ``model_and_optim``).

Invariants: URLs stay strings; nothing is read but directory listings; a path that is not there
or holds no checkpoint is a :class:`~tierpoint.cli.output.CommandError` naming it.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .output import CommandError

_OLMO_STEP = re.compile(r"^step([0-9]+)$")
OLMO_DCP = "model_and_optim"


def store_options(args: argparse.Namespace) -> dict[str, Any]:
    """fsspec storage options from ``--endpoint-url`` (s3fs reads ``AWS_*`` itself)."""
    url = getattr(args, "endpoint_url", None)
    return {"endpoint_url": url} if url else {}


@dataclass
class Entry:
    """One name directly under a directory or URL prefix (``mtime`` None where the store gives
    none; a directory's ``size`` is 0)."""

    name: str
    size: int
    mtime: float | None
    is_dir: bool


def list_entries(url: str, options: Mapping[str, Any]) -> dict[str, Entry]:
    """What is directly under ``url`` (a directory or URL prefix), with sizes and times."""
    from .. import storage

    names = storage.listdir(url, options)  # clear errors: a missing bucket, an unreachable store
    if storage.is_local(url):
        out = {}
        for name in names:
            try:
                st = os.stat(os.path.join(storage.local_path(url), name))
            except OSError:
                continue  # removed meanwhile
            is_dir = os.path.isdir(os.path.join(storage.local_path(url), name))
            out[name] = Entry(name, 0 if is_dir else st.st_size, st.st_mtime, is_dir)
        return out
    if not names:
        return {}
    try:
        fs, path = storage.filesystem(url, options)
        listed = fs.ls(path, detail=True)
    except Exception as e:  # noqa: BLE001 - reported with the URL
        raise storage.failure("listing", url, e) from e
    out = {}
    for e in listed:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        stamp = e.get("LastModified") or e.get("mtime")
        mtime = stamp.timestamp() if hasattr(stamp, "timestamp") else None
        is_dir = e.get("type") == "directory"
        out[name] = Entry(name, int(e.get("size") or 0), mtime, is_dir)
    return {n: out[n] for n in names if n in out} | {
        n: Entry(n, 0, None, True) for n in names if n not in out
    }


def join_url(url: str, *names: str) -> str:
    """``names`` under ``url`` (a path or a URL)."""
    from .. import storage

    return storage.join(url, *names)


def step_number(name: str) -> int | None:
    """The step of a DCP ``step-<N>`` (ML Flashpoint: ``step-<N>_ckpt``) or an OLMo-core
    ``step<N>`` directory name."""
    from ..dcp import step_dirs

    step = step_dirs.step_dir_of(name)
    if step is None and (m := _OLMO_STEP.match(name)):
        step = int(m.group(1))
    return step


def is_dcp_step(names: Sequence[str]) -> bool:
    """Whether a directory holding ``names`` is a DCP step (metadata, markers or data files)."""
    from ..dcp import step_dirs

    return any(
        n == step_dirs.METADATA_NAME
        or n.startswith(step_dirs.MARKER_PREFIX)
        or n.endswith(".distcp")
        for n in names
    )


def classify(path: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Entry]]:
    """What ``path`` is: ``"part"`` (a file), ``"dcp-step"``, ``"olmo-step"``, ``"dcp-base"``
    (step directories under it) or ``"local"`` (a local-tier root, session or rank directory)."""
    from .. import storage

    if storage.is_local(path):
        local = storage.local_path(path)
        if not os.path.exists(local):
            raise CommandError(f"{path}: no such file or directory")
        if os.path.isfile(local):
            return "part", {}
    entries = list_entries(path, options)
    if not entries and not storage.is_local(path):
        raise CommandError(f"{path}: nothing there (no checkpoint, no objects under this prefix)")
    if is_dcp_step(list(entries)):
        return "dcp-step", entries
    if OLMO_DCP in entries and entries[OLMO_DCP].is_dir:
        return "olmo-step", entries
    if any(step_number(n) is not None and e.is_dir for n, e in entries.items()):
        return "dcp-base", entries
    if not storage.is_local(path):
        raise CommandError(f"{path}: neither a DCP checkpoint nor a directory of step-<N> ones")
    return "local", entries


def find_dcp_dir(step_dir: str, entries: dict[str, Entry] | None, options: Any) -> str:
    """The DCP directory of a step: the step itself, or its ``model_and_optim`` (OLMo-core)."""
    if entries is None:
        entries = list_entries(step_dir, options)
    if OLMO_DCP in entries and not is_dcp_step(list(entries)):
        return join_url(step_dir, OLMO_DCP)
    return step_dir
