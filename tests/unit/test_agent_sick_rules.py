"""The leader's sick-node rules (elasticpp.agent.sick), driven with a fake clock."""

from __future__ import annotations

import pytest

from elasticpp.agent.kernel.decide import ClusterView, Replan, Wait, candidates, decide_replan
from elasticpp.agent.sick import (
    EndJob,
    Quarantine,
    Readmit,
    Report,
    SickNodes,
    SickPolicy,
    blame,
)
from elasticpp.errors import ConfigError

INC = {"a": "ia", "b": "ib", "c": "ic"}


def _sick(**kw: float) -> SickNodes:
    return SickNodes(SickPolicy(**kw))  # type: ignore[arg-type]


def _quarantined(actions: list[object]) -> list[str]:
    return [a.entry.node for a in actions if isinstance(a, Quarantine)]


def test_a_node_that_blames_itself_is_blamed_not_the_peers_that_failed_after_it() -> None:
    reports = [
        Report("a", "worker exited with code 1", at=10.0),
        Report("b", "state fetch failed: ENOSPC", at=11.0, culprit=True),
    ]
    assert set(blame(reports)) == {"b"}


def test_without_a_culprit_the_earliest_reporters_are_blamed() -> None:
    reports = [
        Report("a", "worker exited with code 1", at=10.0),
        Report("b", "worker exited with code 1", at=10.3),
        Report("c", "worker exited with code 1", at=12.0),
    ]
    assert set(blame(reports)) == {"a", "b"}


def test_reports_that_followed_a_peers_loss_are_blamed_only_when_every_report_did() -> None:
    """A worker dies in its step: its peers' collectives fail a moment later ("connection
    closed by peer") and their reports came within the window, so the victims were struck
    with the culprit; with strikes cleared only by a completed step, a node whose workers die
    in their first step would have taken its healthy peers into quarantine with it."""
    reports = [
        Report(
            "b",
            "worker rank 1 exited with code 1 after a peer went away",
            10.05,
            followed_a_peer=True,
        ),
        Report("a", "worker rank 0 exited with code 1", at=10.1),
        Report(
            "c",
            "worker rank 2 exited with code 1 after a peer went away",
            10.2,
            followed_a_peer=True,
        ),
    ]
    assert set(blame(reports)) == {"a"}
    victims = [r for r in reports if r.followed_a_peer]  # the cause's report never came
    assert set(blame(victims)) == {"b", "c"}


def test_a_node_failing_k_generations_in_a_row_is_quarantined_with_its_reason() -> None:
    sick = _sick(strikes_to_quarantine=3, base_s=60.0)
    for gen in (1, 2):
        assert _quarantined(sick.judge(gen, [Report("a", "crash", 100.0 + gen)], INC, 100.0)) == []
    actions = sick.judge(3, [Report("a", "crash", 103.0)], INC, 103.0)
    assert _quarantined(actions) == ["a"]
    entry = sick.quarantined["a"]
    assert entry.until == 103.0 + 60.0
    assert entry.incarnation == "ia"
    assert "3 failed generations in a row" in entry.reason


def test_a_generation_that_trains_resets_the_strikes() -> None:
    sick = _sick(strikes_to_quarantine=2)
    sick.judge(1, [Report("a", "crash", 1.0)], INC, 1.0)
    sick.trained(["a", "b"])
    assert _quarantined(sick.judge(2, [Report("a", "crash", 2.0)], INC, 2.0)) == []


def test_a_severe_report_quarantines_at_the_first_strike() -> None:
    sick = _sick(strikes_to_quarantine=3)
    r = Report("b", "state fetch failed: No space left", 5.0, culprit=True, severe=True)
    assert _quarantined(sick.judge(1, [r], INC, 5.0)) == ["b"]


def test_each_generation_is_judged_once() -> None:
    sick = _sick(strikes_to_quarantine=2)
    r = [Report("a", "crash", 1.0)]
    sick.judge(4, r, INC, 1.0)
    assert sick.judge(4, r, INC, 1.1) == []  # the next tick sees the same reports
    assert sick.strikes["a"] == 1


def test_quarantine_backs_off_exponentially_up_to_its_ceiling() -> None:
    sick = _sick(strikes_to_quarantine=1, base_s=10.0, max_s=35.0)
    lengths = []
    now = 0.0
    for gen in range(1, 5):
        sick.judge(gen, [Report("a", "disk", now)], INC, now)
        q = sick.quarantined["a"]
        lengths.append(q.until - q.since)
        now = q.until
        assert [type(a) for a in sick.expire(INC, now)] == [Readmit]
    assert lengths == [10.0, 20.0, 35.0, 35.0]


def test_a_quarantine_ends_when_it_runs_out_or_the_agent_restarts() -> None:
    sick = _sick(strikes_to_quarantine=1, base_s=60.0)
    sick.judge(1, [Report("a", "disk", 0.0)], INC, 0.0)
    assert sick.expire(INC, 59.0) == []
    assert sick.expire({**INC, "a": "new-incarnation"}, 30.0) == [
        Readmit("a", "its agent restarted")
    ]
    assert "a" not in sick.quarantined


def test_a_node_lost_generation_after_generation_is_quarantined() -> None:
    sick = _sick(strikes_to_quarantine=2)
    sick.judge(1, [], INC, 1.0, lost=["c"])
    assert _quarantined(sick.judge(2, [], INC, 2.0, lost=["c"])) == ["c"]


def test_the_failure_budget_ends_the_job_with_the_reason() -> None:
    sick = _sick(strikes_to_quarantine=100, max_failures=3, window_s=60.0)
    for gen, at in ((1, 0.0), (2, 30.0), (3, 40.0)):
        assert sick.judge(gen, [Report("a", "crash", at)], INC, at) == []
    # the first failure left the window: three within it, still within the budget
    assert sick.judge(4, [Report("a", "crash", 65.0)], INC, 65.0) == []
    ends = sick.judge(5, [Report("a", "crash", 66.0)], INC, 66.0)
    assert len(ends) == 1 and isinstance(ends[0], EndJob)
    assert "4 failed generations within 60 s (max_failures is 3)" in ends[0].reason
    assert sick.judge(6, [Report("a", "crash", 72.0)], INC, 72.0) == []  # ended once


def test_a_missed_deadline_quarantines_at_once() -> None:
    sick = _sick(strikes_to_quarantine=3)
    assert _quarantined(sick.exclude("b", "did not arrive", "ib", 5.0)) == ["b"]
    assert sick.exclude("b", "did not arrive", "ib", 6.0) == []  # already set aside


def test_a_new_leader_keeps_the_published_quarantines_and_their_count() -> None:
    first = _sick(strikes_to_quarantine=1, base_s=10.0)
    first.judge(1, [Report("a", "disk", 0.0)], INC, 0.0)
    second = _sick(strikes_to_quarantine=1, base_s=10.0)
    second.load(first.quarantined)
    second.expire(INC, 10.0)
    second.judge(2, [Report("a", "disk", 10.0)], INC, 10.0)
    assert second.quarantined["a"].count == 2
    assert second.quarantined["a"].until - second.quarantined["a"].since == 20.0


@pytest.mark.parametrize(
    "kw",
    [
        {"strikes_to_quarantine": 0},
        {"base_s": 0.0},
        {"base_s": 100.0, "max_s": 10.0},
        {"max_failures": 0},
        {"window_s": 0.0},
    ],
)
def test_a_policy_that_cannot_work_is_refused_naming_the_setting(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        SickPolicy(**kw)  # type: ignore[arg-type]


def _view(**kw: object) -> ClusterView:
    members = {n: {"incarnation": f"i{n}"} for n in ("a", "b", "c", "d")}
    base: dict[str, object] = {
        "members": members,
        "dead": set(),
        "current_nodes": ("a", "b", "c", "d"),
        "failed": set(),
        "now_s": 100.0,
        "last_join_s": 0.0,
    }
    base.update(kw)
    return ClusterView(**base)  # type: ignore[arg-type]


def test_a_quarantined_node_receives_no_work_and_its_generation_is_replaced() -> None:
    view = _view(quarantined=frozenset({"c"}))
    assert candidates(view) == ["a", "b", "d"]
    decision = decide_replan(view, min_nodes=1, max_nodes=4, settle_s=2.0)
    assert isinstance(decision, Replan)
    assert decision.nodes == ("a", "b", "d")
    assert decision.reason == "quarantined node(s) c"
    assert not decision.graceful


def test_below_min_nodes_the_job_waits_and_names_the_quarantined() -> None:
    view = _view(quarantined=frozenset({"c", "d"}))
    decision = decide_replan(view, min_nodes=3, max_nodes=4, settle_s=2.0)
    assert isinstance(decision, Wait)
    assert decision.reason == "only 2 usable node(s) (2 quarantined: c, d), min_nodes is 3"


def test_strikes_carried_to_the_next_term_quarantine_at_its_first_failure() -> None:
    """A term ends (its leader's lease lapsed on an overloaded machine) between two failures
    of a sick node: the next term starts from the strikes the newest record carried, so
    the node's third failed generation quarantines it whoever leads."""
    first = _sick(strikes_to_quarantine=3)
    for gen in (1, 2):
        first.judge(gen, [Report("a", "crash", 100.0 + gen)], INC, 100.0 + gen)
    carried = first.carried()
    assert carried == {"a": 2}
    second = _sick(strikes_to_quarantine=3)  # a new term
    second.seed(carried)
    assert _quarantined(second.judge(3, [Report("a", "crash", 103.0)], INC, 103.0)) == ["a"]
    fresh = _sick(strikes_to_quarantine=3)  # without the carried strikes: one strike only
    assert _quarantined(fresh.judge(3, [Report("a", "crash", 103.0)], INC, 103.0)) == []


def test_a_record_carries_the_most_struck_nodes_only_and_junk_is_not_seeded() -> None:
    from elasticpp.agent.sick import CARRIED_STRIKES

    sick = _sick(strikes_to_quarantine=1000)
    sick.strikes = {f"n{i:04d}": 1 for i in range(2 * CARRIED_STRIKES)}
    sick.strikes["n1999"] = 5
    carried = sick.carried()
    assert len(carried) == CARRIED_STRIKES and carried["n1999"] == 5
    seeded = _sick()
    seeded.seed({"a": 2, "b": 0, "c": -1, "d": "3", "e": 1.5, "f": True, 7: 2})
    assert seeded.strikes == {"a": 2}
    seeded.seed(["a"])  # not a mapping: nothing
    seeded.seed(None)
    assert seeded.strikes == {"a": 2}
