"""The leader's pure decisions, with plain values and a fake clock."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpp.agent.kernel.decide import (
    ClusterView,
    Replan,
    TransitionError,
    Wait,
    WorkerState,
    candidates,
    decide_replan,
    is_hung,
    live_nodes,
    lost_nodes,
    node_lists,
    transition,
)


def view(members: dict[str, dict[str, object]] | list[str], **kw: object) -> ClusterView:
    if isinstance(members, list):
        members = {m: {} for m in members}
    base: dict[str, object] = {
        "members": members,
        "dead": set(),
        "current_nodes": None,
        "failed": set(),
        "now_s": 100.0,
        "last_join_s": 0.0,
    }
    base.update(kw)
    return ClusterView(**base)  # type: ignore[arg-type]


def decide(v: ClusterView, min_nodes: int = 1, max_nodes: int = 4) -> Replan | Wait | None:
    return decide_replan(v, min_nodes=min_nodes, max_nodes=max_nodes, settle_s=2.0)


def test_first_plan_waits_for_min_nodes_then_for_joins_to_settle() -> None:
    assert isinstance(decide(view(["a"]), min_nodes=2), Wait)
    assert isinstance(decide(view(["a", "b"], last_join_s=99.0), min_nodes=2), Wait)
    d = decide(view(["b", "a"]), min_nodes=2)
    assert d == Replan("initial plan for 2 node(s)", graceful=False, nodes=("a", "b"))


def test_lost_node_replans_at_once_without_waiting_for_settle() -> None:
    d = decide(view(["a", "b"], current_nodes=("a", "b", "c"), last_join_s=99.9))
    assert isinstance(d, Replan) and not d.graceful and d.nodes == ("a", "b")
    assert "c" in d.reason


def test_a_probed_dead_node_counts_as_lost_before_its_lease_lapses() -> None:
    d = decide(view(["a", "b", "c"], current_nodes=("a", "b", "c"), dead={"c"}))
    assert isinstance(d, Replan) and d.nodes == ("a", "b") and not d.graceful


def test_worker_failure_replans_on_the_same_nodes() -> None:
    d = decide(view(["a", "b"], current_nodes=("a", "b"), failed={"b"}))
    assert isinstance(d, Replan) and d.nodes == ("a", "b") and "failure on b" in d.reason


def test_failure_reports_of_nodes_outside_the_generation_are_ignored() -> None:
    assert decide(view(["a", "b"], current_nodes=("a", "b"), failed={"z"})) is None


def test_join_is_graceful_and_waits_for_settle() -> None:
    v = view(["a", "b", "c"], current_nodes=("a", "b"), last_join_s=99.0)
    assert isinstance(decide(v), Wait)
    d = decide(view(["a", "b", "c"], current_nodes=("a", "b"), last_join_s=90.0))
    assert isinstance(d, Replan) and d.graceful and d.nodes == ("a", "b", "c")


def test_join_beyond_max_nodes_changes_nothing() -> None:
    assert decide(view(["a", "b", "c"], current_nodes=("a", "b")), max_nodes=2) is None


def test_drain_is_graceful_and_excludes_the_draining_node() -> None:
    members = {"a": {}, "b": {"draining": True}, "c": {}}
    d = decide(view(members, current_nodes=("a", "b", "c")))
    assert isinstance(d, Replan) and d.graceful and d.nodes == ("a", "c")


def test_a_cordoned_node_is_left_at_a_step_boundary_and_planned_again_once_uncordoned() -> None:
    cordoned = view(["a", "b", "c"], current_nodes=("a", "b", "c"), cordoned={"b"})
    d = decide(cordoned)
    assert isinstance(d, Replan) and d.graceful and d.nodes == ("a", "c")
    assert d.reason == "cordon of b"
    assert "b" not in candidates(cordoned) and "b" in live_nodes(cordoned)  # a spare
    # Once the job runs without it, a cordoned node is no join.
    assert decide(view(["a", "b", "c"], current_nodes=("a", "c"), cordoned={"b"})) is None
    back = decide(view(["a", "b", "c"], current_nodes=("a", "c")))  # uncordoned
    assert isinstance(back, Replan) and back.graceful and back.nodes == ("a", "b", "c")


def test_a_cordon_that_would_go_below_min_nodes_waits_and_says_why() -> None:
    d = decide(view(["a", "b"], current_nodes=("a", "b"), cordoned={"b"}), min_nodes=2)
    assert isinstance(d, Wait) and d.reason == "cannot cordon off b: would go below min_nodes"
    both = view({"a": {}, "b": {"draining": True}, "c": {}}, current_nodes=("a", "b", "c"),
                cordoned={"c"})  # fmt: skip
    d = decide(both, min_nodes=2)
    assert (
        isinstance(d, Wait)
        and d.reason == "cannot drain b or cordon off c: would go below min_nodes"
    )
    d = decide(both, min_nodes=1)
    assert isinstance(d, Replan) and d.reason == "drain of b, cordon of c" and d.nodes == ("a",)


def test_below_min_nodes_after_a_loss_waits() -> None:
    d = decide(view(["a"], current_nodes=("a", "b")), min_nodes=2)
    assert isinstance(d, Wait) and "min_nodes" in d.reason


def test_nothing_to_do_when_stable_or_done() -> None:
    assert decide(view(["a", "b"], current_nodes=("a", "b"))) is None
    assert decide(view(["a"], current_nodes=("a", "b"), job_done=True)) is None


def test_is_hung_uses_the_timeout_and_zero_disables() -> None:
    assert not is_hung(10.0, 14.9, 5.0)
    assert is_hung(10.0, 15.1, 5.0)
    assert not is_hung(0.0, 1e9, 0.0)


def test_worker_transitions_refuse_what_is_not_written_down() -> None:
    assert transition(WorkerState.WARM, WorkerState.STARTING) is WorkerState.STARTING
    assert transition(WorkerState.RUNNING, WorkerState.STOPPING) is WorkerState.STOPPING
    with pytest.raises(TransitionError):
        transition(WorkerState.DONE, WorkerState.RUNNING)
    with pytest.raises(TransitionError):
        transition(WorkerState.WARM, WorkerState.RUNNING)


def test_generation_phases_refuse_a_transition_not_written_down() -> None:
    from elasticpp.agent.kernel.decide import PHASE_TRANSITIONS, Phase, phase_transition

    assert phase_transition(Phase.STOPPING, Phase.MOVING) is Phase.MOVING
    assert phase_transition(Phase.RUNNING, Phase.RUNNING) is Phase.RUNNING
    with pytest.raises(TransitionError, match="from done to running"):
        phase_transition(Phase.DONE, Phase.RUNNING)
    with pytest.raises(TransitionError):
        phase_transition(Phase.STOPPING, Phase.RUNNING)  # ranks start only after moving
    assert set(PHASE_TRANSITIONS) == set(Phase)


def test_every_phase_that_waits_on_others_has_a_deadline_of_at_least_the_hang_timeout() -> None:
    from elasticpp.agent.kernel.decide import Phase, phase_deadline_s

    for phase in (Phase.MOVING, Phase.STARTING):
        deadline = phase_deadline_s(phase, 300.0)
        assert deadline is not None and deadline >= 300.0
        floor = phase_deadline_s(phase, 1.0)
        assert floor is not None and floor >= 60.0  # never under a rendezvous timeout
    assert phase_deadline_s(Phase.RUNNING, 5.0) is None  # hangs are the hang check's


NODE = st.sampled_from([f"n{i}" for i in range(8)])


@settings(max_examples=300, deadline=None)
@given(
    members=st.sets(NODE),
    dead=st.sets(NODE),
    current=st.none() | st.lists(NODE, unique=True),
    restarted=st.sets(NODE),
)
def test_lost_nodes_are_the_generations_nodes_not_live_or_restarted(
    members: set[str], dead: set[str], current: list[str] | None, restarted: set[str]
) -> None:
    # The reference: the generation's nodes minus the live ones (members not found dead),
    # plus those whose agent restarted. lost_nodes computes it without sorting every member
    # (the leader asks every tick, of thousands of members).
    v = view(
        sorted(members),
        dead=dead,
        current_nodes=None if current is None else tuple(current),
        restarted=frozenset(restarted),
    )
    if current is None:
        assert lost_nodes(v) == []
        return
    live = set(live_nodes(v))
    assert lost_nodes(v) == sorted((set(current) - live) | (set(current) & restarted))


@settings(max_examples=300, deadline=None)
@given(
    members=st.sets(NODE),
    draining=st.sets(NODE),
    dead=st.sets(NODE),
    quarantined=st.sets(NODE),
    current=st.none() | st.lists(NODE, unique=True),
    failed=st.sets(NODE),
)
def test_the_leaders_kept_node_lists_decide_as_the_view_itself_does(
    members: set[str],
    draining: set[str],
    dead: set[str],
    quarantined: set[str],
    current: list[str] | None,
    failed: set[str],
) -> None:
    # The leader hands the view the lists it kept (`node_lists`, computed again only when
    # members, dead or quarantined nodes changed); the decision must be the one made from
    # the view's own fields, and the lists the plain reading of those fields.
    v = view(
        {m: {"draining": m in draining} for m in sorted(members)},
        dead=frozenset(dead),
        quarantined=frozenset(quarantined),
        current_nodes=None if current is None else tuple(current),
        failed=failed,
    )
    lists = node_lists(v.members, v.dead, v.quarantined)
    assert list(lists.live) == sorted(members - dead)
    assert list(lists.usable) == sorted(members - dead - draining - quarantined)
    assert candidates(v) == list(lists.usable) and live_nodes(v) == list(lists.live)
    kept = replace(v, lists=lists)
    for min_nodes, max_nodes in ((1, 4), (3, 8), (1, 1)):
        assert decide(kept, min_nodes, max_nodes) == decide(v, min_nodes, max_nodes)
    decision = decide(v, 1, 8)
    if isinstance(decision, Replan) and decision.reason.startswith("drain of "):
        drained = decision.reason.removeprefix("drain of ").split(", ")
        assert drained == sorted(n for n in current or () if n in draining)
