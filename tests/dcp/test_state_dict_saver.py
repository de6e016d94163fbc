"""Cached planning: saves after the first of an unchanged layout run no planning collectives but one
all-reduce of one integer, and still write correct checkpoints; a layout change on any single rank
makes every rank plan again."""

from __future__ import annotations

import os
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tests.collectives import CountCollectives
from tierpoint import storage
from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest
from tierpoint.dcp import (
    CheckpointMetadataCache,
    StagingPool,
    Writer,
    async_save,
    get_latest_complete_checkpoint,
    save,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    step_path,
    verify_global_md_reuse,
)
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .test_writer import assert_same

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

_COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce_scatter",
    "scatter",
    "scatter_object_list",
)


class CollectiveCounter:
    """Counts calls of torch.distributed's collectives (by name) while active."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.active = False
        for name in _COLLECTIVES:
            original = getattr(dist, name)

            def counted(*a, _name=name, _original=original, **k):
                if self.active:
                    self.calls[_name] += 1
                return _original(*a, **k)

            setattr(dist, name, counted)

    def measure(self, fn, *args, **kwargs):
        self.calls.clear()
        self.active = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.active = False


def _state(rank: int, step: int, extra: bool) -> dict:
    g = torch.Generator().manual_seed(step)
    state = {
        "w": torch.randn(32, 16, generator=g),
        "b": torch.randn(16, generator=g),
        f"own{rank}": torch.full((8,), float(rank * 100 + step)),
        "step": step,
    }
    if extra:
        state["extra"] = torch.arange(5) + step
    return state


def _planning_counts(rank: int, world: int, root: str) -> list:
    counter = CollectiveCounter()
    cache = CheckpointMetadataCache()
    report = []
    for step in range(1, 7):
        extra = step >= 5 and rank == 1  # from step 5, rank 1 alone holds one more tensor
        state = _state(rank, step, extra)
        path = step_path(root, step)
        writer, metadata, wrapper = counter.measure(
            save_state_dict_async_plan,
            state,
            Writer(path),
            enable_cache=True,
            metadata_cache=cache,
        )
        planning = dict(counter.calls)
        writer.write_now()
        save_state_dict_async_finalize(writer, metadata, wrapper)
        dist.barrier()
        # Every rank checks the whole checkpoint with torch's own reader.
        loaded = {k: torch.zeros_like(v) for k, v in _state(0, step, False).items() if k != "step"}
        for r in range(world):
            loaded[f"own{r}"] = torch.zeros(8)
        if step >= 5:
            loaded["extra"] = torch.zeros(5, dtype=torch.int64)
        loaded["step"] = 0
        dcp.load(loaded, storage_reader=FileSystemReader(path), no_dist=True)
        expected = _state(0, step, step >= 5)
        ok = all(torch.equal(loaded[k], expected[k]) for k in ("w", "b"))
        ok &= loaded["step"] == step
        ok &= all(
            torch.equal(loaded[f"own{r}"], torch.full((8,), float(r * 100 + step)))
            for r in range(world)
        )
        if step >= 5:
            ok &= torch.equal(loaded["extra"], torch.arange(5) + step)
        report.append([planning, bool(ok), cache.validated_cache_reuse, cache.planning_rounds])
    return report


def test_unchanged_layout_skips_planning_collectives(tmp_path):
    reports = run_ranks(_planning_counts, 2, str(tmp_path), timeout=180)
    for rank, report in enumerate(reports):
        counts = [r[0] for r in report]
        assert all(r[1] for r in report), (rank, report)  # every checkpoint is correct
        # Save 1 plans (gather + scatter of plans); saves 2-4 only agree with one all-reduce.
        assert counts[0].get("gather_object") == 1 and counts[0].get("scatter_object_list") == 1
        for k in (1, 2, 3):
            assert counts[k] == {"all_reduce": 1}, (rank, k, counts[k])
        # Save 5: rank 1's layout changed, so every rank plans again; save 6 is cached again.
        assert counts[4].get("gather_object") == 1 and counts[4].get("all_reduce") == 1
        assert counts[5] == {"all_reduce": 1}
        assert [r[2] for r in report] == [False, True, True, True, False, True]
        assert [r[3] for r in report] == [1, 1, 1, 1, 2, 2]


def test_single_process_cache_reuse(tmp_path):
    cache = CheckpointMetadataCache()
    for step in range(3):
        state = {"a": torch.full((4,), float(step)), "n": step}
        save(state, step_path(tmp_path, step), metadata_cache=cache)
        out = {"a": torch.zeros(4), "n": 0}
        dcp.load(out, checkpoint_id=step_path(tmp_path, step))
        assert torch.equal(out["a"], state["a"]) and out["n"] == step
    assert cache.planning_rounds == 1
    assert cache.get_metadata_caching_status() == (True, False)
    assert sorted(os.listdir(tmp_path)) == ["step-0", "step-1", "step-2"]


def _fresh_local_plan(state: dict) -> object:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    return planner.create_local_plan()


def test_the_local_plan_is_reused_only_while_what_it_is_made_from_is_unchanged(tmp_path):
    """Each save's local plan equals the one torch's planner makes afresh for its state; the
    previous one is reused (the same object) exactly when keys, nesting, dtypes, shapes and
    requires_grad are unchanged, and every checkpoint loads back."""

    def t() -> torch.Tensor:
        return torch.arange(6.0).reshape(2, 3)

    states = [
        ("first", {"a": torch.ones(4), "m": {"b": t()}, "n": 1}),
        ("new values", {"a": torch.zeros(4), "m": {"b": t() + 1}, "n": 2}),
        ("dtype", {"a": torch.zeros(4, dtype=torch.float64), "m": {"b": t()}, "n": 2}),
        ("shape", {"a": torch.zeros(5, dtype=torch.float64), "m": {"b": t()}, "n": 2}),
        (
            "requires_grad",
            {"a": torch.zeros(5, dtype=torch.float64), "m": {"b": t().requires_grad_()}, "n": 2},
        ),
        ("nesting", {"a": torch.zeros(5, dtype=torch.float64), "m.b": t(), "n": 2}),
        (
            "value to tensor",
            {"a": torch.zeros(5, dtype=torch.float64), "m.b": t(), "n": torch.ones(1)},
        ),
        (
            "unchanged again",
            {"a": torch.ones(5, dtype=torch.float64), "m.b": t(), "n": torch.zeros(1)},
        ),
    ]
    cache = CheckpointMetadataCache()
    previous = None
    for step, (change, state) in enumerate(states):
        save(state, step_path(tmp_path, step), metadata_cache=cache)
        plan = cache.cached_local_plan
        assert plan == _fresh_local_plan(state), change
        assert (plan is previous) == (change in ("new values", "unchanged again")), change
        previous = plan
        out = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()
        }
        if isinstance(state.get("m"), dict):
            out["m"] = {"b": torch.zeros_like(state["m"]["b"])}
        dcp.load(out, checkpoint_id=step_path(tmp_path, step))
        # every value, not only "a" (zeros in most steps, as the template is): a reused plan must
        # not write the previous state's values
        assert_same(out, state)


def test_own_async_requests_reuse_one_staging_buffer(tmp_path):
    # NVRx style: the caller builds the AsyncRequest from the writer's functions and finalizes with
    # save_state_dict_async_finalize alone; the staging buffer must still come back to the pool.
    pool, cache = StagingPool(), CheckpointMetadataCache()
    with AsyncCallsQueue() as queue:
        for step in range(3):
            state = {"a": torch.full((1000,), float(step)), "n": step}
            writer = Writer(step_path(tmp_path, step), staging_pool=pool)
            planned = save_state_dict_async_plan(state, writer, metadata_cache=cache)
            async_fn, preload_fn, args = writer.get_save_function_and_args()
            request = AsyncRequest(
                async_fn,
                args,
                [lambda planned=planned: save_state_dict_async_finalize(*planned)],
                preload_fn=preload_fn,
            )
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            out = {"a": torch.zeros(1000), "n": -1}
            dcp.load(out, checkpoint_id=step_path(tmp_path, step))
            assert torch.equal(out["a"], state["a"]) and out["n"] == step
    assert pool.allocations == 1 and len(pool._free) == 1


def test_a_writer_whose_async_save_is_not_finalized_refuses_another_save(tmp_path):
    """Reusing the writer of an async save that is written but not finalized (torch's flow resets
    it, tierpoint's plans with it) is refused before anything changes: the first save then
    commits the files it wrote."""
    step = step_path(tmp_path, 1)
    writer = Writer(step)
    state = {"a": torch.arange(1000.0)}
    planned = save_state_dict_async_plan(state, writer, enable_cache=True)
    async_fn, preload_fn, args = writer.get_save_function_and_args()
    async_fn(*args, **preload_fn())  # the snapshot, then the background write
    for reuse in (
        lambda: save_state_dict_async_plan(state, writer, enable_cache=True),
        lambda: dcp.save(state, storage_writer=writer),
        lambda: writer.set_up_storage_writer(True, rank=0),
    ):
        with pytest.raises((CheckpointingError, CheckpointException)) as info:
            reuse()
        failures = getattr(info.value, "failures", {})  # torch wraps the writer's error
        assert "async save is still in flight; finalize" in f"{info.value} {failures}"
    save_state_dict_async_finalize(*planned)
    assert get_latest_complete_checkpoint(tmp_path) == step
    out = {"a": torch.zeros(1000)}
    dcp.load(out, checkpoint_id=step)
    assert torch.equal(out["a"], state["a"])
    save({"a": torch.ones(1000)}, step, overwrite=True)  # finalized: the directory is free again


def _fail_then_retry(rank: int, world: int, base: str, rounds: int) -> list[str]:
    def refused(*args: object, **kwargs: object) -> None:
        raise CheckpointingError("refused by the test")

    errors = []
    for i in range(rounds):
        path = step_path(base, i)
        original = storage.write_files_parallel
        if rank == 1:
            storage.write_files_parallel = refused
        try:
            save({f"r{rank}": torch.ones(1000)}, path)
        except CheckpointingError:
            pass
        finally:
            storage.write_files_parallel = original
        try:
            save({f"r{rank}": torch.ones(1000)}, path)  # at once: the other rank may still clean up
        except CheckpointingError as e:
            errors.append(str(e).splitlines()[0])
    return errors


def test_a_failed_save_retried_at_once_succeeds(tmp_path):
    """The failed save's clean-up removes the emptied step directory; the retry's set-up on another
    rank may just have created it: the retry must not fail for that."""
    assert run_ranks(_fail_then_retry, 2, str(tmp_path), 40, timeout=240) == [[], []]


def test_caching_can_be_disabled(tmp_path):
    cache = CheckpointMetadataCache()
    for step in range(2):
        save(
            {"a": torch.ones(2)},
            step_path(tmp_path, step),
            enable_cache=False,
            metadata_cache=cache,
        )
    assert cache.planning_rounds == 0 and cache.cached_central_plan is None


def test_unchanged_write_results_are_not_sent_again(tmp_path, monkeypatch):
    from tierpoint.dcp import commit

    gathered = []
    original = commit._gather_results

    def spy(*args, **kwargs):
        gathered.append(original(*args, **kwargs))
        return gathered[-1]

    monkeypatch.setattr(commit, "_gather_results", spy)
    cache = CheckpointMetadataCache()
    for step, name in enumerate(["a", "b", "c", "x" * 500, "y" * 500]):
        state = {"w": torch.full((16,), float(step)), "name": name}
        save(state, step_path(tmp_path, step), metadata_cache=cache)
        out = {"w": torch.zeros(16), "name": ""}
        dcp.load(out, checkpoint_id=step_path(tmp_path, step))
        assert torch.equal(out["w"], state["w"]) and out["name"] == name
    # Same sizes and offsets: the coordinator commits the results it remembers; a longer value
    # changes them, and they are sent once more.
    assert [g is None for g in gathered] == [False, True, True, False, True]


def _save_unchanged_then_changed(rank: int, world: int, base: str) -> list[dict[str, int]]:
    cache = CheckpointMetadataCache()
    counts = []
    for step, length in enumerate([4, 4, 4, 400]):  # the last save changes the layout
        state = {
            "w": torch.full((8,), float(step)),
            f"own{rank}": torch.full((length,), float(rank)),
        }
        with CountCollectives() as counted:
            save(state, step_path(base, step), metadata_cache=cache)
        counts.append(dict(counted))
        out = {"w": torch.zeros(8), f"own{rank}": torch.zeros(length)}
        dcp.load(out, checkpoint_id=step_path(base, step))
        assert torch.equal(out["w"], state["w"]) and torch.equal(
            out[f"own{rank}"], state[f"own{rank}"]
        )
    return counts


@pytest.mark.timeout(300)
def test_a_save_of_an_unchanged_layout_is_committed_without_a_gather(tmp_path):
    """From the second save of an unchanged layout on, the ranks agree by all-reduces of a few
    integers alone (O(1) bytes per rank at any world size); a changed layout plans and sends its
    write results to the coordinator again."""
    gathers = ("all_gather", "all_gather_object", "gather", "gather_object", "scatter_object_list")
    for counts in run_ranks(_save_unchanged_then_changed, 3, str(tmp_path), timeout=240):
        first, second, third, changed = counts
        assert sum(first[k] for k in gathers) > 0
        for steady in (second, third):
            assert {k: steady[k] for k in gathers} == dict.fromkeys(gathers, 0)
            assert steady["broadcast"] == 0
        assert changed["gather"] == 1  # the write results, to the coordinator alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{i}" for i in range(4)]


def test_plans_loaded_with_the_metadata_skip_planning(tmp_path):
    """NVRx's resume path: metadata carrying every rank's local plan seeds a fresh cache."""
    import dataclasses

    first = CheckpointMetadataCache()
    state = {"w": torch.arange(6.0), "n": 1}
    save(state, step_path(tmp_path, 1), metadata_cache=first)
    loaded = dataclasses.replace(first.cached_global_metadata)
    loaded.all_local_plans = [first.cached_local_plan]
    resumed = CheckpointMetadataCache()
    resumed.set_cached_global_metadata(loaded)
    state["w"].add_(1)
    save(state, step_path(tmp_path, 2), metadata_cache=resumed)
    assert resumed.planning_rounds == 0
    assert resumed.get_metadata_caching_status() == (False, True)
    out = {"w": torch.zeros(6), "n": 0}
    dcp.load(out, checkpoint_id=step_path(tmp_path, 2))
    assert torch.equal(out["w"], torch.arange(6.0) + 1) and out["n"] == 1
    # A layout that does not match the loaded plans is planned normally.
    other = CheckpointMetadataCache()
    other.set_cached_global_metadata(loaded)
    save({"w": torch.zeros(7), "n": 1}, step_path(tmp_path, 3), metadata_cache=other)
    assert other.planning_rounds == 1


def _md_reuse_verdicts(rank: int, world: int, base: str) -> list[bool]:
    cache = CheckpointMetadataCache()
    state = {"w": torch.arange(6.0), f"own{rank}": torch.ones(2)}
    writer, metadata, wrapper = save_state_dict_async_plan(
        state, Writer(step_path(base, 1)), enable_cache=True, metadata_cache=cache
    )
    writer.write_now()
    save_state_dict_async_finalize(writer, metadata, wrapper)
    plans: list = [None] * world
    dist.all_gather_object(plans, cache.cached_local_plan)
    same = verify_global_md_reuse(plans, cache.cached_local_plan, rank, wrapper)
    other = plans[0] if rank == 1 else cache.cached_local_plan  # rank 1's layout differs
    changed = verify_global_md_reuse(plans, other, rank, wrapper)
    return [same, changed, verify_global_md_reuse(None, other, rank, wrapper)]


def test_verify_global_md_reuse_agrees_on_every_rank(tmp_path):
    """NVRx's public check: true on every rank only when every rank's plan matches its loaded one."""
    assert run_ranks(_md_reuse_verdicts, 2, str(tmp_path)) == [[True, False, False]] * 2


def _save_into_step_of_rank(rank: int, world: int, base: str) -> str:
    try:
        save({"w": torch.full((4,), float(rank))}, step_path(base, 10 + rank))
    except CheckpointingError as e:
        return str(e)
    return "saved"


def test_ranks_saving_into_different_steps_commit_nothing(tmp_path):
    results = run_ranks(_save_into_step_of_rank, 2, str(tmp_path))
    assert len(set(results)) == 1 and "every rank must pass the same step directory" in results[0]
    assert "'step-10'" in results[0] and "'step-11'" in results[0]
    assert get_latest_complete_checkpoint(tmp_path) is None
    assert not any(tmp_path.rglob(".metadata"))


def _peer_gone_at_the_cached_vote(rank: int, world: int, root: str) -> list[str]:
    cache = CheckpointMetadataCache()
    for step in (1, 2):
        save(_state(rank, step, False), step_path(root, step), metadata_cache=cache)
    if rank == 1:
        os._exit(0)  # gone before the third save's vote
    try:
        save(_state(rank, 3, False), step_path(root, 3), metadata_cache=cache)
    except CheckpointingError:
        pass
    target = step_path(root, 3)
    return sorted(os.listdir(target)) if os.path.isdir(target) else []


def test_a_peer_lost_at_the_planning_vote_leaves_no_marker(tmp_path, monkeypatch):
    """The vote of cached planning fails when a peer is gone: the surviving rank removes its
    unfinished marker (and files) like for any other failure, instead of leaving them behind."""
    monkeypatch.setenv("TIERPOINT_TIMEOUT", "20")
    results = run_ranks(
        _peer_gone_at_the_cached_vote, 2, str(tmp_path), allow_crash={1}, timeout=120
    )
    assert results[0] == []


def _save_other_sizes(rank: int, world: int, base: str, is_async: bool) -> str:
    state = {"w": torch.zeros(2 + rank), "b": torch.ones(3)}
    try:
        if is_async:
            async_save(state, step_path(base, 1)).result()
        else:
            save(state, step_path(base, 1))
    except CheckpointingError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("is_async", [False, True])
def test_a_replicated_tensor_of_other_sizes_on_the_ranks_commits_nothing(tmp_path, is_async):
    """torch keeps one rank's copy of a replicated value: one whose size differs between ranks
    made a checkpoint no load accepted; now every rank is told at planning, and nothing is
    committed."""
    results = run_ranks(_save_other_sizes, 2, str(tmp_path), is_async)
    assert all("'w' is a torch.float32 tensor of size [3] on rank 1" in r for r in results)
    assert get_latest_complete_checkpoint(tmp_path) is None
    assert not any(tmp_path.rglob(".metadata"))
