"""`Plan.shared`: one plan object for equal plan data in a process (the agents of a simulated
process parsed and indexed each generation's plan once each, O(N^2) a process), a bounded
memo, bad data refused and not kept; and `with_generation` after a cached index."""

from __future__ import annotations

import copy

import pytest

from elasticpp.errors import ConfigError
from elasticpp.plan import Plan
from elasticpp.plan.layout import SHARED_PLANS
from tests.agents import pp_plan as _plan


def test_equal_plan_data_gives_one_plan_object() -> None:
    data = _plan(3).to_dict()
    first = Plan.shared(data)
    again = Plan.shared(copy.deepcopy(data))  # another dict, equal: another agent's parse
    assert again is first
    assert first == Plan.from_dict(data)
    assert Plan.shared(_plan(4).to_dict()) is not first


def test_the_memo_keeps_the_newest_plans_only() -> None:
    plans = [Plan.shared(_plan(100 + g).to_dict()) for g in range(SHARED_PLANS + 1)]
    assert Plan.shared(_plan(100 + SHARED_PLANS).to_dict()) is plans[-1]
    assert Plan.shared(_plan(100).to_dict()) is not plans[0]  # the oldest was let go
    assert Plan.shared(_plan(100).to_dict()) == plans[0]


def test_bad_plan_data_is_refused_every_time() -> None:
    data = _plan(3).to_dict()
    data["format_version"] = 99
    for _ in range(2):
        with pytest.raises(ConfigError, match="format_version 99"):
            Plan.shared(data)


def test_a_plan_whose_placement_was_indexed_takes_a_new_generation() -> None:
    plan = _plan(3)
    mine = plan.ranks_on(plan.placement[0].node_id)  # fills the cached index
    newer = plan.with_generation(4)
    assert newer.generation == 4 and plan.generation == 3
    assert newer.ranks_on(plan.placement[0].node_id) == mine
