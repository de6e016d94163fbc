"""The memo of values worked out from a plan: one value per plan object and key, the last few
plans kept."""

from __future__ import annotations

from torch.distributed.checkpoint.planner import SavePlan

from tierpoint.dcp.plan_data import PlanMemo


def test_a_value_is_made_once_per_plan_object_and_key_and_old_plans_are_evicted():
    memo: PlanMemo[str] = PlanMemo(size=2)
    made: list[str] = []

    def make(text: str):
        return lambda: made.append(text) or text

    a, b, c = SavePlan([]), SavePlan([]), SavePlan([])  # equal, but different plans
    assert memo.get(a, 1, make("a1")) == "a1"
    assert memo.get(a, 1, make("again")) == "a1"
    assert memo.get(b, 1, make("b1")) == "b1"  # another plan object, however equal
    assert memo.get(a, 2, make("a2")) == "a2"  # another key
    assert memo.get(c, 1, make("c1")) == "c1"  # the oldest two (a,1) then (b,1) go
    assert memo.get(a, 1, make("a1 anew")) == "a1 anew"
    assert made == ["a1", "b1", "a2", "c1", "a1 anew"]
