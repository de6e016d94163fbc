"""The long fault run of issue 26: hundreds of kills aimed at every phase of both tiers and
thousands of corruptions of every file kind, on real 2-rank jobs; prints a table.

    .venv/bin/python benchmarks/fault_runner.py --kills 200 --corruptions 1000 [--seed S]
    .venv/bin/python benchmarks/fault_runner.py --replay-corruption SEED
    .venv/bin/python benchmarks/fault_runner.py --replay-kill SEED

Kills (``tests/fault/kill_job.py``): ``--chains`` independent chains of jobs, each chain a
checkpoint root of its own; each job restores what the previous one left (checked bit for bit
against what was committed before) and saves until the phase tracer kills one rank or the whole
job, or stops a rank, at the n-th entry into a phase drawn from the seed (``n`` up to what a job
without a kill showed for that phase). ``--replay-kill SEED`` draws the same kill (phase, rank, n,
scope) and runs it on a fresh chain: a job without a kill, the killed job, a checking job. Corruptions (``tests/fault/corruption_job.py``): batches of
trials on one job each, seeds ``seed * 1_000_000 + i``. Everything the tests check is checked here;
the table counts trials, faults by kind and phase, detected, recovered, hangs, silent corruptions
and committed checkpoints lost. Exit status 1 when any hang, silent corruption or loss was seen.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.fault import corruption_job, kill_job  # noqa: E402
from tests.fault.hooks.tierpoint_fault_phases import PHASES  # noqa: E402
from tierpoint.testing import RankFailure  # noqa: E402

SCOPES = ("rank", "job", "stop")
SCOPE_WEIGHTS = (0.46, 0.46, 0.08)
STEPS = 4


def draw_kill(seed: int, counts: dict[tuple[int, str], int]) -> dict[str, Any]:
    """The kill of seed ``seed``: a phase, a rank, the n-th entry, a scope."""
    rng = random.Random(seed)
    phase = rng.choice(PHASES)
    rank = rng.randrange(kill_job.WORLD)
    most = max(1, counts.get((rank, phase), 1))
    scope = rng.choices(SCOPES, SCOPE_WEIGHTS)[0]
    return {"phase": phase, "nth": rng.randint(1, most), "rank": rank, "scope": scope}


def calibrate(work: Path) -> dict[tuple[int, str], int]:
    """Phase entries per rank of a job without a kill that restores and saves ``STEPS`` steps."""
    root, logs = work / "calibrate", work / "calibrate-logs"
    kill_job.kill_trial(root, logs, 0, None, steps=STEPS)
    kill_job.kill_trial(root, logs, 1, None, steps=STEPS)  # this one restores something
    return kill_job.phase_counts(logs, 1)


def kill_chain(
    work: Path, chain: int, first_seed: int, target: int, counts: dict, log: Path
) -> list[dict[str, Any]]:
    """Jobs of one chain, seeds from ``first_seed`` on, until ``target`` kills hit their phase
    (at most ``2 * target + 5`` jobs), then one job without a kill that checks the last one."""
    root, logs = work / f"chain{chain}", work / f"chain{chain}-logs"
    out: list[dict[str, Any]] = []
    hits, seed = 0, first_seed
    while hits < target and len(out) < 2 * target + 5:
        out.append(_job(root, logs, len(out), seed, counts, chain, log))
        hits += out[-1]["killed_in"] is not None
        seed += 1
    out.append(_job(root, logs, len(out), -1, counts, chain, log))
    return out


def _job(root: Path, logs: Path, job: int, seed: int, counts: dict, chain: int, log: Path) -> dict:
    kill = draw_kill(seed, counts) if seed >= 0 else None
    trial = kill_job.kill_trial(root, logs, job, kill, steps=STEPS)
    record = {"seed": seed, "chain": chain, **trial.__dict__}
    with open(log, "a") as out:
        out.write(json.dumps({"type": "kill", **record}) + "\n")
    print(
        f"kill seed {seed}: {kill} -> {trial.killed_in} {trial.outcome} {trial.seconds:.1f} s"
        + (f" PROBLEMS {trial.problems}" if trial.problems else ""),
        flush=True,
    )
    return record


def run_kills(args: argparse.Namespace, work: Path, log: Path) -> list[dict[str, Any]]:
    counts = calibrate(work)
    per_chain = -(-args.kills // args.chains)
    results: list[dict[str, Any]] = []
    with concurrent.futures.ThreadPoolExecutor(args.chains) as pool:
        futures = [
            pool.submit(
                kill_chain, work, c, args.seed * 1_000_000 + c * 10_000, per_chain, counts, log
            )
            for c in range(args.chains)
        ]
        for f in concurrent.futures.as_completed(futures):
            results += f.result()
    return results


def run_corruptions(args: argparse.Namespace, work: Path, log: Path) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    batch = 250
    for first in range(0, args.corruptions, batch):
        seeds = [
            args.seed * 1_000_000 + i for i in range(first, min(first + batch, args.corruptions))
        ]
        root = Path(tempfile.mkdtemp(prefix="tierpoint-faults-", dir="/dev/shm"))
        trials = work / f"corruptions-{first}.jsonl"
        try:
            ranks = corruption_job.run_corruption_trials(root / "ckpt", seeds, trials, timeout=600)
            records = [r for rank in ranks for r in rank]
            hung = None
        except RankFailure as e:
            records = [json.loads(line) for line in trials.read_text().splitlines()]
            done = {r["seed"] for r in records}
            hung = next((s for s in seeds if s not in done), None)
            print(f"corruption batch failed at seed {hung}: {e}"[:2000], file=sys.stderr)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for r in records:
            r["problems"] = corruption_job.problems([r])
            results.append(r)
        if hung is not None:
            results.append({"seed": hung, "hung": True, "problems": [f"seed {hung} hung"]})
        with open(log, "a") as out:
            for r in records:
                out.write(json.dumps({"type": "corruption", **r}) + "\n")
        bad = sum(bool(r["problems"]) for r in records)
        print(f"corruptions {first}..: {len(records)} restores, {bad} with problems", flush=True)
    return results


def table(kills: list[dict[str, Any]], corruptions: list[dict[str, Any]], seconds: float) -> Table:
    t = Table(title=f"tierpoint fault run ({seconds / 60:.1f} min)")
    for col in (
        "faults",
        "kind / phase",
        "trials",
        "detected",
        "recovered",
        "hangs",
        "silent",
        "lost",
    ):
        t.add_column(col, justify="right" if col not in ("faults", "kind / phase") else "left")
    by_kind: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    ranks = [r for r in corruptions if r.get("rank", 0) == 0]
    for r in ranks:
        by_kind[r["mutation"]["file_kind"] if "mutation" in r else "?"].append(r)
    by_mutation: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in ranks:
        by_mutation[r["mutation"]["kind"] if "mutation" in r else "?"].append(r)

    def corruption_row(name: str, rows: list[dict[str, Any]]) -> list[str]:
        seeds = {r["seed"] for r in rows}
        rank_rows = [c for c in corruptions if c.get("seed") in seeds]
        detected = sum(r.get("outcome") == "detected" for r in rows)
        harmless = sum(r.get("outcome") == "harmless" for r in rows)
        silent = sum(r.get("outcome") == "silent" for r in rows)
        recovered = sum(not corruption_job.problems([c]) for c in rank_rows if "mutation" in c)
        return [
            name,
            str(len(rows)),
            f"{detected} (+{harmless} harmless)",
            f"{recovered}/{len(rank_rows)} restores",
            str(sum(bool(r.get("hung")) for r in rows)),
            str(silent),
            str(sum(bool(c.get("problems")) for c in rank_rows)),
        ]

    for kind, rows in sorted(by_kind.items()):
        t.add_row("corruption", *corruption_row(f"file: {kind}", rows))
    for kind, rows in sorted(by_mutation.items()):
        t.add_row("corruption", *corruption_row(f"mutation: {kind}", rows))
    t.add_row("corruption", *corruption_row("all", ranks), end_section=True)

    faulted = [k for k in kills if k["kill"] is not None]
    by_phase: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    by_scope: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    names = {"rank": "SIGKILL one rank", "job": "SIGKILL whole job", "stop": "SIGSTOP one rank"}
    for k in faulted:
        by_phase[f"phase: {k['killed_in'] or 'not reached'}"].append(k)
        by_scope[names[k["kill"]["scope"]]].append(k)

    def transient(problem: str) -> bool:
        """A kill's save left in flight (uncommitted step, dirty part): removed by a later save."""
        return "wait for clean-up" in problem and "after a clean job" not in problem

    def kill_row(name: str, rows: list[dict[str, Any]]) -> list[str]:
        hit = [k for k in rows if k["killed_in"]]
        lost = sum(
            any(
                "had been committed" in p or "NOT bit-equal" in p or "different steps" in p
                for p in k["problems"]
            )
            for k in rows
        )
        stops = [k for k in hit if k["kill"]["scope"] == "stop" and k["stop"]]
        named = sum(bool(k["stop"].get("named")) for k in stops)
        detected = f"{len(hit)} hit" + (f", {named}/{len(stops)} named" if stops else "")
        return [
            name,
            str(len(rows)),
            detected,
            str(sum(all(transient(p) for p in k["problems"]) for k in rows)),
            str(sum(k["hung"] or any("did not raise" in p for p in k["problems"]) for k in rows)),
            "-",
            str(lost),
        ]

    for phase in [f"phase: {p}" for p in PHASES] + ["phase: not reached"]:
        if phase in by_phase:
            t.add_row("kill/stop", *kill_row(phase, by_phase[phase]))
    for scope, rows in sorted(by_scope.items()):
        t.add_row("kill/stop", *kill_row(scope, rows))
    t.add_row("kill/stop", *kill_row("all", faulted), end_section=True)
    waiting = [k for k in faulted if any(transient(p) for p in k["problems"])]
    clean = [k for k in kills if k["kill"] is None]
    t.add_row(
        "clean-up",
        "> 8 files waiting after a kill",
        str(len(waiting)),
        "-",
        f"{sum(not k['problems'] for k in clean)}/{len(clean)} clean jobs after",
        "-",
        "-",
        "-",
    )
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--corruptions", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--replay-corruption", type=int, default=None)
    parser.add_argument("--replay-kill", type=int, default=None)
    parser.add_argument(
        "--log",
        default=os.path.join(tempfile.gettempdir(), f"fault_runner-{os.getpid()}.jsonl"),
        help="where each trial's record goes (JSON lines)",
    )
    parser.add_argument(
        "--table-from", default=None, help="print the table of a run's log (even an unfinished one)"
    )
    args = parser.parse_args()
    if args.table_from is not None:
        records = [json.loads(line) for line in Path(args.table_from).read_text().splitlines()]
        kills = [r for r in records if r.get("type") == "kill"]
        corruptions = [r for r in records if r.get("type") == "corruption"]
        Console(width=140).print(table(kills, corruptions, 0.0))
        return 0
    work = Path(tempfile.mkdtemp(prefix="tierpoint-faults-", dir="/dev/shm"))
    log = Path(args.log).resolve()
    start = time.monotonic()
    try:
        if args.replay_corruption is not None:
            args.seed, args.corruptions, args.kills = 0, 0, 0
            root = work / "ckpt"
            ranks = corruption_job.run_corruption_trials(
                root, [args.replay_corruption], work / "t.jsonl", timeout=300
            )
            for rank, records in enumerate(ranks):
                for r in records:
                    m = r["mutation"]
                    print(f"rank {rank}: seed {r['seed']}: {m['kind']} {m['target']} {m['detail']}")
                    print(f"  {r['outcome']}: {r['reason']}")
                    print(f"  tiered restore: {r['tiered']}; persistent only: {r['persistent']}")
                print("  problems:", corruption_job.problems(records) or "none")
            return 0
        if args.replay_kill is not None:
            counts = calibrate(work)
            kill = draw_kill(args.replay_kill, counts)
            print("replaying", kill)
            _job(work / "chain", work / "logs", 0, -1, counts, 0, log)  # something to restore
            for job, seed in enumerate((args.replay_kill, -1), start=1):
                print(_job(work / "chain", work / "logs", job, seed, counts, 0, log))
            return 0
        corruptions = run_corruptions(args, work, log) if args.corruptions else []
        kills = run_kills(args, work, log) if args.kills else []
        seconds = time.monotonic() - start
        console = Console(width=140)
        console.print(table(kills, corruptions, seconds))
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        console.print(f"command: {' '.join(sys.argv)}; finished {stamp}; log {log}")
        problems = [p for r in [*kills, *corruptions] for p in r.get("problems", [])]
        for p in problems[:50]:
            console.print(f"[red]{p}[/red]")
        return 1 if problems else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
