"""The house's rules, checked on the source: modules import only from their own floor or lower
ones, the import graph has no circle, and no module grows past the size a reader takes in at once
without saying why. Floors as in docs/architecture.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import tierpoint

SRC = Path(tierpoint.__file__).parent

FLOORS: dict[str, int] = {
    # floor 0: ground
    "tierpoint.errors": 0,
    "tierpoint.files": 0,
    "tierpoint.rank_ranges": 0,
    "tierpoint.storage": 0,
    "tierpoint.dist": 0,
    # floor 1: formats and state trees
    "tierpoint.fileformat": 1,
    "tierpoint.tree": 1,
    "tierpoint.dtensors": 1,  # below tree (a DTensor's node in a state tree)
    "tierpoint.tensor_refs": 1,  # below tree (the shared nodes of tensors in a state tree)
    "tierpoint.numpy_dtypes": 1,  # below tree (a numpy value's dtype in a state tree)
    "tierpoint.tensor_aware": 1,
    # floor 2: staging and transfer
    "tierpoint.staging": 2,
    "tierpoint.pinning": 2,
    "tierpoint.snapshot_copy": 2,
    "tierpoint.device_snapshot": 2,
    "tierpoint.peers": 2,
    # floor 3: async
    "tierpoint.asyncsave": 3,
    # floor 4: tiers
    "tierpoint.local": 4,
    "tierpoint.dcp": 4,
    # floor 5: trainer APIs
    "tierpoint.dcp.flashpoint": 5,
    "tierpoint.tiered": 5,
    "tierpoint.checkpointer": 5,
    # floor 6: command, demo, the multi-rank runner
    "tierpoint.cli": 6,
    "tierpoint.__main__": 6,  # python -m tierpoint: the command
    "tierpoint.demo": 6,
    "tierpoint.testing": 6,
}
TIERS = ("tierpoint.local", "tierpoint.dcp", "tierpoint.tiered", "tierpoint.checkpointer")
MAX_LINES = 420
"""About 400 lines; a longer module says why in its docstring ("... lines: ..." reason)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ["tierpoint", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module ``name`` stands for (a submodule, a package, or the module holding a name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Every tierpoint module ``module`` imports, at any depth of its code."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("tierpoint") and name != "tierpoint.__version__":
                target = _resolve(name)
                if target and target != module:
                    found.add(target)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _floor(module: str) -> int | None:
    while module:
        if module in FLOORS:
            return FLOORS[module]
        module = module.rpartition(".")[0]
    return None


def test_every_module_has_a_floor() -> None:
    assert [m for m in MODULES if m != "tierpoint" and _floor(m) is None] == []


def test_no_module_imports_from_a_higher_floor() -> None:
    """A package's ``__init__`` (its public facade) may gather names from all its modules."""
    upward = [
        f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})"
        for m, targets in GRAPH.items()
        for t in targets
        if m != "tierpoint"
        and not (MODULES[m].name == "__init__.py" and t.startswith(m + "."))
        and (_floor(t) is None or _floor(t) > _floor(m))  # type: ignore[operator]
    ]
    assert upward == []


def test_the_async_layer_and_the_ground_floor_import_no_tier() -> None:
    lower = [m for m in GRAPH if _floor(m) is not None and _floor(m) <= 3]  # type: ignore[operator]
    assert [(m, t) for m in lower for t in GRAPH[m] if t.startswith(TIERS)] == []


def test_the_import_graph_has_no_circle() -> None:
    """Package ``__init__`` modules (facades re-exporting their submodules) are left out."""
    graph = {
        m: {t for t in ts if MODULES[t].name != "__init__.py"}
        for m, ts in GRAPH.items()
        if MODULES[m].name != "__init__.py"
    }
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt) :] + [node, nxt][1:]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_too_long_without_a_reason(module: str) -> None:
    path = MODULES[module]
    lines = len(path.read_text().splitlines())
    if lines > MAX_LINES:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert " lines" in doc, f"{path.relative_to(SRC)}: {lines} lines and no reason given"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_what_it_is_for(module: str) -> None:
    assert ast.get_docstring(ast.parse(MODULES[module].read_text())), module


def test_docs_architecture_names_every_module() -> None:
    """docs/architecture.md draws the floors module by module (``checkpointer/`` and ``demo/`` as
    a whole; private modules apart): a module it leaves out is missing from the map."""
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", doc))
    whole = ("tierpoint.checkpointer.", "tierpoint.demo.")
    left_out = [
        m
        for m in MODULES
        if not m.startswith(whole) and not m.rpartition(".")[2].startswith("_")
        if m.rpartition(".")[2] not in named
    ]
    assert left_out == []
