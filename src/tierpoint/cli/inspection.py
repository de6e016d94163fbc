"""``tierpoint inspect``: one part file's, ``.pt`` file's, safetensors file's or DCP step's
tensors (name, dtype, shape, bytes, checksum), other values and skeleton.

Call order: :func:`cmd_inspect` classifies the path, builds one document (a dict, also the JSON
output) for the file or step, then prints it as tables.

Invariants: skeleton pickles are never loaded (shown as such); DCP values are decoded with
``weights_only=True``; nothing is written. A DCP step with damage (a lost checksum manifest, values
that do not load) is still shown, the damage named, and the command exits with 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from ..errors import CorruptCheckpointError
from .files import kind_of_file, load_pt, safetensors_header
from .locate import classify, find_dcp_dir, store_options
from .output import CommandError, human_size, make_console, make_table, print_json


def cmd_inspect(args: argparse.Namespace) -> int:
    """``tierpoint inspect``: the tensors and values of one file or DCP step; 0 on success."""
    options = store_options(args)
    kind, entries = classify(args.path, options)
    if kind == "part":
        doc = _inspect_file(args.path)
    elif kind in ("dcp-step", "olmo-step"):
        doc = _inspect_dcp(find_dcp_dir(args.path, entries, options), options)
    else:
        raise CommandError(
            f"{args.path}: inspect shows one part file or one DCP step; for a directory of "
            "checkpoints use `tierpoint ls` or `tierpoint verify`",
            code=2,
        )
    if args.json:
        print_json(doc)
        return 1 if doc.get("problems") else 0
    console = make_console()
    columns = ["name", "dtype", "shape", "bytes", "checksum"]
    rows = [(t["name"], t["dtype"], t["shape"], t["bytes"], t["checksum"]) for t in doc["tensors"]]
    of_what = " of tensors" if doc["kind"] == "DCP checkpoint" else ""  # (not its files' size)
    head = f"{doc['path']}: {doc['kind']}, {human_size(doc['size'])}{of_what}"
    if doc.get("extra"):
        head += f", metadata {json.dumps(doc['extra'])}"
    console.print(head, soft_wrap=True)
    console.print(make_table(f"{len(rows)} tensors", columns, rows))
    if doc["values"]:
        values = [(k, json.dumps(v, default=str)) for k, v in doc["values"].items()]
        console.print(make_table(f"{len(values)} other values", ["name", "value"], values))
    if doc.get("skeleton") is not None:
        console.print("skeleton: " + json.dumps(_skeleton_view(doc), default=str), soft_wrap=True)
    for problem in doc.get("problems", []):
        console.print(f"[red]DAMAGED[/red] {problem}", soft_wrap=True, highlight=False)
    return 1 if doc.get("problems") else 0


def _inspect_file(path: str) -> dict[str, Any]:
    """A part file, another safetensors file (its header only) or a ``torch.save`` file."""
    if kind_of_file(path) == "pt":
        return _state_doc(path, "torch.save file", load_pt(path))
    header = safetensors_header(path)
    meta = header.pop("__metadata__", None) or {}
    if isinstance(meta, dict) and meta.get("format") == "tierpoint":
        return _inspect_part(path)
    tensors = []
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            tensors.append({"name": name, "dtype": entry["dtype"], "shape": list(entry["shape"]),
                            "bytes": end - begin, "checksum": "-"})  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise CommandError(f"{path}: not a safetensors file: entry {name!r}: {e}") from e
    size = os.path.getsize(path)
    doc = {"path": path, "kind": "safetensors file", "size": size, "extra": meta}
    return doc | {"tensors": tensors, "values": {}, "skeleton": None}


def _state_doc(path: str, kind: str, state: Any) -> dict[str, Any]:
    """What ``inspect`` shows of a loaded state: its tensors (checksums computed), values,
    skeleton."""
    from ..fileformat import byte_view, checksum
    from ..fileformat.plan import _unique_names
    from ..tree import flatten

    flat = flatten(state)
    tensors = [
        {
            "name": name,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "bytes": t.numel() * t.element_size(),
            "checksum": checksum(byte_view(t.detach().cpu().contiguous())),
        }
        for name, t in zip(_unique_names(flat.paths), flat.tensors)
    ]
    values: dict[str, Any] = {}
    _skeleton_values(flat.skeleton, "", values)
    size = os.path.getsize(path)
    doc = {"path": path, "kind": kind, "size": size, "extra": None, "tensors": tensors}
    return doc | {"values": values, "skeleton": flat.skeleton}


def _inspect_part(path: str) -> dict[str, Any]:
    from .. import fileformat

    header = fileformat.read_header(path)
    tensors = [
        {
            "name": r.name,
            "dtype": str(r.dtype).removeprefix("torch."),
            "shape": list(r.shape),
            "bytes": r.nbytes,
            "checksum": r.checksum,
            "device": r.device,
        }
        for r in header.records
    ]
    values: dict[str, Any] = {}
    _skeleton_values(header.skeleton, "", values)
    return {
        "path": path,
        "kind": "part file",
        "size": header.file_size,
        "extra": header.extra,
        "tensors": tensors,
        "values": values,
        "skeleton": header.skeleton,
    }


def _skeleton_values(node: Any, path: str, out: dict[str, Any]) -> None:
    """The non-tensor leaves of a part file's skeleton, by key path, as JSON (never unpickled)."""
    from ..tree import child_path

    if isinstance(node, list):
        for i, v in enumerate(node):
            _skeleton_values(v, child_path(path, i), out)
    elif isinstance(node, dict):
        tag = node.get("~")
        if tag in ("dict", "odict"):
            for k, v in zip(node.get("k", []), node.get("v", [])):
                _skeleton_values(
                    v, child_path(path, k if isinstance(k, (str, int)) else str(k)), out
                )
        elif tag == "tuple":
            for i, v in enumerate(node.get("v", [])):
                _skeleton_values(v, child_path(path, i), out)
        elif tag in ("tensor", "dtensor", "ndarray"):
            return
        elif tag == "pickle":
            out[path or "<root>"] = "<a pickled object: not loaded>"
        elif tag in ("int", "float"):
            out[path or "<root>"] = node.get("v")
        elif tag == "bytes":
            out[path or "<root>"] = f"<bytes, {len(node.get('v', '')) * 3 // 4} bytes>"
        else:
            out[path or "<root>"] = f"{tag}({node.get('dtype') or node.get('v')})"
    else:
        out[path or "<root>"] = node


def _skeleton_view(doc: dict[str, Any]) -> Any:
    """The skeleton with each tensor node shown as ``tensor <name>``."""
    names = [t["name"] for t in doc["tensors"]]

    def view(node: Any) -> Any:
        if isinstance(node, list):
            return [view(v) for v in node]
        if isinstance(node, dict):
            if node.get("~") in ("tensor", "dtensor", "ndarray") and isinstance(node.get("i"), int):
                i = node["i"]
                return f"<{node['~']} {names[i] if 0 <= i < len(names) else i}>"
            return {k: view(v) for k, v in node.items()}
        return node

    return view(doc["skeleton"])


def _inspect_dcp(path: str, options: Mapping[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..dcp.loading import load
    from ..dcp.reader import Reader

    reader = Reader(path, storage_options=options)
    metadata = reader.read_metadata()
    storage = metadata.storage_data or {}
    tensors, value_names, size = [], [], 0
    problems = _lost_data_files(path, storage, options)
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            value_names.append(fqn)
            continue
        dtype = md.properties.dtype
        nbytes = math.prod(md.size) * dtype.itemsize
        size += nbytes
        sums = [_item_checksum(reader, info, problems) for index, info in storage.items()
                if index.fqn == fqn]  # fmt: skip
        tensors.append(
            {
                "name": fqn,
                "dtype": str(dtype).removeprefix("torch."),
                "shape": list(md.size),
                "bytes": nbytes,
                "checksum": _checksum_cell(sums),
                "chunks": len(md.chunks),
            }
        )
    values: dict[str, Any] = {name: None for name in value_names}
    if values:
        try:
            load(values, path, storage_options=options)  # decoded with weights_only=True
        except CorruptCheckpointError as e:  # damage; an outage still fails the command
            if not any(problem in str(e) for problem in problems):  # (not said twice)
                problems.add(str(e))
            values = {name: "<not loaded: the checkpoint is damaged>" for name in value_names}
    doc = {
        "path": path,
        "kind": "DCP checkpoint",
        "size": size,
        "tensors": tensors,
        "values": {k: _json_value(v) for k, v in values.items()},
        "skeleton": None,
    }
    return doc | ({"problems": sorted(problems)} if problems else {})


def _lost_data_files(path: str, storage: Mapping[Any, Any], options: Mapping[str, Any]) -> set[str]:
    """What ``ls`` checks of a step without reading it: every data file ``.metadata`` names is
    there and holds the bytes it locates (``inspect`` reads only the values' items)."""
    from .listing import lost_data_files
    from .locate import join_url, list_entries

    lost = lost_data_files(storage, list_entries(path, options))
    return {f"{join_url(path, name)}: {why}" for name, why in lost}


def _checksum_cell(sums: list[str]) -> str:
    """What the checksum column shows for a tensor whose chunks' checksums are ``sums``."""
    if "DAMAGED" in sums:
        return "DAMAGED"
    return sums[0] if len(sums) == 1 else f"{len(sums)} chunks"


def _item_checksum(reader: Any, info: Any, problems: set[str]) -> str:
    """The checksum an item's manifest records; damage (a lost manifest) is added to
    ``problems`` and shown in its place, so that the rest of the step is still shown."""
    try:
        manifest = reader.manifest(info.relative_path)
    except CorruptCheckpointError as e:  # damage; an outage still fails the command
        problems.add(str(e))
        return "DAMAGED"
    if manifest is None:
        return "-"
    return manifest.files.get(info.relative_path, {}).get((info.offset, info.length), "-")


def _json_value(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)
