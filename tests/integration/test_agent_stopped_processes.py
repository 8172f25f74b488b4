"""Stopped processes under a real agent (real etcd, real agent and worker processes): a
worker template frozen with SIGSTOP, which can no longer reap the workers it forked, must
not set its node aside, and a stopped worker or template must not outlive its agent's stop.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster.client import ClusterClient
from elasticpp.proctree import TEMPLATE_MODULE, children, descendants
from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc

STOP_TIMEOUT_S = 6
SPEC: dict[str, Any] = {
    "name": "stopped",
    "model": "tiny",
    "global_batch": 8,
    "micro_batch": 2,
    "steps": 100_000,  # trains for as long as the test needs
    "seed": 4,
    "min_nodes": 1,
    "max_nodes": 2,
    "lease_ttl_s": 3,
    "join_settle_s": 0.5,
    "hang_timeout_s": 20,
    "stop_timeout_s": STOP_TIMEOUT_S,
    "ready_timeout_s": 60,
    "quarantine_s": 600,  # set aside for the rest of the test
}
FROZEN = "node-1"


def _cluster(tmp_path: Path, nodes: int) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path / "job", {**SPEC, "max_nodes": nodes}, nodes=nodes, slots=1)
    try:
        yield lc
    finally:
        lc.close()  # `no_orphans` (tests/conftest.py) then fails the test on any survivor


@pytest.fixture
def two_nodes(tmp_path: Path, no_orphans: None) -> Iterator[LocalCluster]:
    yield from _cluster(tmp_path, 2)


@pytest.fixture
def one_node(tmp_path: Path, no_orphans: None) -> Iterator[LocalCluster]:
    yield from _cluster(tmp_path, 1)


def _status(lc: LocalCluster, node_id: str) -> agent_pb2.GetStatusResponse:
    with grpc.insecure_channel(lc.node(node_id).address) as ch:
        return agent_pb2_grpc.AgentServiceStub(ch).GetStatus(
            agent_pb2.GetStatusRequest(), timeout=10
        )


def _running(lc: LocalCluster, node_id: str) -> list[int]:
    try:
        status = _status(lc, node_id)
    except grpc.RpcError:
        return []  # not listening yet
    return [w.pid for w in status.workers if w.state == "running"]


def _template(agent_pid: int) -> int | None:
    """The agent's worker template: its child that runs elasticpp.train.worker.forkserver."""
    for pid in children(agent_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if TEMPLATE_MODULE in cmdline.split(b"\0"):
            return pid
    return None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent, start time) of `pid`, read here (not with the code under test)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def _parent(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[1]


def _left(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (a zombie holds nothing: it is not counted)."""
    return [p for p in pids if (_stat(p) or ("Z", 0, 0))[0] != "Z"]


def _named(pids: list[int]) -> dict[int, int]:
    """pid -> start time, of those of `pids` that are there (a zombie too): a pid and its
    start time name one process, where a pid alone is reused."""
    stats = {p: _stat(p) for p in pids}
    return {p: s[2] for p, s in stats.items() if s is not None}


def _still_there(named: dict[int, int]) -> list[int]:
    """Those of the processes `named` that are still there, zombies too: a zombie left
    behind is a process whose exit nobody read."""
    return [p for p, ticks in named.items() if _named([p]).get(p) == ticks]


def _training_forked_worker(lc: LocalCluster, node_id: str) -> tuple[int, int]:
    """(the node's template, its running worker), once the worker runs and is forked."""
    agent = lc.node(node_id).proc
    assert agent is not None
    found: dict[str, int] = {}

    def ready() -> bool:
        template, running = _template(agent.pid), _running(lc, node_id)
        if template is None or len(running) != 1 or _parent(running[0]) != template:
            return False
        found.update(template=template, worker=running[0])
        return True

    lc.wait_for(ready, 90, f"{node_id}'s worker to train, forked from its template")
    return found["template"], found["worker"]


def _sigterm_leaves_nothing(lc: LocalCluster, node_id: str, also: dict[int, int]) -> None:
    """SIGTERM of the node's agent: within stop_timeout_s + 5 s no process of its tree is
    left (`also`: processes of the tree named earlier, `_named`)."""
    agent = lc.node(node_id).proc
    assert agent is not None
    tree = {**also, **_named([agent.pid, *descendants(agent.pid)])}
    os.kill(agent.pid, signal.SIGTERM)
    began = time.monotonic()
    lc.wait_for(
        lambda: not _still_there(tree),
        STOP_TIMEOUT_S + 5,
        f"{node_id}'s processes to go after SIGTERM of its agent (left: {_still_there(tree)})",
    )
    assert agent.wait(timeout=5) == 0
    assert time.monotonic() - began <= STOP_TIMEOUT_S + 5


@pytest.mark.timeout(200)
def test_a_frozen_worker_template_does_not_set_its_node_aside_and_dies_with_its_agent(
    two_nodes: LocalCluster,
) -> None:
    lc = two_nodes
    lc.start()

    def both_train() -> bool:
        # One generation with a rank on each node (the first plan may hold one node only).
        try:
            a, b = _status(lc, "node-0"), _status(lc, FROZEN)
        except grpc.RpcError:
            return False  # not listening yet
        return a.generation == b.generation and all(
            any(w.state == "running" and w.last_step >= 0 for w in s.workers) for s in (a, b)
        )

    lc.wait_for(both_train, 90, "both nodes training")
    template, worker = _training_forked_worker(lc, FROZEN)
    frozen = _named([template, worker])
    # The template can no longer reap what it forked: a killed worker stays a zombie.
    os.kill(template, signal.SIGSTOP)
    with ClusterClient([lc.etcd.endpoint], SPEC["name"]) as c:
        record, _ = c.read_generation()
    assert record is not None
    frozen_at = record.generation
    # A failure elsewhere: every node stops its old workers, the frozen template's included.
    [victim] = _running(lc, "node-0")
    os.kill(victim, signal.SIGKILL)

    def trains_after(generation: int) -> bool:
        status = _status(lc, FROZEN)
        return status.generation > generation and any(
            w.state == "running" and w.last_step >= 0 and _left([w.pid]) for w in status.workers
        )

    # Its killed worker is a zombie the template cannot reap, and counts as gone.
    lc.wait_for(lambda: trains_after(frozen_at), 60, f"{FROZEN} to train again")
    # The template does not answer its pings: it is killed and replaced, and what it forked
    # (zombies included) is reaped by the agent, which adopted them.
    agent = lc.node(FROZEN).proc
    assert agent is not None
    lc.wait_for(
        lambda: not _still_there(frozen) and _template(agent.pid) not in (None, template),
        60,
        f"{FROZEN}'s frozen template to be replaced and reaped",
    )
    replaced_at = _status(lc, FROZEN).generation
    # The ranks it took with it run again (forked from the new template, or exec'd).
    lc.wait_for(lambda: trains_after(replaced_at - 1), 60, f"{FROZEN} to train after that")
    with ClusterClient([lc.etcd.endpoint], SPEC["name"]) as c:
        assert FROZEN not in c.health.quarantined()
    _sigterm_leaves_nothing(lc, FROZEN, frozen)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stopped", ["worker", "worker and template"])
def test_a_stopped_training_worker_does_not_outlive_its_agents_stop(
    one_node: LocalCluster, stopped: str
) -> None:
    lc = one_node
    lc.start()
    template, worker = _training_forked_worker(lc, "node-0")
    named = _named([template, worker])
    os.kill(worker, signal.SIGSTOP)  # stopped mid-step: SIGTERM alone cannot end it
    if stopped == "worker and template":  # all but the agent (a debugger, a freezer)
        os.kill(template, signal.SIGSTOP)
    _sigterm_leaves_nothing(lc, "node-0", named)
