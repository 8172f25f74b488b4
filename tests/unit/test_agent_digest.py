"""What a constructed agent puts in and reads from etcd around `stopped-G` (an in-memory
etcd, the agent's cache included): a node arrives with a digest of its holdings, and only the leader
reads the other nodes' arrivals."""

from __future__ import annotations

import json
import time
from pathlib import Path

from elasticpp.agent.actions import ArriveStopped
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.records import GenerationRecord
from elasticpp.store.digest import HoldingsDigest
from tests.agents import SPEC
from tests.agents import dp_plan as _plan
from tests.fakes import FakeCluster, Term
from tests.stores import commit_replica_step, commit_step

MEMBERS = ("n0", "n1", "n2", "n3")


def _agent(tmp_path: Path) -> tuple[Agent, FakeCluster]:
    """Node n1 of a job of four nodes in generation 3, n0 leading; the cluster an in-memory
    etcd with n1's cache."""
    cluster = FakeCluster(cached_for="n1")
    for node in MEMBERS:
        record = {"format_version": 1, "address": f"{node}:1", "incarnation": "i", "slots": 1}
        cluster.memory.put(cluster.keys.node(node), json.dumps(record))
    record = GenerationRecord(3, _plan(3).to_dict(), "n0", time.time())
    cluster.memory.put(cluster.keys.generation, record.to_json())
    cluster.lead("n0")
    agent = Agent(
        AgentConfig("n1", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC, cluster=cluster
    )
    return agent, cluster


def _read(cluster: FakeCluster) -> list[str]:
    """What was read, from etcd or the cache, by name: "every member", "member <node>", or
    a barrier's name."""
    keys, out = cluster.keys, []
    for key in cluster.memory.read:
        if key == keys.nodes_prefix:
            out.append("every member")
        elif key.startswith(keys.nodes_prefix):
            out.append(f"member {key.removeprefix(keys.nodes_prefix)}")
        elif key.startswith(keys.barriers_prefix):
            out.append(key.removeprefix(keys.barriers_prefix).rstrip("/"))
    return out


def test_only_the_leader_reads_the_nodes_arrivals(tmp_path: Path) -> None:
    """Every agent read every node's holdings at stopped-G once a second and on every
    barrier event: N x N x ~100 KiB per second at a transition; and every node's started-G
    and failed-G arrival reached every node (N² watch events a transition)."""
    agent, cluster = _agent(tmp_path)
    agent.refresh_view()
    assert cluster.cache is not None and not cluster.cache.leader
    assert not {"stopped-3", "started-3", "failed-3"} & set(_read(cluster))
    assert "resume-3" in _read(cluster)
    agent.leader.begin_term(Term("n1"), None)  # this node leads
    cluster.memory.read.clear()
    agent.refresh_view()
    assert {"stopped-3", "started-3", "failed-3", "resume-3"} <= set(_read(cluster))
    assert cluster.cache.leader


def test_only_the_leader_reads_every_member(tmp_path: Path) -> None:
    """Every agent cached every member key: each registration (N of them when a job starts)
    and each drain reached every node, N² watch events. A follower reads its own record and
    the leader's, the leader's again only when the leader's term changes."""
    agent, cluster = _agent(tmp_path)  # n1, following n0
    agent.refresh_view()
    assert "every member" not in _read(cluster)
    assert [r for r in _read(cluster) if r.startswith("member ")] == ["member n1", "member n0"]
    assert (
        sorted(agent.view.state.members) == ["n0", "n1"] and not agent.view.state.members_complete
    )
    first = agent.view.state.members
    cluster.memory.read.clear()
    agent.refresh_view()
    assert [r for r in _read(cluster) if r.startswith("member ")] == ["member n1"]  # own: cached
    assert agent.view.state.members is first  # unchanged: the same object
    cluster.memory.delete(cluster.keys.leader)
    cluster.lead("n0")  # n0 elected again (restarted): its record is read again
    cluster.memory.read.clear()
    agent.refresh_view()
    assert [r for r in _read(cluster) if r.startswith("member ")] == ["member n1", "member n0"]
    # What a follower says of the job's members: its generation's nodes.
    assert sorted(agent.view.summary().members) == sorted(agent.view.state.record.planned_nodes)
    # Its fetch sources and replication peers: read by key once a generation.
    cluster.memory.read.clear()
    assert sorted(agent.view.member_records(["n2", "n3", "n9"])) == ["n2", "n3"]
    assert sorted(agent.view.member_records(["n2", "n3"])) == ["n2", "n3"]
    assert _read(cluster) == ["member n2", "member n3", "member n9"]
    agent.leader.begin_term(Term("n1"), None)  # this node leads: every member, cached
    cluster.memory.read.clear()
    agent.refresh_view()
    assert "every member" in _read(cluster)
    assert not [r for r in _read(cluster) if r.startswith("member ")]
    assert sorted(agent.view.state.members) == list(MEMBERS) and agent.view.state.members_complete
    assert sorted(agent.view.summary().members) == list(MEMBERS)
    cluster.memory.read.clear()
    assert sorted(agent.view.member_records(["n2", "n3"])) == ["n2", "n3"]
    assert _read(cluster) == []  # the leader's view holds them


def test_a_node_arrives_at_stopped_with_a_digest_of_what_it_holds(tmp_path: Path) -> None:
    """The arrival carried every piece name, size and sha256 the node held (105-301 KiB at
    llama-70b/7b shapes): at 2,048 nodes the prefix was 212-603 MiB."""
    agent, cluster = _agent(tmp_path)
    for step in (4, 5):
        commit_step(agent.store, step, generation=3)
        commit_replica_step(agent.store, "n0", step)
    agent.durability.state.next_step_committed = 6
    agent.executor.run([ArriveStopped(3, 12.5)])
    [(barrier, node, value)] = cluster.arrived()
    assert (barrier, node, value["next_step"], value["at"]) == ("stopped-3", "n1", 6, 12.5)
    assert "holdings" not in value and len(json.dumps(value)) < 400
    digest = HoldingsDigest.from_dict(value["digest"])
    assert digest.address == agent.address
    steps = sorted(s for g in digest.groups for s in g.step_numbers())
    assert steps == [4, 4, 5, 5]  # its own and its replicas of n0's
