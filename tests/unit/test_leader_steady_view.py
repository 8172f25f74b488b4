"""The leader's steady view costs no per-node work while nothing changes. It ticks 20 times a
second; each tick compared every planned node's registration with the generation record (a
hash of each node's incarnation, twice) and rebuilt a map of every member's incarnation:
at 128 simulated nodes that was half of the leader's tick, O(N) hashes 40 times a second.
Now a restart is looked for again only when the record or the members are new objects (a
cached read that did not change is the same object), and a tag is hashed once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster import records
from elasticpp.cluster.records import GenerationRecord, incarnation_tag, node_fields
from tests.agents import SPEC
from tests.agents import pp_plan as _plan
from tests.fakes import Term


def _leader(tmp_path: Path) -> Agent:
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC)
    plan = _plan(3).to_dict()
    fields = node_fields(plan, ["n0", "n1"], {n: f"inc-{n}" for n in ("n0", "n1")})
    agent.view.state.record = GenerationRecord(3, plan, "n0", time.time(), extra=fields)
    agent.view.state.members = {n: {"incarnation": f"inc-{n}"} for n in ("n0", "n1")}
    agent.view.state.etcd_ok = True
    agent.leader.begin_term(Term(), None)
    return agent


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the record's restart checks."""
    calls = [0]
    original = GenerationRecord.reregistered

    def reregistered(self: GenerationRecord, members: Any) -> set[str]:
        calls[0] += 1
        return original(self, members)

    monkeypatch.setattr(GenerationRecord, "reregistered", reregistered)
    return calls


def test_an_unchanged_view_is_not_checked_for_restarts_again(
    tmp_path: Path, counted: list[int]
) -> None:
    agent = _leader(tmp_path)
    try:
        for _ in range(5):
            assert agent.leader.cluster_view().restarted == frozenset()
        assert counted[0] == 1
    finally:
        agent.liveness.close()


def test_new_members_or_a_new_record_are_checked_again(tmp_path: Path, counted: list[int]) -> None:
    agent = _leader(tmp_path)
    try:
        agent.leader.cluster_view()
        # A new read of the members: n1's agent restarted (a new incarnation).
        agent.view.state.members = {"n0": {"incarnation": "inc-n0"}, "n1": {"incarnation": "inc-x"}}
        assert agent.leader.cluster_view().restarted == {"n1"}
        assert counted[0] == 2
        # A new generation record that planned n1's new incarnation.
        plan = _plan(4).to_dict()
        fields = node_fields(plan, ["n0", "n1"], {"n0": "inc-n0", "n1": "inc-x"})
        agent.view.state.record = GenerationRecord(4, plan, "n0", time.time(), extra=fields)
        assert agent.leader.cluster_view().restarted == frozenset()
        assert counted[0] == 3
    finally:
        agent.liveness.close()


def test_the_quarantine_check_reuses_the_members_incarnations_while_they_are_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = _leader(tmp_path)
    agent.cluster = object()  # type: ignore[assignment]  # nothing is quarantined: unused
    sick = agent.leader.state.sick
    seen: list[dict[str, str]] = []  # the incarnations each health judgement was given
    expire = sick.expire

    def expire_seen(incarnations: dict[str, str], now: float) -> Any:
        seen.append(incarnations)
        return expire(incarnations, now)

    monkeypatch.setattr(sick, "expire", expire_seen)
    try:
        view = agent.leader.cluster_view()
        agent.leader.judge_health(view)
        assert seen[0] == {"n0": "inc-n0", "n1": "inc-n1"}
        agent.leader.judge_health(view)
        assert seen[1] is seen[0]  # not rebuilt
        agent.view.state.members = {"n0": {"incarnation": "inc-n0"}}
        agent.leader.judge_health(agent.leader.cluster_view())
        assert seen[2] == {"n0": "inc-n0"}
    finally:
        agent.liveness.close()


def test_an_incarnation_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    original = records.hashlib.blake2b

    def blake2b(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(records.hashlib, "blake2b", blake2b)
    first = incarnation_tag("inc-hashed-once")
    assert [incarnation_tag("inc-hashed-once") for _ in range(10)] == [first] * 10
    assert calls[0] == 1


def test_the_live_nodes_and_candidates_are_listed_again_only_when_their_inputs_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each leader turn sorted every member and looked at each (~4 ms at 2,048 nodes, the
    largest part of a turn): now the lists are kept while the members are the same object
    and the dead and quarantined nodes the same."""
    from elasticpp.agent.leader import shell as leader_module

    calls = [0]
    original = leader_module.node_lists

    def node_lists(*args: Any) -> Any:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(leader_module, "node_lists", node_lists)
    agent = _leader(tmp_path)
    try:
        for _ in range(5):
            assert agent.leader.cluster_view().lists.live == ("n0", "n1")  # type: ignore[union-attr]
        assert calls[0] == 1
        agent.liveness.state.dead["n1"] = "inc-n1"  # n1 failed its probe, this incarnation
        view = agent.leader.cluster_view()
        assert calls[0] == 2 and view.lists is not None and view.lists.live == ("n0",)
        agent.health.state.quarantines["n0"] = object()  # type: ignore[assignment]
        assert agent.leader.cluster_view().lists.usable == ()  # type: ignore[union-attr]
        assert calls[0] == 3
        agent.view.state.members = {**agent.view.state.members, "n2": {"incarnation": "inc-n2"}}
        assert agent.leader.cluster_view().lists.live == ("n0", "n2")  # type: ignore[union-attr]
        assert calls[0] == 4
    finally:
        agent.liveness.close()
