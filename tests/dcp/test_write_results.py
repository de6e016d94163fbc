"""A rank's write results: made once per plan, file layout and serialized values' sizes (a steady
save builds none), named for each save's token where they are used, and the same digest in their
own form and as JSON carries them."""

from __future__ import annotations

import json

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from tierpoint.dcp.file_plan import plan_files
from tierpoint.dcp.write_results import decode, digest, results_for


def _plan():
    state = {"w": torch.zeros(30, 20), "b": torch.zeros(7, dtype=torch.bfloat16), "step": 12}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plans, _ = planner.create_global_plan([planner.create_local_plan()])
    return plans[0]


def test_an_unchanged_save_gets_the_very_same_results_and_each_token_names_its_files():
    plan = _plan()
    files = plan_files(plan, "__0_", 2)
    (byte_item,) = [i for i, it in enumerate(plan.items) if it.type == WriteItemType.BYTE_IO]
    first = results_for(plan, files.with_token("aa"), {byte_item: 100}, "aa")
    again = results_for(plan, files.with_token("bb"), {byte_item: 100}, "bb")
    assert again is first  # nothing built for a steady save
    grown = results_for(plan, files.with_token("cc"), {byte_item: 101}, "cc")
    assert grown is not first and grown.digest != first.digest

    # every item, named for the save's token, where the file layout put it
    results = decode(first.rows, "bb")
    assert sorted(r.index.fqn for r in results) == ["b", "step", "w"]
    for r in results:
        assert r.storage_data.relative_path.endswith(".bb.distcp")
        assert r.size_in_bytes == r.storage_data.length > 0
    ranges = first.ranges("bb")
    assert sorted(ranges) == sorted(f.name for f in files.with_token("bb").files)
    assert sorted(rng for rs in ranges.values() for rng in rs) == sorted(
        (r.storage_data.offset, r.storage_data.length) for r in results
    )

    # the rows as JSON carries them (lists) decode and digest alike
    as_json = json.loads(json.dumps(first.rows))
    assert digest(as_json) == first.digest
    assert decode(as_json, "bb") == results
