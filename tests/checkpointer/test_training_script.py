"""An OLMo-core-style training script on 2 real ranks, written as an OLMo-core user writes it (only
the imports differ): a train module, ``CheckpointerConfig(...).build(process_group=...)``, an async
save every 2 steps (every 4th permanent, the others ephemeral), ``done()`` polled each step, and a
restart that resumes from ``latest_checkpoint``. Resumed training must end bit-equal to a run that
never stopped, every rank must get its own trainer state back, and superseded ephemeral
checkpoints must be gone. Run on a local directory and on the local S3 server (one script run each, in
the same 2 processes); the same processes then load a checkpoint saved by 1 rank (another world
size: every rank gets rank 0's trainer state), save and load an FSDP2 model through
``BasicTrainModule``, and refuse a ``process_group`` over fewer ranks. Before all that (while the
worker process still starts), a failed async save and a wait that timed out."""

from __future__ import annotations

import concurrent.futures
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.dcp.s3_server import s3_bucket, s3_server  # noqa: F401 - pytest fixtures
from tierpoint import CheckpointerConfig, fileformat, storage
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class MyTrainModule:
    """What an OLMo-core user's ``TrainModule`` subclass provides to the checkpointer."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model = model
        self.optim = optim

    def state_dict_to_save(self) -> dict:
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optim),
        }

    def state_dict_to_load(self, metadata, *, optim=None) -> dict:
        state = {"model": get_model_state_dict(self.model)}
        if optim is not False:
            state["optim"] = get_optimizer_state_dict(self.model, self.optim)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        set_model_state_dict(self.model, state_dict["model"])
        if "optim" in state_dict:
            set_optimizer_state_dict(self.model, self.optim, state_dict["optim"])

    def train_batch(self, batch: torch.Tensor) -> None:
        self.optim.zero_grad()
        self.model(batch).pow(2).mean().backward()
        self.optim.step()


def _build() -> MyTrainModule:
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    return MyTrainModule(model, torch.optim.AdamW(model.parameters(), lr=0.05))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def train(rank: int, save_folder: str | None, work_dir: str, stop_at: int) -> dict:
    """The training script: resume if there is a checkpoint, train up to ``stop_at``."""
    train_module = _build()
    trainer_state = {"global_step": 0, "data_loader": {"rank": rank, "batches_seen": 0}}
    loaded = None
    checkpointer = None
    if save_folder is not None:
        checkpointer = CheckpointerConfig(work_dir=work_dir).build(
            process_group=dist.new_group(backend="gloo")
        )
        try:
            path = checkpointer.latest_checkpoint(save_folder)
        except FileNotFoundError:
            path = None
        if path is not None:
            loaded = checkpointer.load(path, train_module)
            trainer_state = loaded
    future = None
    finished: list[int] = []
    for step in range(trainer_state["global_step"] + 1, stop_at + 1):
        train_module.train_batch(_batch(step, rank))
        trainer_state = {
            "global_step": step,
            "data_loader": {
                "rank": rank,
                "batches_seen": trainer_state["data_loader"]["batches_seen"] + 4,
            },
            "rng": torch.get_rng_state(),
        }
        if checkpointer is None:
            continue
        if future is not None and future.done():
            future.result()
            future = None
        if step % 2 == 0:
            if future is not None:
                future.result()
            future = checkpointer.save_async(
                f"{save_folder}/{checkpointer.checkpoint_dirname(step)}",
                train_module,
                trainer_state,
                ephemeral=step % 4 != 0,
            )
            assert isinstance(future, concurrent.futures.Future) and not future.cancel()
            future.add_done_callback(lambda f, step=step: finished.append(step))
    if future is not None:
        assert future.result() is None and future.done()
    return {
        "finished": finished,
        "loaded": loaded,
        "model": {k: v.clone() for k, v in get_model_state_dict(train_module.model).items()},
        "optim": get_optimizer_state_dict(train_module.model, train_module.optim)["state"],
    }


def _run_and_resume(rank: int, world: int, save_folder: str, work_dir: str) -> dict:
    first = train(rank, save_folder, work_dir, stop_at=6)  # saves 2 (ephemeral), 4, 6 (ephemeral)
    after_first = [
        s for s, _ in CheckpointerConfig(work_dir=work_dir).build().find_checkpoints(save_folder)
    ]
    dist.barrier()
    resumed = train(
        rank, save_folder, work_dir, stop_at=10
    )  # resumes at 6; saves 8, 10 (ephemeral)
    reference = train(rank, None, work_dir, stop_at=10)  # never stopped, never saved
    checkpointer = CheckpointerConfig(work_dir=work_dir).build()
    return {
        "first_loaded": first["loaded"],
        "finished": first["finished"] + resumed["finished"],
        "after_first": after_first,
        "resumed_from": _plain(resumed["loaded"]),
        "bit_equal": all(
            torch.equal(resumed["model"][k], reference["model"][k]) for k in reference["model"]
        )
        and all(
            torch.equal(resumed["optim"][p][k], reference["optim"][p][k])
            for p in reference["optim"]
            for k in reference["optim"][p]
        ),
        "steps": [s for s, _ in checkpointer.find_checkpoints(save_folder)],
        "ephemeral": [s for s, _ in checkpointer.find_checkpoints(save_folder, ephemeral=True)],
    }


def _plain(state: dict) -> dict:
    """The trainer state without tensors (results travel back to the test by pickle)."""
    rng = state.pop("rng")
    return {**state, "rng_ok": isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8}


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["first_loaded"] is None  # a first run: nothing to resume
        assert r["after_first"] == [4, 6]  # ephemeral step 2 removed once step 4 was finished
        state = r["resumed_from"]
        assert state["global_step"] == 6
        assert state["data_loader"] == {"rank": rank, "batches_seen": 24}  # its own, per rank
        assert state["rng_ok"]  # tensors in the trainer state come back as tensors
        assert r["bit_equal"]
        assert r["finished"] == [2, 4, 6, 8, 10]  # each future's callbacks ran once, in order
        assert r["steps"] == [4, 8, 10] and r["ephemeral"] == [10]


def _load_from_another_world_size(rank: int, path: str, work_dir: str) -> list:
    train_module = _build()
    state = CheckpointerConfig(work_dir=work_dir).build().load(path, train_module)
    return [state, get_model_state_dict(train_module.model)["weight"].tolist()]


def _fsdp2_round_trip(rank: int, world: int, folder: str, work_dir: str) -> list[bool]:
    """BasicTrainModule over an FSDP2 model (DTensor shards) and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tierpoint import BasicTrainModule

    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int) -> BasicTrainModule:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        fully_shard(model, mesh=mesh)
        return BasicTrainModule(model, torch.optim.AdamW(model.parameters(), lr=0.1))

    saved = build(0)
    saved.model(_batch(0, rank)).sum().backward()
    saved.optim.step()
    checkpointer = CheckpointerConfig(work_dir=work_dir).build()
    checkpointer.save(f"{folder}/step1", saved, {"rank": rank})
    loaded = build(1)
    state = checkpointer.load(f"{folder}/step1", loaded)
    weight = saved.model[0].weight
    exp_avg = [o.optim.state[o.model[0].weight]["exp_avg"].full_tensor() for o in (saved, loaded)]
    return [
        type(weight).__name__ == "DTensor",
        state == {"rank": rank},
        torch.equal(weight.full_tensor(), loaded.model[0].weight.full_tensor()),
        torch.equal(*exp_avg),
    ]


def _group_over_fewer_ranks_is_refused(work_dir: str) -> bool:
    group = dist.new_group(ranks=[0], backend="gloo")
    try:
        CheckpointerConfig(work_dir=work_dir).build(process_group=group)
    except ValueError:
        return True
    return False


def _failed_save_and_timed_out_wait(rank: int, folder: str, work_dir: str) -> list[bool]:
    """save_async's future while the worker still starts (first in the process): a wait past its
    timeout raises TimeoutError and leaves the save pending; a failed commit raises from
    result() on every rank, reaches done(), exception() and callbacks, and leaves no finished
    checkpoint."""
    checkpointer = CheckpointerConfig(work_dir=work_dir).build()
    called = []
    model = torch.nn.Linear(8, 4)
    train_module = MyTrainModule(model, torch.optim.AdamW(model.parameters()))
    future = checkpointer.save_async(f"{folder}/step1", train_module, {"step": 1})
    future.add_done_callback(called.append)
    if rank == 0:
        os.makedirs(f"{folder}/step1/.metadata.json")  # in the way of the commit
    out = []
    try:
        future.result(timeout=0.01)
    except TimeoutError:
        out.append(called == [])
    try:
        future.result(timeout=120)
    except CheckpointingError as e:
        out.append("step1/.metadata.json" in str(e))
    out.append(future.done() and called == [future])
    out.append(isinstance(future.exception(), CheckpointingError) and not future.cancel())
    try:
        checkpointer.latest_checkpoint(folder)
    except FileNotFoundError:
        out.append(True)
    return out


def _in_two_processes(
    rank: int, world: int, local: str, s3: str, work_dir: str, one_rank_step: str, fsdp: str
) -> list:
    failed = _failed_save_and_timed_out_wait(rank, f"{fsdp}-failed", work_dir)
    runs = [_run_and_resume(rank, world, folder, work_dir) for folder in (local, s3)]
    return [
        *runs,
        _load_from_another_world_size(rank, one_rank_step, work_dir),
        _fsdp2_round_trip(rank, world, fsdp, work_dir),
        _group_over_fewer_ranks_is_refused(work_dir),
        failed,
    ]


def _save_on_one_rank(folder: str, work_dir: str) -> tuple[str, list]:
    """A checkpoint saved by 1 rank (this process), plus a stray ``rank1`` trainer-state file that
    is not part of it: its ``.metadata.json`` records 1 rank. Its path and the weight saved (not
    :func:`_build`'s, which every rank starts from)."""
    path = f"{folder}/step3"
    with torch.random.fork_rng():
        torch.manual_seed(1)  # not _build()'s seed: a model left as built does not pass for loaded
        model = torch.nn.Linear(8, 4)
    train_module = MyTrainModule(model, torch.optim.AdamW(model.parameters()))
    CheckpointerConfig(work_dir=work_dir).build().save(path, train_module, {"saved_by": 0})
    fileformat.write(f"{path}/train/rank1.safetensors", {"saved_by": "stray"})
    return path, model.weight.tolist()


def test_olmo_style_script_on_a_local_directory_and_on_s3(s3_bucket, tmp_path):  # noqa: F811
    base, options = s3_bucket
    folder, work = str(tmp_path / "run"), str(tmp_path / "work")
    env = {"AWS_ENDPOINT_URL": options["endpoint_url"]}  # the script passes no storage options
    one_rank, saved_weight = _save_on_one_rank(str(tmp_path / "one"), work)
    fsdp = str(tmp_path / "fsdp")
    results = run_ranks(
        _in_two_processes, 2, folder, f"{base}/run", work, one_rank, fsdp, timeout=300, env=env
    )
    for backend in (0, 1):
        _check([r[backend] for r in results])
    # Loaded by another number of ranks: every rank gets rank 0's trainer state, and the same model.
    assert [r[2][0] for r in results] == [{"saved_by": 0}] * 2
    assert [r[2][1] for r in results] == [saved_weight] * 2  # (before: only the ranks compared)
    # BasicTrainModule on FSDP2 (DTensor shards): model and optimizer state back bit-equal.
    assert [r[3] for r in results] == [[True] * 4] * 2
    assert [r[4] for r in results] == [True, True]  # process_group over fewer ranks: refused
    assert [r[5] for r in results] == [[True] * 5] * 2  # a failed save, a wait that timed out
    assert sorted(os.listdir(folder)) == ["step10", "step4", "step8"]
    assert storage.listdir(f"{base}/run", options) == ["step10", "step4", "step8"]  # all removed
    assert sorted(os.listdir(f"{folder}/step8/train")) == ["rank0.safetensors", "rank1.safetensors"]
