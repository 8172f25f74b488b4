"""The workers' snapshot rule (`Assignment.snapshot_due`), pure: the step rule, the time rule
with its alignment to anchor steps, and the assignment's refusal of bad rules."""

from __future__ import annotations

import math
from typing import Any

import pytest

from elasticpp.errors import ConfigError
from elasticpp.plan import ClusterSpec, Layout, ModelSpec, build_plan, load_device_spec
from elasticpp.train.config import TrainConfig
from elasticpp.train.worker.main import Assignment

MODEL = ModelSpec("t2", num_layers=2, hidden_size=32, num_heads=4, vocab_size=256, seq_len=16)


def _assignment(**rule: Any) -> Assignment:
    plan = build_plan(
        MODEL,
        ClusterSpec.uniform(1, 1, load_device_spec("cpu")),
        Layout.parse("pp=1,tp=1,dp=1"),
        global_batch=4,
        micro_batch=2,
    )
    return Assignment(plan, 0, "127.0.0.1", 1234, "gen1", TrainConfig(steps=100), **rule)


def test_the_step_rule_takes_every_nth_step_whatever_the_time() -> None:
    a = _assignment(snapshot_every=5)
    assert [s for s in range(1, 21) if a.snapshot_due(s, 0.0)] == [5, 10, 15, 20]


def test_the_time_rule_waits_for_the_interval_and_then_for_an_aligned_step() -> None:
    a = _assignment(snapshot_every=0, snapshot_every_s=2.0, snapshot_align=4)
    assert not a.snapshot_due(8, 1.99)  # aligned, too soon
    assert not a.snapshot_due(9, 5.0)  # long enough, not an anchor step
    assert a.snapshot_due(12, 2.0)
    assert a.snapshot_due(12, math.inf)  # no rank holds it back (none writes)


def test_both_rules_off_leave_only_the_final_state() -> None:
    a = _assignment(snapshot_every=0, snapshot_every_s=0.0)
    assert not any(a.snapshot_due(s, math.inf) for s in range(1, 50))


def test_persistent_checkpoint_steps_are_snapshots_under_the_time_rule_too() -> None:
    a = _assignment(snapshot_every=10, snapshot_every_s=2.0, snapshot_align=4)
    assert a.snapshot_due(10, 0.0)  # the step rule, however recent the last one
    assert a.snapshot_due(16, 3.0) and not a.snapshot_due(14, 3.0)


@pytest.mark.parametrize(
    ("rule", "needle"),
    [
        ({"snapshot_every_s": -1.0}, "snapshot_every_s must be a number >= 0"),
        ({"snapshot_every_s": math.nan}, "snapshot_every_s must be a number >= 0"),
        ({"snapshot_align": 0}, "snapshot_align must be >= 1"),
    ],
)
def test_a_bad_rule_is_refused_naming_it(rule: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _assignment(**rule)
