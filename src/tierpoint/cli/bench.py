"""``tierpoint bench``: run the benchmark suite (``benchmarks/*_bench.py`` of a source checkout,
or ``--dir``: an installed package has none) at small sizes, then one table, ``bench.json`` and,
where matplotlib is installed, ``bench.png``.

Call order: :func:`cmd_bench` runs each script in a subprocess (quick sizes unless ``--full``),
gathers the rows of its comparison tables from its output, writes JSON and the chart, prints the
table.

Invariants: each bench runs for at most its timeout (``--timeout``, else :data:`TIMEOUT_S`), then
gets SIGTERM (it removes its files) and SIGKILL :data:`STOP_GRACE_S` later; a
bench that needs CUDA is skipped in a whole-suite run without a GPU (run when named); the exit
status is 0 only when every bench ran or was skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from .output import CommandError, NoProgress, make_console, make_table, print_json

_QUICK_ARGS = {
    "async": ["--gib", "0.1", "--reps", "2"],
    "dcp": ["--gib", "0.1", "--reps", "1"],
    "format": ["--gib", "0.1", "--reps", "2"],
    "gpu": ["--reps", "1"],
    "local": ["--mib", "32", "--reps", "3"],  # its third save is the first recycled one
    "replication": ["--mib", "32", "--reps", "2"],
    "scale": ["--worlds", "2", "4"],  # its default goes to 16 ranks
}
"""Small sizes for benches without ``--quick`` (from their docstrings' quick runs)."""

TIMEOUT_S = {"quick": 1800.0, "full": 14400.0}
"""Seconds a benchmark may run without ``--timeout``, at quick and at full sizes (then it is
stopped and reported as timed out: a hung bench never hangs the command)."""


def _bench_dir() -> Path:
    """``benchmarks/`` of the source checkout this package runs from (absent when installed)."""
    return Path(__file__).resolve().parents[3] / "benchmarks"


def cmd_bench(args: argparse.Namespace) -> int:
    """``tierpoint bench``: run the benchmarks; 0 when each ran or was skipped."""
    directory = Path(args.dir) if args.dir else _bench_dir()
    available = {p.name.removesuffix("_bench.py"): p for p in directory.glob("*_bench.py")}
    if not available and not args.dir:  # an installed package: the scripts are not in it
        raise CommandError(
            f"{directory}: no benchmarks there; they ship with the source repository, not the "
            "package: pass --dir <checkout>/benchmarks"
        )
    if not available:
        raise CommandError(f"{directory}: no benchmarks (*_bench.py) there")
    names = args.names or sorted(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise CommandError(
            f"no benchmark {unknown[0]!r}; there are: {', '.join(sorted(available))}"
        )
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file there, or a directory it may not write
        raise CommandError(
            f"--out {out_dir}: cannot be the results' directory ({e.strerror})"
        ) from e
    console = make_console(stderr=args.json)
    results = []
    if not args.names and any(n in _NEEDS_CUDA for n in names):
        import torch

        if not torch.cuda.is_available():  # the whole suite here: those are not for this machine
            results += [_skipped(n, "no CUDA device") for n in names if n in _NEEDS_CUDA]
            names = [n for n in names if n not in _NEEDS_CUDA]
    timeout = args.timeout or TIMEOUT_S["full" if args.full else "quick"]
    for name in names:
        with console.status(f"running {name}_bench.py") if console.is_terminal else NoProgress():
            results.append(_run_bench(name, available[name], args.full, timeout))
        if not args.json:
            console.print(f"{name}: {results[-1]['status']} in {results[-1]['seconds']:.1f} s")
    doc = {"tierpoint": __version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "results": results}  # fmt: skip
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    chart = _chart(results, out_dir / "bench.png")
    if args.json:
        print_json(doc | {"json": str(json_path), "chart": chart})
    else:
        columns = ["bench", "status", "seconds", "section", "contender", "figure"]
        console.print(make_table("benchmarks (quick sizes)" if not args.full else "benchmarks",
                             columns, _bench_rows(results)))  # fmt: skip
        console.print(f"results: {json_path}")
        console.print(f"chart: {chart}" if chart.endswith(".png") else chart)
    return (
        0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results) else 1
    )


_NEEDS_CUDA = {"gpu"}
"""Benches that need a GPU: skipped in a run of the whole suite without one (run when named)."""


def _skipped(name: str, why: str) -> dict[str, Any]:
    return {"bench": name, "args": [], "status": f"skipped ({why})", "seconds": 0.0,
            "contenders": [], "last_line": "", "figures": None, "output": ""}  # fmt: skip


def _run_bench(name: str, script: Path, full: bool, timeout: float) -> dict[str, Any]:
    text = script.read_text()
    extra = [] if full else (["--quick"] if '"--quick"' in text else _QUICK_ARGS.get(name, []))
    with tempfile.TemporaryDirectory(prefix="tierpoint-bench-") as tmp:
        figures_path = Path(tmp) / "figures.json"
        json_args = ["--json", str(figures_path)] if '"--json"' in text else []
        command = [sys.executable, str(script), *extra, *json_args]
        start = time.perf_counter()
        status, output = _run_bounded(command, timeout)
        seconds = time.perf_counter() - start
        figures = None
        if figures_path.exists():
            try:
                figures = json.loads(figures_path.read_text())
            except ValueError:
                figures = None
    lines = [line for line in output.splitlines() if line.strip()]
    return {
        "bench": name,
        "args": extra,
        "status": status,
        "seconds": seconds,
        "contenders": _contenders(output),
        "last_line": lines[-1].strip()[:100] if lines else "",
        "figures": figures,
        "output": output[-20_000:],
    }


STOP_GRACE_S = 60.0
"""Seconds a timed-out bench has, after SIGTERM, to close its queues and remove its files (in
/dev/shm: memory) before it is killed."""


def _run_bounded(command: list[str], timeout: float) -> tuple[str, str]:
    """Run ``command``: (status, its stdout then stderr). Past ``timeout`` it gets SIGTERM, which
    the benches unwind like Ctrl-C (a SIGKILL would leave their /dev/shm directories behind), and
    SIGKILL only :data:`STOP_GRACE_S` later."""
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = bench.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        bench.terminate()
        try:
            out, err = bench.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            bench.kill()
            try:  # children of its own may still hold the pipes open
                out, err = bench.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                out, err = "", ""
            bench.wait()
        return f"timed out after {timeout} s", (out or "") + (err or "")
    finally:
        if bench.poll() is None:  # this command interrupted: the bench stops too, cleanly
            bench.terminate()
            try:
                bench.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.wait()
    status = "ok" if bench.returncode == 0 else f"failed (exit status {bench.returncode})"
    return status, out + err


_NUMBER = re.compile(r"^(.*?\S)\s+(-?\d+(?:\.\d+)?)(?=\s|x|$)")


def _contenders(output: str) -> list[dict[str, Any]]:
    """The rows of the benches' comparison tables: a header line starting with ``contender``
    (columns apart by 2+ spaces), then one row per contender (name, then its first figure), up to a
    blank line; the section is the nearest line above the header."""
    found: list[dict[str, Any]] = []
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("contender"):
            continue
        header = re.split(r"\s{2,}", line.strip())
        label = header[1] if len(header) > 1 else "figure"
        above = [
            x.strip() for x in lines[max(0, i - 3) : i] if x.strip() and set(x.strip()) != {"-"}
        ]
        section = above[-1][:60] if above else ""
        for row in lines[i + 1 :]:
            if not row.strip():
                break
            m = _NUMBER.match(row.rstrip())
            if set(row.strip()) == {"-"} or m is None:
                continue
            found.append({"section": section, "name": m.group(1).strip(), "label": label,
                          "value": float(m.group(2))})  # fmt: skip
    return found


def _bench_rows(results: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """The one table: a row per contender of every bench (its last line where it has none)."""
    rows: list[tuple[Any, ...]] = []
    for r in results:
        head = (r["bench"], r["status"], f"{r['seconds']:.1f}")
        if not r["contenders"]:
            rows.append((*head, "", "", r["last_line"]))
        for k, c in enumerate(r["contenders"]):
            rows.append((*(head if k == 0 else ("", "", "")), c["section"], c["name"],
                         f"{c['value']:g} {c['label']}"))  # fmt: skip
    return rows


def _chart(results: Sequence[Mapping[str, Any]], path: Path) -> str:
    """Bars of every contender's figure, one panel per table of each bench (tierpoint's bars
    in another colour), or each bench's run time where none printed a table; the file's path,
    or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib not installed"
    panels: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        for c in r["contenders"]:
            panels.setdefault(f"{r['bench']}: {c['section']} ({c['label']})", []).append(c)
    if not panels:
        panels = {"run time (s)": [{"name": r["bench"], "value": r["seconds"]} for r in results]}
    heights = [0.6 + 0.3 * len(v) for v in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights) + 0.5), squeeze=False,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    for ax, (title, bars) in zip(axes[:, 0], panels.items()):
        colours = ["tab:orange" if "tierpoint" in b["name"] else "tab:blue" for b in bars]
        ax.barh([b["name"] for b in bars], [b["value"] for b in bars], color=colours)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
