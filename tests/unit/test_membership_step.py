"""The membership's rules (elasticpp.agent.membership.step): who may join a job by version,
and when another agent holds this node's id."""

from __future__ import annotations

import pytest

from elasticpp.agent.membership.step import id_conflict, member_info, version_refusal


@pytest.mark.parametrize(
    ("leader", "theirs"),
    [(None, "9.9"), ("n0", "9.9"), ("n1", None), ("n1", 3), ("n1", "1.0")],
    ids=["no leader", "this node leads", "no version", "not a string", "the same"],
)
def test_a_node_joins_unless_the_leader_names_another_version(
    leader: str | None, theirs: object
) -> None:
    assert version_refusal("j", "n0", leader, theirs, "1.0") is None


def test_another_version_is_refused_naming_both_and_the_leader_cut_short() -> None:
    why = version_refusal("j", "n0", "n1", "2.0" + "x" * 100, "1.0")
    assert why is not None
    assert "'j' runs elasticpp 2.0" in why and "(its leader n1)" in why
    assert "this agent is elasticpp 1.0" in why and "x" * 37 in why and "x" * 38 not in why


def test_another_incarnation_under_this_nodes_id_is_a_conflict() -> None:
    mine = {"n0": {"incarnation": "aaa"}}
    assert id_conflict(None, mine, "n0", "aaa") is None
    assert id_conflict(None, {}, "n0", "aaa") is None  # not read yet: no conflict
    why = id_conflict(None, {"n0": {"incarnation": "bbb"}}, "n0", "aaa")
    assert why is not None and "incarnation bbb" in why and "this agent is aaa" in why
    assert id_conflict("the keeper found it", mine, "n0", "aaa") == "the keeper found it"


def test_the_member_record_names_what_peers_need() -> None:
    info = member_info("h:1", 8, True, "aaa", 42, "1.0")
    assert info == {
        "address": "h:1",
        "slots": 8,
        "draining": True,
        "incarnation": "aaa",
        "pid": 42,
        "version": "1.0",
    }
