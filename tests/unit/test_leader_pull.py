"""The leader's resume from holdings digests (elasticpp.agent.leader.resume), as pure steps:
digests arrive at stopped-G, the detail is pulled (an action), the pull's result comes back
as an observation, and the resume is resolved from it. No etcd, no gRPC, no sleeps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from elasticpp.agent.actions import (
    Event,
    PublishResumeWait,
    PullHoldings,
    Reread,
    ResolveResume,
    SetAside,
    WriteResume,
)
from elasticpp.agent.leader.resume import WAIT_REPULL_EVERY_S
from elasticpp.agent.leader.state import PulledHoldings
from elasticpp.agent.leader.step import (
    leader_pull_started,
    leader_resume_resolved,
    leader_resume_wait_published,
    leader_step,
)
from elasticpp.agent.sick import Quarantine
from elasticpp.store.digest import digest_of
from elasticpp.store.holdings import NodeHoldings
from tests.leaders import LEADER_SPEC as SPEC
from tests.leaders import MEMBERS
from tests.leaders import holdings_of as _holdings
from tests.leaders import leader_obs as _obs
from tests.leaders import leader_record as _record
from tests.leaders import leader_state as _state

SPARE = {**MEMBERS, "n2": {"address": "n2:1", "slots": 1, "incarnation": "i-n2"}}
SHORT = replace(SPEC, max_nodes=2)  # n2 is a spare, not a join


def _held(node: str, step: int | None = 8) -> NodeHoldings:
    if step is None:
        return NodeHoldings(node)
    return NodeHoldings.from_dict(_holdings(node, step))


def _arrived(nodes: tuple[str, ...], step: int | None = 8) -> dict[str, Any]:
    return {
        n: {"digest": digest_of(_held(n, step), f"{n}:1").to_dict(), "next_step": 10, "at": 1.0}
        for n in nodes
    }


def test_digests_at_stopped_are_pulled_once_and_the_resume_is_resolved_from_the_detail() -> None:
    state = _state()
    record = _record(2)
    obs = _obs(100.0, record=record, barriers={"stopped-2": _arrived(("n0", "n1"))})
    [pull] = leader_step(state, obs)
    assert isinstance(pull, PullHoldings) and pull.generation == 2
    assert sorted(pull.digests) == ["n0", "n1"] and pull.live_nodes == ("n0", "n1")
    assert pull.known == {} and pull.units == SPEC.model.units
    assert leader_pull_started(state, pull) == []
    assert leader_step(state, replace(obs, now_s=103.0)) == []  # in flight: not asked again
    pulled = PulledHoldings(2, {n: _held(n) for n in ("n0", "n1")}, held=True)
    [resolve] = leader_step(state, replace(obs, now_s=104.0, pulled=pulled))
    assert isinstance(resolve, ResolveResume) and resolve.persist_dir is None
    assert resolve.holdings == pulled.holdings and resolve.held and resolve.disk is None
    [write] = leader_resume_resolved(state, resolve, resolve.disk)
    assert write.value["step"] == 8  # type: ignore[attr-defined]


def test_a_generation_waiting_for_state_pulls_again_and_resumes_once_a_checkpoint_holds_it() -> (
    None
):
    state = _state()
    record = _record(2)
    obs = _obs(100.0, record=record, barriers={"stopped-2": _arrived(("n0", "n1"))})
    [pull] = leader_step(state, obs)
    leader_pull_started(state, pull)
    # The nodes hold step 8 of one unit only (its other copies were lost): nothing resolves.
    partial = {n: NodeHoldings.from_dict(_holdings(n, 8, SPEC.model.units[:1])) for n in MEMBERS}
    pulled = PulledHoldings(2, partial, held=True)
    [resolve] = leader_step(state, replace(obs, now_s=101.0, pulled=pulled))
    [told, wait] = leader_resume_resolved(state, resolve, resolve.disk)
    assert isinstance(told, Event) and "cannot resume" in told.message
    assert isinstance(wait, PublishResumeWait)
    leader_resume_wait_published(state, wait, True)
    # Waiting: the same result is not resolved again (~0.2 s of CPU at 2,048 nodes a turn);
    # the holdings are pulled again WAIT_REPULL_EVERY_S after the wait's first step.
    quiet = replace(obs, now_s=102.0, pulled=pulled)
    assert leader_step(state, quiet) == []
    assert leader_step(state, replace(quiet, now_s=101.9 + WAIT_REPULL_EVERY_S)) == []
    assert state.pull_asked
    assert leader_step(state, replace(quiet, now_s=102.0 + WAIT_REPULL_EVERY_S)) == []
    assert not state.pull_asked
    [repull] = leader_step(state, replace(obs, now_s=102.5 + WAIT_REPULL_EVERY_S))
    assert repull == pull
    leader_pull_started(state, repull)
    # An operator restored a checkpoint into persist_dir: the pull reads it, and it resumes.
    restored = PulledHoldings(2, partial, disk=_held("disk"), held=True)
    [resolve] = leader_step(state, replace(obs, now_s=103.0 + WAIT_REPULL_EVERY_S, pulled=restored))
    [write] = leader_resume_resolved(state, resolve, resolve.disk)
    assert isinstance(write, WriteResume) and write.value["step"] == 8


def test_a_planned_node_that_does_not_answer_the_pull_is_set_aside_once_and_not_resumed() -> None:
    state = _state()
    record = _record(2)
    obs = _obs(100.0, record=record, barriers={"stopped-2": _arrived(("n0", "n1"))})
    [pull] = leader_step(state, obs)
    leader_pull_started(state, pull)
    pulled = PulledHoldings(2, {"n0": _held("n0")}, {"n1": "UNAVAILABLE: refused"}, held=True)
    [aside] = leader_step(state, replace(obs, now_s=101.0, pulled=pulled))
    assert isinstance(aside, SetAside)
    [quarantine] = aside.decisions
    assert isinstance(quarantine, Quarantine) and quarantine.entry.node == "n1"
    assert "did not answer the holdings pull of generation 2" in quarantine.entry.reason
    assert leader_step(state, replace(obs, now_s=102.0, pulled=pulled)) == []  # once


def test_a_spare_that_does_not_answer_is_set_aside_and_the_others_resume() -> None:
    state = _state()
    record = _record(2)
    stopped = {"stopped-2": _arrived(("n0", "n1", "n2"))}
    obs = _obs(100.0, record=record, members=SPARE, barriers=stopped, spec=SHORT)
    [pull] = leader_step(state, obs)
    leader_pull_started(state, pull)
    holdings = {n: _held(n) for n in ("n0", "n1")}
    pulled = PulledHoldings(2, holdings, {"n2": "DEADLINE_EXCEEDED"}, held=True)
    aside, resolve = leader_step(state, replace(obs, now_s=101.0, pulled=pulled))
    assert isinstance(aside, SetAside) and isinstance(resolve, ResolveResume)
    assert resolve.live_nodes == ("n0", "n1") and sorted(resolve.holdings) == ["n0", "n1"]


def test_a_failed_or_cut_short_pull_is_asked_again_and_a_newer_generation_rereads() -> None:
    state = _state()
    record = _record(2)
    obs = _obs(100.0, record=record, barriers={"stopped-2": _arrived(("n0", "n1"))})
    [pull] = leader_step(state, obs)
    for result, now_s in (
        (PulledHoldings(2, error="OSError: disk"), 100.5),
        (PulledHoldings(2, not_asked=("n1",)), 103.0),
    ):
        leader_pull_started(state, pull)
        [told] = leader_step(state, replace(obs, now_s=now_s, pulled=result))
        assert isinstance(told, Event) and "holdings pull" in told.message
        assert not state.pull_asked
    assert leader_step(state, replace(obs, now_s=104.0)) == []  # 2 s after the last ask
    [again] = leader_step(state, replace(obs, now_s=105.5))
    assert again == pull
    leader_pull_started(state, again)
    moved = PulledHoldings(2, moved_on={"n1": "generation 2 is older than 3"})
    assert leader_step(state, replace(obs, now_s=106.0, pulled=moved)) == [Reread()]
    # A result of another generation is not this one's.
    leader_pull_started(state, again)
    other = PulledHoldings(1, {n: _held(n) for n in ("n0", "n1")})
    assert leader_step(state, replace(obs, now_s=107.0, pulled=other)) == []


def test_nothing_held_needs_no_pull_and_the_previous_releases_full_form_is_read() -> None:
    state = _state()
    record = _record(1)
    empty = _arrived(("n0", "n1"), step=None)
    [resolve] = leader_step(state, _obs(100.0, record=record, barriers={"stopped-1": empty}))
    assert isinstance(resolve, ResolveResume) and resolve.holdings == {}
    # One node of the previous release arrives with its holdings in full: read, not pulled.
    state = _state()
    mixed = {**_arrived(("n0",)), "n1": {"holdings": _holdings("n1", 8), "next_step": 9}}
    [pull] = leader_step(state, _obs(100.0, record=record, barriers={"stopped-1": mixed}))
    assert isinstance(pull, PullHoldings)
    assert sorted(pull.digests) == ["n0"] and sorted(pull.known) == ["n1"]


def test_an_unreadable_arrival_is_said_once_and_counts_as_missing() -> None:
    state = _state()
    record = _record(2)
    bad = {**_arrived(("n0",)), "n1": {"digest": {"format": 1, "address": "x"}, "at": 1.0}}
    obs = _obs(100.0, record=record, barriers={"stopped-2": bad})
    [told] = leader_step(state, obs)
    assert isinstance(told, Event) and "unreadable stopped arrival" in told.message
    assert "n1: holdings digest: address must be HOST:PORT" in told.message
    assert leader_step(state, replace(obs, now_s=101.0)) == []
    assert not any(
        isinstance(a, (PullHoldings, ResolveResume))
        for a in leader_step(state, replace(obs, now_s=102.5))
    )


def test_each_stopped_arrival_is_parsed_once_while_its_value_is_the_same(monkeypatch) -> None:
    """While a generation stops, the leader looks at every arrival at each of its turns;
    parsing every digest each time was O(N) a turn. A value is parsed again only when it is
    another object (a new revision of its key), and a new generation starts afresh."""
    from elasticpp.store import digest as digest_module

    calls: list[str] = []
    original = digest_module.HoldingsDigest.from_dict.__func__  # type: ignore[attr-defined]

    def from_dict(cls: Any, data: Any) -> Any:
        calls.append(str(data.get("address", "")))
        return original(cls, data)

    monkeypatch.setattr(digest_module.HoldingsDigest, "from_dict", classmethod(from_dict))
    state = _state()
    record = _record(2)
    arrived = _arrived(("n0",))  # n1 not yet: the leader waits
    for now in (100.0, 100.1, 100.2):
        assert not any(
            isinstance(a, PullHoldings)
            for a in leader_step(state, _obs(now, record=record, barriers={"stopped-2": arrived}))
        )
    assert len(calls) == 1
    # n1 arrives: only its value is new; n0's is the same object.
    arrived = {**arrived, **_arrived(("n1",))}
    [pull] = leader_step(state, _obs(100.3, record=record, barriers={"stopped-2": arrived}))
    assert isinstance(pull, PullHoldings) and sorted(pull.digests) == ["n0", "n1"]
    assert len(calls) == 2
    # n0 wrote its arrival again (another revision, another object): parsed again.
    state2 = _state()
    again = {**arrived, "n0": dict(arrived["n0"])}
    leader_step(state2, _obs(100.0, record=record, barriers={"stopped-2": again}))
    leader_step(state2, _obs(100.1, record=record, barriers={"stopped-2": arrived}))
    assert len(calls) == 2 + 2 + 1
    # A new generation's arrivals are parsed afresh, even the same objects.
    leader_step(state2, _obs(100.2, record=_record(3), barriers={"stopped-3": arrived}))
    assert len(calls) == 5 + 2
