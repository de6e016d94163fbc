"""Training throughput: a CPU training loop with no checkpoints, with tierpoint, and with DCP async_save.

Two ranks (real processes, a real gloo group, ``tierpoint.testing.run_ranks``), one torch thread each,
train a small GPT-style model data-parallel: token and position embeddings, ``--layers`` pre-norm
``torch.nn.TransformerEncoderLayer`` blocks with a causal mask, a final LayerNorm and an LM head;
AdamW (fused where this torch has it), a cosine LR schedule, deterministic synthetic tokens from a
per-rank generator, gradients averaged with one flat all-reduce per step. Each rank's state
(parameters + AdamW moments) is some tens of MB (printed).

Contenders, each ``--steps`` timed steps a run, interleaved A B C A B C ... for ``--reps``
repetitions (the machine is shared and its speed drifts; neighbours in time are compared):

- (A) no checkpoints;
- (B) ``tierpoint.TieredCheckpointManager(local_every=10, persistent_every=50)``: ``maybe_save`` after
  every step; the local tier in a fresh directory under /dev/shm, the persistent tier (torch DCP
  files) in a temporary directory on disk. One manager per rank for the whole benchmark, as in a
  training job: it is built, ``restore``d (nothing there) and warmed up by two saves to both tiers
  before anything is timed (reported as "first saves"); every run ends with ``manager.wait()``
  inside the timed region (each save of the run is committed), and ``close()`` is timed separately,
  once, at the end;
- (C) torch DCP ``async_save(state_dict, checkpoint_id=...)`` every 10 steps into a temporary
  directory on disk, default staging, with its own gloo process group (its background thread runs
  collectives while training all-reduces on the default group; sharing one group from two threads
  is not safe). Before each save the previous save's future is awaited, as the DCP docs advise, and
  the checkpoint before that is removed (rank 0), so disk use stays bounded; one untimed warm-up
  save first; every run ends with waiting for its last future inside the timed region.

Step numbers continue across runs: every run of B and C is ``--steps`` consecutive steps starting
at a multiple of 50, so its first step saves and every save has the nine steps after it inside the
run, as in a long job; with the default 80 a run holds 8 local saves, 2 persistent saves (at its
first step and 50 steps later: a little more than the schedule's average, so against tierpoint) and
8 DCP saves. A diagnostic clock wraps a few of the manager's callees (finalize rounds, the step
agreement, planning, snapshot + dispatch, the persistent copy's read and planning) to say where
tierpoint's blocking time goes. A run's time is the slowest rank's; steps/s figures are medians over
repetitions, ratios are medians of per-repetition ratios. "blocking" is what the training thread
spent inside the checkpoint calls: for tierpoint every ``maybe_save`` (save steps and the others,
where finished saves are finalized and a deferred persistent copy starts) plus the final ``wait``;
for DCP the wait for the previous future plus the ``async_save`` call. tierpoint's own
``manager.stats()`` blocking and durable medians per tier are printed too (they include the
warm-up saves; a persistent copy made from the local part starts inside a later ``maybe_save``,
which the benchmark's own timing counts whatever ``stats()`` counts). CPU-seconds per run (both
ranks with their threads and tierpoint workers, and what other processes took meanwhile) tell how
much work each contender adds and how busy the shared machine was.

Run: ``./run bench training`` (3-6 minutes, depending on what else runs), ``./run bench training --quick`` (under a minute:
one repetition of 20 steps), ``--json PATH`` writes every figure. Everything written (the /dev/shm
directory, the disk directory) is removed at the end, also on failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_bench import disk_root
from floor import preallocate, tensors_of
from machine import _live_descendants_cpu, cpu_sample, machine_line, require_memory

from tierpoint import RankLocal, TieredCheckpointManager
from tierpoint.testing import run_ranks

WORLD = 2
LOCAL_EVERY = 10
PERSISTENT_EVERY = 50
DCP_EVERY = 10
WARMUP_STEPS = 3
CONTENDERS = ("none", "tierpoint", "dcp")
LABELS = {
    "none": "(A) no checkpoints",
    "tierpoint": f"(B) tierpoint local/{LOCAL_EVERY} + persistent/{PERSISTENT_EVERY}",
    "dcp": f"(C) DCP async_save/{DCP_EVERY}",
}
TARGET_VS_NONE = 0.9

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")


@dataclass(frozen=True)
class Config:
    vocab: int = 2048
    d_model: int = 256
    layers: int = 3
    heads: int = 4
    batch: int = 2
    seq: int = 64
    steps: int = 80
    reps: int = 3


# ------------------------------------------------------------------------------------ training


class GPT(torch.nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = torch.nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                cfg.d_model,
                cfg.heads,
                4 * cfg.d_model,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(cfg.layers)
        )
        self.norm = torch.nn.LayerNorm(cfg.d_model)
        self.head = torch.nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(cfg.seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


class DataStream:
    """Deterministic synthetic tokens from a per-rank generator (stateful, as a data loader is)."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(1000 + rank)

    def next_batch(self) -> torch.Tensor:
        shape = (self.cfg.batch, self.cfg.seq + 1)
        return torch.randint(0, self.cfg.vocab, shape, generator=self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.generator.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.generator.set_state(sd["rng"])


class Trainer:
    def __init__(self, cfg: Config, rank: int, world: int) -> None:
        torch.manual_seed(0)  # the same initial model on every rank
        self.cfg, self.rank, self.world = cfg, rank, world
        self.model = GPT(cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        try:
            self.optimizer = torch.optim.AdamW(self.params, lr=3e-4, fused=True)
            self.fused = True
        except (RuntimeError, TypeError):  # no fused CPU AdamW in this torch
            self.optimizer = torch.optim.AdamW(self.params, lr=3e-4)
            self.fused = False
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=100_000)
        self.data = DataStream(cfg, rank)
        self.position = {"samples": 0}
        self.flat_grad = torch.zeros(sum(p.numel() for p in self.params))
        self.loss = float("nan")

    def step(self) -> None:
        tokens = self.data.next_batch()
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, self.cfg.vocab), tokens[:, 1:].reshape(-1)
        )
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        grads = [p.grad for p in self.params]
        offset = 0
        for g in grads:  # one all-reduce of one flat buffer, as DDP's buckets do
            self.flat_grad[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        dist.all_reduce(self.flat_grad)
        self.flat_grad /= self.world
        offset = 0
        for g in grads:
            g.copy_(self.flat_grad[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.optimizer.step()
        self.schedule.step()
        self.position["samples"] += self.cfg.batch
        self.loss = loss.item()

    def tiered_state(self) -> dict[str, Any]:
        """The state tierpoint saves (as in tests/tiered/helpers.py)."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "schedule": self.schedule,
            "data": RankLocal(self.data),
            "position": self.position,
        }

    def dcp_state(self) -> dict[str, Any]:
        """The same contents for torch DCP (live tensors: async_save stages its own copy)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            f"data_rank{self.rank}": self.data.state_dict(),
            "position": dict(self.position),
        }

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters and AdamW moments (what a checkpoint copies, less a few scalars)."""
        sd = self.optimizer.state_dict()["state"]
        return [p.detach() for p in self.params] + tensors_of(sd)

    def state_bytes(self) -> int:
        sd = self.optimizer.state_dict()["state"]
        moments = sum(t.numel() * t.element_size() for s in sd.values() for t in s.values())
        return moments + sum(p.numel() * p.element_size() for p in self.params)


# ------------------------------------------------------------------------------------ contenders


class DcpSaver:
    """torch DCP async_save every DCP_EVERY steps, one save in flight, the newest two kept."""

    def __init__(self, root: Path, rank: int) -> None:
        self.root, self.rank = root, rank
        self.group = dist.new_group(backend="gloo")
        self.pending: Any = None
        self.saved: list[Path] = []
        self.blocking: list[float] = []
        self.durable: list[float] = []
        self._started = 0.0

    def _wait_previous(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.durable.append(time.perf_counter() - self._started)
            self.pending = None
            # Every rank finished the older ones: each rank awaited one before starting the next
            # save, whose collective planning the save just awaited needed from every rank.
            while len(self.saved) > 1:
                old = self.saved.pop(0)
                if self.rank == 0:
                    shutil.rmtree(old, ignore_errors=True)

    def save(self, step: int, state: dict[str, Any]) -> float:
        start = time.perf_counter()
        self._wait_previous()
        path = self.root / f"step_{step:08d}"
        self._started = time.perf_counter()
        self.pending = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
        self.saved.append(path)
        seconds = time.perf_counter() - start
        self.blocking.append(seconds)
        return seconds

    def wait(self) -> float:
        start = time.perf_counter()
        self._wait_previous()
        return time.perf_counter() - start


def run_none(trainer: Trainer, steps: int) -> dict[str, float]:
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    return {"seconds": time.perf_counter() - start}


class PhaseClock:
    """Seconds the training thread spends in parts of ``maybe_save``/``wait`` (diagnostic only):
    wraps a few of the manager's callees on this rank's instances and module; a part this version
    of tierpoint lacks is skipped. The wrapped calls do not nest (see ``PARTS``)."""

    PARTS = {
        "finalize rounds (poll)": ("queue", "maybe_finalize_async_calls"),
        "wait for previous save (make room)": ("queue", "finalize_through"),
        "agree on the step": ("manager", "_agree_on_step"),
        "local: plan (local.save)": ("local", "save"),
        "snapshot + dispatch (schedule)": ("queue", "schedule_async_request"),
        "persistent copy: hold local part": ("local", "hold_own_part"),
        "persistent copy: plan (DCP)": ("tpdcp", "async_save_request"),
    }
    NESTED = {  # inside the parts above (finalize rounds, make room, schedule)
        "queue all-gathers": ("queue", "_all_gather"),
        "concluding saves (outcome gather + commit fns)": ("queue", "_conclude"),
    }

    def __init__(self, manager: TieredCheckpointManager) -> None:
        import tierpoint.dcp as tpdcp

        parts = {**self.PARTS, **self.NESTED}
        self.seconds: dict[str, float] = dict.fromkeys(parts, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(parts, 0)
        from tierpoint.asyncsave import AsyncCallsQueue

        owners = {
            "queue": AsyncCallsQueue,  # (the class: the manager makes a queue per tier on use)
            "manager": manager,
            "local": manager.local,
            "tpdcp": tpdcp,
        }
        for label, (owner_name, attr) in parts.items():
            owner = owners[owner_name]
            real = getattr(owner, attr, None)
            if real is None:
                del self.seconds[label], self.calls[label]
                continue
            setattr(owner, attr, self._wrap(label, real))

    def _wrap(self, label: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        return timed

    def take(self) -> dict[str, float]:
        """Seconds per part since the last ``take``, and ``<part> #``: how many calls."""
        out = {**self.seconds, **{f"{k} #": float(n) for k, n in self.calls.items()}}
        for k in self.seconds:
            self.seconds[k], self.calls[k] = 0.0, 0
        return out


def run_tierpoint(
    trainer: Trainer, manager: TieredCheckpointManager, clock: PhaseClock, first: int, steps: int
) -> dict[str, Any]:
    state = trainer.tiered_state()
    calls: dict[str, list[float]] = {"local": [], "local+persistent": [], "none": []}
    clock.take()
    start = time.perf_counter()
    for step in range(first, first + steps):
        trainer.step()
        t0 = time.perf_counter()
        tiers = manager.maybe_save(step, state)
        calls["+".join(tiers) or "none"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    manager.wait()
    end = time.perf_counter()
    in_saves = sum(calls["local"]) + sum(calls["local+persistent"])
    return {
        "seconds": end - start,
        "in_saves": in_saves,
        "in_other_steps": sum(calls["none"]),
        "final_wait": end - t0,
        "blocking": in_saves + sum(calls["none"]) + (end - t0),
        "save_steps": float(len(calls["local"]) + len(calls["local+persistent"])),
        "calls": calls,
        "phases": clock.take(),
    }


def run_dcp(trainer: Trainer, saver: DcpSaver, first: int, steps: int) -> dict[str, float]:
    in_saves = 0.0
    saves = 0
    start = time.perf_counter()
    for step in range(first, first + steps):
        trainer.step()
        if step % DCP_EVERY == 0:
            in_saves += saver.save(step, trainer.dcp_state())
            saves += 1
    final = saver.wait()
    end = time.perf_counter()
    return {
        "seconds": end - start,
        "in_saves": in_saves,
        "final_wait": final,
        "blocking": in_saves + final,
        "save_steps": float(saves),
    }


# ------------------------------------------------------------------------------------ a rank


def memcpy_floor(tensors: list[torch.Tensor]) -> float:
    """Seconds to ``copy_`` the state into preallocated tensors: the floor of a snapshot."""
    targets = preallocate(tensors)
    start = time.perf_counter()
    for dst, src in zip(targets, tensors):
        dst.copy_(src)
    return time.perf_counter() - start


def first_step(rep: int, steps: int) -> int:
    """Run ``rep`` covers ``steps`` consecutive steps from a multiple of PERSISTENT_EVERY (past the
    warm-up saves at steps 1 and 2): its first step saves to both tiers and each save has the
    nine steps after it inside the run, as in a long job (``steps`` is a multiple of 10)."""
    span = math.ceil(steps / PERSISTENT_EVERY) * PERSISTENT_EVERY
    return PERSISTENT_EVERY + rep * span


def bench_rank(rank: int, world: int, local_root: str, disk: str, cfg: Config) -> dict[str, Any]:
    torch.set_num_threads(1)
    trainer = Trainer(cfg, rank, world)
    out: dict[str, Any] = {"fused": trainer.fused}

    # tierpoint: built first (its worker process starts meanwhile) and restored (nothing there)
    t0 = time.perf_counter()
    manager = TieredCheckpointManager(
        local_root,
        str(Path(disk) / "tierpoint-persistent"),
        "bench",
        local_every=LOCAL_EVERY,
        persistent_every=PERSISTENT_EVERY,
        replication_factor=1,  # one node: nothing to replicate to (the default only warns)
    )
    out["tp_construct_s"] = time.perf_counter() - t0
    state = trainer.tiered_state()
    if manager.restore(state) is not None:
        raise RuntimeError("the benchmark's fresh directories held a checkpoint")
    clock = PhaseClock(manager)
    saver = DcpSaver(Path(disk) / "dcp", rank)

    for _ in range(WARMUP_STEPS):  # builds the AdamW moments; first-touch costs
        trainer.step()
    out["state_bytes"] = trainer.state_bytes()

    # DCP: one untimed save
    t0 = time.perf_counter()
    saver.save(0, trainer.dcp_state())
    saver.wait()
    out["dcp_first_save_s"] = time.perf_counter() - t0
    saver.blocking.clear()
    saver.durable.clear()

    # tierpoint: two untimed saves to both tiers, each waited for (the first waits for the worker)
    first_saves = []
    for step in (1, 2):
        trainer.step()
        t0 = time.perf_counter()
        manager.save(step, state)
        first_saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        manager.wait()
        first_saves.append(time.perf_counter() - t0)
    out["tp_first_save_s"], out["tp_first_wait_s"] = first_saves[0], first_saves[1]
    out["tp_second_save_s"], out["tp_second_wait_s"] = first_saves[2], first_saves[3]

    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    floor: list[float] = []
    for rep in range(cfg.reps):
        first = first_step(rep, cfg.steps)
        for contender in CONTENDERS:
            dist.barrier()
            before, worker_before = cpu_sample(), _live_descendants_cpu()
            if contender == "none":
                run = run_none(trainer, cfg.steps)
            elif contender == "tierpoint":
                run = run_tierpoint(trainer, manager, clock, first, cfg.steps)
            else:
                run = run_dcp(trainer, saver, first, cfg.steps)
            after, worker_after = cpu_sample(), _live_descendants_cpu()
            # CPU seconds: this rank with its threads and its tierpoint worker process, the latter
            # alone, and the whole machine (every process: the other rank, other users)
            run["cpu_rank_and_worker"] = after.own - before.own
            run["cpu_worker"] = worker_after - worker_before
            run["cpu_machine"] = after.machine_busy - before.machine_busy
            runs[contender].append(run)
        floor.append(memcpy_floor(trainer.state_tensors()))
    dist.barrier()
    if rank == 0:  # sanity: what each contender left (tierpoint keeps 3; DCP here the newest)
        out["on_disk"] = {
            "tierpoint persistent": sorted(p.name for p in Path(manager.persistent_dir).iterdir()),
            "dcp": sorted(p.name for p in saver.root.iterdir()),
        }
    t0 = time.perf_counter()
    manager.close()
    out["tp_close_s"] = time.perf_counter() - t0
    out["tp_stats"] = manager.stats()
    out["dcp_blocking"] = saver.blocking
    out["dcp_durable"] = saver.durable
    out["runs"] = runs
    out["memcpy_floor_s"] = floor
    out["loss"] = trainer.loss
    dist.destroy_process_group(saver.group)
    return out


# ------------------------------------------------------------------------------------ report


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarise(per_rank: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    reps = cfg.reps
    # The job runs at its slowest rank's pace: per run, the maximum over ranks.
    seconds = {
        c: [max(r["runs"][c][i]["seconds"] for r in per_rank) for i in range(reps)]
        for c in CONTENDERS
    }
    steps_per_s = {c: [cfg.steps / s for s in v] for c, v in seconds.items()}
    ratio = {c: median([a / b for a, b in zip(seconds["none"], seconds[c])]) for c in CONTENDERS}
    tp_vs_dcp = median([d / t for t, d in zip(seconds["tierpoint"], seconds["dcp"])])

    def per_run(contender: str, key: str) -> list[float]:
        return [max(r["runs"][contender][i].get(key, 0.0) for r in per_rank) for i in range(reps)]

    def summed(contender: str, key: str) -> list[float]:
        return [sum(r["runs"][contender][i][key] for r in per_rank) for i in range(reps)]

    cpu = {}
    for c in CONTENDERS:
        job = summed(c, "cpu_rank_and_worker")
        machine = [per_rank[0]["runs"][c][i]["cpu_machine"] for i in range(reps)]
        cpu[c] = {
            "job_cpu_s": job,
            "worker_cpu_s": summed(c, "cpu_worker"),
            "others_cpus": [max(0.0, m - j) / t for m, j, t in zip(machine, job, seconds[c])],
        }
    per_rep_ratio = {c: [a / b for a, b in zip(seconds["none"], seconds[c])] for c in CONTENDERS}
    # The job's CPU-seconds of (A) over a contender's, per repetition: the throughput ratio a
    # machine whose every core is busy tends to (extra work then costs its full CPU time).
    for c in CONTENDERS:
        a, x = cpu["none"]["job_cpu_s"], cpu[c]["job_cpu_s"]
        cpu[c]["cpu_ratio_vs_none"] = median([p / q for p, q in zip(a, x)])

    tp_runs = per_rank[0]["runs"]["tierpoint"]
    dcp_runs = per_rank[0]["runs"]["dcp"]

    def call_stat(kind: str, fn: Callable[[list[float]], float]) -> float:
        """``fn`` of one rank's maybe_save calls of ``kind`` over every run; the worse rank."""
        pooled = [
            [x for run in r["runs"]["tierpoint"] for x in run["calls"][kind]] for r in per_rank
        ]
        return max(fn(p) if p else 0.0 for p in pooled)

    phases = {
        label: max(
            median([run["phases"][label] for run in r["runs"]["tierpoint"]]) for r in per_rank
        )
        for label in tp_runs[0]["phases"]
    }
    blocking = {
        "tierpoint": {
            "per_run_s": median(per_run("tierpoint", "blocking")),
            "save_steps_per_run": tp_runs[0]["save_steps"],
            "in_save_steps_s": median(per_run("tierpoint", "in_saves")),
            "in_other_steps_s": median(per_run("tierpoint", "in_other_steps")),
            "final_wait_s": median(per_run("tierpoint", "final_wait")),
            "local_save_call_median_s": call_stat("local", median),
            "both_tiers_call_median_s": call_stat("local+persistent", median),
            "other_call_median_s": call_stat("none", median),
            "other_call_max_s": call_stat("none", max),
            "other_calls_over_5ms_per_run": call_stat("none", lambda v: sum(x > 5e-3 for x in v))
            / reps,
            "phases_per_run_s": phases,
        },
        "dcp": {
            "per_run_s": median(per_run("dcp", "blocking")),
            "save_steps_per_run": dcp_runs[0]["save_steps"],
            "in_save_steps_s": median(per_run("dcp", "in_saves")),
            "final_wait_s": median(per_run("dcp", "final_wait")),
            "per_save_median_s": max(median(r["dcp_blocking"]) for r in per_rank),
            "durable_median_s": max(median(r["dcp_durable"]) for r in per_rank),
        },
    }
    tiers: dict[str, Any] = {}
    for tier in ("local", "persistent"):
        got = [r["tp_stats"]["tiers"].get(tier) for r in per_rank]
        if all(got):
            tiers[tier] = {
                "saves": got[0]["saves"],
                "failed": max(g["failed"] for g in got),
                "blocking_median_s": max(g["blocking_s"]["median"] for g in got),
                "blocking_max_s": max(g["blocking_s"]["max"] for g in got),
                "durable_median_s": max(g["durable_s"]["median"] for g in got),
                "durable_max_s": max(g["durable_s"]["max"] for g in got),
            }
    warmup = {
        k: max(r[k] for r in per_rank)
        for k in (
            "tp_construct_s",
            "tp_first_save_s",
            "tp_first_wait_s",
            "tp_second_save_s",
            "tp_second_wait_s",
            "tp_close_s",
            "dcp_first_save_s",
        )
    }
    checks = {
        f"tierpoint >= {TARGET_VS_NONE}x no checkpoints": {
            "value": ratio["tierpoint"],
            "pass": ratio["tierpoint"] >= TARGET_VS_NONE,
        },
        "tierpoint ahead of DCP async_save": {"value": tp_vs_dcp, "pass": tp_vs_dcp > 1.0},
    }
    return {
        "config": asdict(cfg),
        "world": WORLD,
        "state_mib_per_rank": per_rank[0]["state_bytes"] / 2**20,
        "fused_adamw": per_rank[0]["fused"],
        "seconds_per_run": seconds,
        "steps_per_s": steps_per_s,
        "steps_per_s_median": {c: median(v) for c, v in steps_per_s.items()},
        "ratio_vs_none": ratio,
        "ratio_vs_none_per_rep": per_rep_ratio,
        "tierpoint_vs_dcp": tp_vs_dcp,
        "cpu": cpu,
        "memcpy_floor_s": max(median(r["memcpy_floor_s"]) for r in per_rank),
        "blocking": blocking,
        "tierpoint_stats": tiers,
        "warmup": warmup,
        "checks": checks,
        "final_loss": [r["loss"] for r in per_rank],
        "on_disk": per_rank[0].get("on_disk", {}),
    }


def print_report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    print(
        f"\ntraining loop: GPT {cfg['layers']} x d{cfg['d_model']}, vocab {cfg['vocab']},"
        f" batch {cfg['batch']} x {cfg['seq']} tokens, {res['world']} ranks x 1 thread, gloo,"
        f" {'fused' if res['fused_adamw'] else 'foreach'} AdamW + cosine LR;"
        f" state {res['state_mib_per_rank']:.0f} MiB per rank; {cfg['steps']} steps a run,"
        f" {cfg['reps']} interleaved repetitions (medians; vs (A): median of per-repetition ratios)"
    )
    blk = res["blocking"]
    head = (
        f"{'contender':40s} {'steps/s':>8s} {'ms/step':>8s} {'vs (A)':>7s} {'blocking/run':>13s}"
        f" {'CPU-s/run':>10s} {'CPU vs (A)':>10s} {'others':>7s}"
    )
    print(head)
    print("-" * len(head))
    for c in CONTENDERS:
        sps = res["steps_per_s_median"][c]
        b = f"{blk[c]['per_run_s'] * 1e3:10.0f} ms" if c in blk else ""
        job = median(res["cpu"][c]["job_cpu_s"])
        others = median(res["cpu"][c]["others_cpus"])
        print(
            f"{LABELS[c]:40s} {sps:8.2f} {1e3 / sps:8.1f} {res['ratio_vs_none'][c]:6.3f}x {b:>13s}"
            f" {job:10.1f} {res['cpu'][c]['cpu_ratio_vs_none']:9.3f}x {others:7.2f}"
        )
    print(
        "CPU-s/run: both ranks with their threads and tierpoint workers; CPU vs (A): (A)'s"
        " CPU-s over this contender's (median of per-repetition ratios); others: CPUs other"
        " processes used meanwhile (average)"
    )
    for c in CONTENDERS[1:]:
        ratios = " ".join(f"{x:.3f}" for x in res["ratio_vs_none_per_rep"][c])
        others = " ".join(f"{x:.2f}" for x in res["cpu"][c]["others_cpus"])
        print(f"  {c:9s} per repetition: vs (A) {ratios}; others' CPUs {others}")
    worker = median(res["cpu"]["tierpoint"]["worker_cpu_s"])
    print(
        f"  tierpoint workers (nice 19) used {worker:.2f} CPU-s a run; memcpy floor of one rank's"
        f" state {res['memcpy_floor_s'] * 1e3:.1f} ms"
    )

    tp, dc = blk["tierpoint"], blk["dcp"]
    print("\nwhere the training thread waited, per run (slowest rank, medians):")
    print(
        f"  tierpoint: {tp['save_steps_per_run']:.0f} save steps {tp['in_save_steps_s'] * 1e3:.0f} ms"
        f" ({tp['in_save_steps_s'] / max(tp['save_steps_per_run'], 1) * 1e3:.1f} ms each),"
        f" other maybe_save calls {tp['in_other_steps_s'] * 1e3:.0f} ms,"
        f" final wait {tp['final_wait_s'] * 1e3:.0f} ms"
    )
    print(
        f"    maybe_save medians: local save step {tp['local_save_call_median_s'] * 1e3:.1f} ms,"
        f" local + persistent step {tp['both_tiers_call_median_s'] * 1e3:.1f} ms, other steps"
        f" {tp['other_call_median_s'] * 1e3:.2f} ms (max {tp['other_call_max_s'] * 1e3:.0f} ms,"
        f" {tp['other_calls_over_5ms_per_run']:.1f} a run over 5 ms)"
    )
    phases = tp["phases_per_run_s"]

    def part(label: str) -> str:
        return f"{label} {phases[label] * 1e3:.0f} ms ({phases[label + ' #']:.0f} calls)"

    print("    of which, per run:")
    for label in [k for k in PhaseClock.PARTS if k in phases]:
        print(f"      {part(label)}")
    nested = [part(k) for k in PhaseClock.NESTED if k in phases]
    if nested:
        print(f"      inside those: {'; '.join(nested)}")
    print(
        f"  DCP:       {dc['save_steps_per_run']:.0f} saves {dc['in_save_steps_s'] * 1e3:.0f} ms"
        f" ({dc['per_save_median_s'] * 1e3:.1f} ms each: wait for the previous + async_save),"
        f" final wait {dc['final_wait_s'] * 1e3:.0f} ms; durable {dc['durable_median_s']:.3f} s"
    )
    print("tierpoint manager.stats() (slowest rank):")
    for tier, s in res["tierpoint_stats"].items():
        print(
            f"  {tier:10s} {s['saves']:3d} saves ({s['failed']} failed), blocking median"
            f" {s['blocking_median_s'] * 1e3:.1f} ms (max {s['blocking_max_s'] * 1e3:.1f}),"
            f" durable median {s['durable_median_s']:.3f} s (max {s['durable_max_s']:.3f})"
        )
    w = res["warmup"]
    print(
        f"untimed: construct {w['tp_construct_s']:.2f} s; first save (both tiers) blocking"
        f" {w['tp_first_save_s'] * 1e3:.0f} ms + wait {w['tp_first_wait_s'] * 1e3:.0f} ms;"
        f" second {w['tp_second_save_s'] * 1e3:.0f} ms + {w['tp_second_wait_s'] * 1e3:.0f} ms;"
        f" close() {w['tp_close_s'] * 1e3:.0f} ms; DCP first save + wait"
        f" {w['dcp_first_save_s'] * 1e3:.0f} ms"
    )
    kept = "; ".join(f"{k}: {' '.join(v)}" for k, v in res["on_disk"].items())
    print(f"on disk at the end: {kept}")
    print()
    for label, check in res["checks"].items():
        print(f"{label:44s} {check['value']:6.3f}x  {'PASS' if check['pass'] else 'FAIL'}")


# ------------------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Config()
    p.add_argument("--reps", type=int, default=d.reps, help=f"repetitions (default {d.reps})")
    p.add_argument(
        "--steps",
        type=int,
        default=d.steps,
        help=f"timed steps a run, a multiple of {LOCAL_EVERY} (default {d.steps})",
    )
    p.add_argument("--quick", action="store_true", help="one repetition of 20 steps (< 1 minute)")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.steps = 1, 20
    if args.steps <= 0 or args.steps % LOCAL_EVERY or args.reps <= 0:
        p.error(f"--steps must be a positive multiple of {LOCAL_EVERY}, --reps positive")
    cfg = Config(
        vocab=args.vocab,
        d_model=args.d_model,
        layers=args.layers,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        reps=args.reps,
    )
    return cfg, args


def main(argv: Sequence[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    params = cfg.vocab * cfg.d_model * 2 + cfg.layers * 12 * cfg.d_model**2
    # per rank: the state, DCP's staged copy, tierpoint's staging and 2 local + 3 persistent files
    require_memory(WORLD * (12 * params * 8) + 2**30, "use a smaller --d-model or --layers")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = cpu_sample()
    local_root = tempfile.mkdtemp(prefix="tierpoint-training-bench-", dir="/dev/shm")
    disk = disk_root()
    try:
        per_rank = run_ranks(bench_rank, WORLD, local_root, disk, cfg, timeout=3600, pg_timeout=600)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    res = summarise(per_rank, cfg)
    res["machine"] = machine_line(start)
    res["persistent_dir_fs"] = f"disk temp dir under {Path(disk).parent}"
    print_report(res)
    print(f"\n{res['machine']}")
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2, default=float) + "\n")
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
