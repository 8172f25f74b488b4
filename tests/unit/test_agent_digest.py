"""What a constructed agent puts in and reads from etcd around `stopped-G` (a fake of the
cluster calls it makes): a node arrives with a digest of its holdings, and only the leader
reads the other nodes' arrivals."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from elasticpp.agent.actions import ArriveStopped
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.records import GenerationRecord, Members
from elasticpp.store.digest import HoldingsDigest
from tests.agents import SPEC
from tests.agents import dp_plan as _plan
from tests.fakes import Term
from tests.stores import commit_replica_step, commit_step

MEMBERS = ("n0", "n1", "n2", "n3")


class _Cluster:
    keys: Any = None
    skipped_values = 0

    def __init__(self) -> None:
        self.read: list[str] = []
        self.arrived: list[tuple[str, str, Any]] = []
        self.leader_cached = False
        self.term: tuple[str | None, int] = ("n0", 1)  # the leader and its key's revision

    def cache_for_leader(self, on: bool) -> None:
        self.leader_cached = on

    def sync_cache(self) -> None:
        pass

    def etcd_requests(self) -> dict[str, int]:
        return {}

    def agent_members(self, *, cached: bool = False) -> Members:
        self.read.append("every member")
        return Members({n: {"address": f"{n}:1", "incarnation": "i"} for n in MEMBERS}, 1)

    def member_records(self, nodes: Any) -> dict[str, dict[str, Any]]:
        self.read += [f"member {n}" for n in sorted(nodes)]
        return {n: {"address": f"{n}:1", "incarnation": "i"} for n in nodes if n in MEMBERS}

    def read_generation(self, *, cached: bool = False) -> tuple[GenerationRecord | None, int]:
        return GenerationRecord(3, _plan(3).to_dict(), "n0", time.time()), 5

    def leader(self, *, cached: bool = False) -> str | None:
        return "n0"

    def leader_term(self, *, cached: bool = False) -> tuple[str | None, int]:
        return self.term

    def barrier_state(self, name: str, *, cached: bool = False) -> tuple[dict[str, Any], int]:
        self.read.append(name)
        return {}, 1

    def read_safe(self, *, cached: bool = False) -> tuple[None, int]:
        return None, 0

    def arrive(
        self, barrier: str, node_id: str, value: Any = None, *, lease_id: int | None = None
    ) -> None:
        self.arrived.append((barrier, node_id, value))

    # The client's objects (arrivals, commits, health) are this one fake.
    @property
    def arrivals(self) -> _Cluster:
        return self

    @property
    def commits(self) -> _Cluster:
        return self

    @property
    def health(self) -> _Cluster:
        return self


def _agent(tmp_path: Path) -> tuple[Agent, _Cluster]:
    cluster = _Cluster()
    agent = Agent(
        AgentConfig("n1", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path),
        SPEC,
        cluster=cluster,  # type: ignore[arg-type]
    )
    return agent, cluster


def test_only_the_leader_reads_the_nodes_arrivals(tmp_path: Path) -> None:
    """Every agent read every node's holdings at stopped-G once a second and on every
    barrier event: N x N x ~100 KiB per second at a transition; and every node's started-G
    and failed-G arrival reached every node (N² watch events a transition)."""
    agent, cluster = _agent(tmp_path)
    agent.refresh_view()
    assert not cluster.leader_cached
    assert not {"stopped-3", "started-3", "failed-3"} & set(cluster.read)
    assert "resume-3" in cluster.read
    agent.leader.begin_term(Term("n1"), None)  # this node leads
    cluster.read.clear()
    agent.refresh_view()
    assert {"stopped-3", "started-3", "failed-3", "resume-3"} <= set(cluster.read)
    assert cluster.leader_cached


def test_only_the_leader_reads_every_member(tmp_path: Path) -> None:
    """Every agent cached every member key: each registration (N of them when a job starts)
    and each drain reached every node, N² watch events. A follower reads its own record and
    the leader's, the leader's again only when the leader's term changes."""
    agent, cluster = _agent(tmp_path)  # n1, following n0
    agent.refresh_view()
    assert "every member" not in cluster.read
    assert [r for r in cluster.read if r.startswith("member ")] == ["member n1", "member n0"]
    assert (
        sorted(agent.view.state.members) == ["n0", "n1"] and not agent.view.state.members_complete
    )
    first = agent.view.state.members
    cluster.read.clear()
    agent.refresh_view()
    assert [r for r in cluster.read if r.startswith("member ")] == ["member n1"]  # own: cached
    assert agent.view.state.members is first  # unchanged: the same object
    cluster.term = ("n0", 9)  # n0 elected again (restarted): its record is read again
    cluster.read.clear()
    agent.refresh_view()
    assert [r for r in cluster.read if r.startswith("member ")] == ["member n1", "member n0"]
    # What a follower says of the job's members: its generation's nodes.
    assert sorted(agent.view.summary().members) == sorted(agent.view.state.record.planned_nodes)
    # Its fetch sources and replication peers: read by key once a generation.
    cluster.read.clear()
    assert sorted(agent.view.member_records(["n2", "n3", "n9"])) == ["n2", "n3"]
    assert sorted(agent.view.member_records(["n2", "n3"])) == ["n2", "n3"]
    assert cluster.read == ["member n2", "member n3", "member n9"]
    agent.leader.begin_term(Term("n1"), None)  # this node leads: every member, cached
    cluster.read.clear()
    agent.refresh_view()
    assert "every member" in cluster.read
    assert not [r for r in cluster.read if r.startswith("member ")]
    assert sorted(agent.view.state.members) == list(MEMBERS) and agent.view.state.members_complete
    assert sorted(agent.view.summary().members) == list(MEMBERS)
    cluster.read.clear()
    assert sorted(agent.view.member_records(["n2", "n3"])) == ["n2", "n3"]
    assert cluster.read == []  # the leader's view holds them


def test_a_node_arrives_at_stopped_with_a_digest_of_what_it_holds(tmp_path: Path) -> None:
    """The arrival carried every piece name, size and sha256 the node held (105-301 KiB at
    llama-70b/7b shapes): at 2,048 nodes the prefix was 212-603 MiB."""
    agent, cluster = _agent(tmp_path)
    for step in (4, 5):
        commit_step(agent.store, step, generation=3)
        commit_replica_step(agent.store, "n0", step)
    agent.durability.state.next_step_committed = 6
    agent.executor.run([ArriveStopped(3, 12.5)])
    [(barrier, node, value)] = cluster.arrived
    assert (barrier, node, value["next_step"], value["at"]) == ("stopped-3", "n1", 6, 12.5)
    assert "holdings" not in value and len(json.dumps(value)) < 400
    digest = HoldingsDigest.from_dict(value["digest"])
    assert digest.address == agent.address
    steps = sorted(s for g in digest.groups for s in g.step_numbers())
    assert steps == [4, 4, 5, 5]  # its own and its replicas of n0's
