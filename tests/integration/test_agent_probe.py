"""Peer probes on real gRPC: a slow reply is retried within the budget instead of evicting
a live node, a refusal is final at once, NOT_SERVING is told apart from dead, and a node
confirmed dead that answers again is taken back."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from elasticpp.agent import probe
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.agent.probe import ProbeResult
from elasticpp.cluster.records import GenerationRecord
from elasticpp.waiting import wait_until
from tests.agents import SPEC
from tests.fakes import FakeCluster


class _SlowFirstHealth(health_pb2_grpc.HealthServicer):
    """Answers after `delays[i]` seconds on the i-th call (a stalled, then live, process)."""

    def __init__(self, delays: list[float]) -> None:
        self.delays = delays
        self.calls = 0
        self.lock = threading.Lock()

    def Check(self, request: Any, context: Any) -> Any:
        with self.lock:
            delay = self.delays[min(self.calls, len(self.delays) - 1)]
            self.calls += 1
        time.sleep(delay)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _serve(servicer: _SlowFirstHealth) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture
def slow_once() -> Iterator[tuple[str, _SlowFirstHealth]]:
    servicer = _SlowFirstHealth([0.7, 0.0])
    for address in _serve(servicer):
        yield address, servicer


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_reply_slower_than_one_attempt_is_retried_not_taken_for_death(
    slow_once: tuple[str, _SlowFirstHealth],
) -> None:
    address, servicer = slow_once
    assert probe.answers(address, timeout_s=0.3, budget_s=1.5)
    assert servicer.calls >= 2


class _Refusing(health_pb2_grpc.HealthServicer):
    """A server that answers every health check UNAVAILABLE (a process going away)."""

    def __init__(self) -> None:
        self.calls = 0

    def Check(self, request: Any, context: Any) -> Any:
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "going away")


def test_a_closed_port_is_dead() -> None:
    assert probe.check(_closed_port(), timeout_s=0.5, budget_s=5.0) is ProbeResult.DEAD


def test_a_refusal_is_final_at_once_not_retried_until_the_budget() -> None:
    servicer = _Refusing()
    for address in _serve(servicer):  # type: ignore[arg-type]
        assert probe.check(address, timeout_s=0.5, budget_s=5.0) is ProbeResult.DEAD
    assert servicer.calls == 1


def test_a_process_that_never_answers_is_silent_when_the_budget_is_spent() -> None:
    servicer = _SlowFirstHealth([3.0])
    now = [0.0]

    def clock() -> float:  # every look at the clock finds 0.25 s more gone
        now[0] += 0.25
        return now[0]

    for address in _serve(servicer):
        # Attempts of 0.2 s against a budget of 1 s on the injected clock: the probe gives
        # up when that clock says the budget is spent, whatever the machine's load.
        result = probe.check(address, timeout_s=0.2, budget_s=1.0, clock=clock)
        assert result is ProbeResult.SILENT
    assert 1 <= servicer.calls <= 4


def test_a_process_that_answers_not_serving_is_alive_but_not_healthy() -> None:
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    for address in _serve(servicer):  # type: ignore[arg-type]
        assert probe.check(address) is ProbeResult.NOT_SERVING
        assert probe.answers(address)  # alive: never declared dead for it
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe.check(address) is ProbeResult.SERVING


def test_a_probe_that_names_the_node_finds_another_agent_at_its_address_dead() -> None:
    """The address of a lost node may come to another agent (a pod IP given to a new pod, a
    port reused on the host) or to the same node restarted: asked by name, the process there
    does not answer for the incarnation looked for, and that one is dead, not alive."""
    servicer = health.HealthServicer()
    here = probe.node_service("n1", "inc-b")
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(here, health_pb2.HealthCheckResponse.SERVING)
    for address in _serve(servicer):  # type: ignore[arg-type]
        assert probe.check(address, service=here) is ProbeResult.SERVING
        assert probe.check(address) is ProbeResult.SERVING  # whoever is there
        gone = probe.node_service("n1", "inc-a")  # the node's earlier incarnation
        assert probe.check(address, service=gone) is ProbeResult.DEAD
        other = probe.node_service("n7", "inc-c")  # a lost node whose address this is now
        assert probe.check(address, service=other) is ProbeResult.DEAD
        servicer.set(here, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe.check(address, service=here) is ProbeResult.NOT_SERVING


def test_an_agent_answers_for_itself_by_name_from_its_start(tmp_path: Path) -> None:
    """NOT_SERVING by name from the server's start (a probe before it joined must not find
    it dead), SERVING once its loop runs; the whole server's status says the same."""
    agent = Agent(AgentConfig("n3", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC)
    name = probe.node_service("n3", agent.incarnation)
    status = health_pb2.HealthCheckResponse
    agent.control.set_health(status.NOT_SERVING)
    for address in _serve(agent.health_service):  # type: ignore[arg-type]
        assert probe.check(address, service=name) is ProbeResult.NOT_SERVING
        agent.control.set_health(status.SERVING)
        assert probe.check(address, service=name) is ProbeResult.SERVING
        assert probe.check(address) is ProbeResult.SERVING


def test_a_follower_deposes_a_leader_whose_loop_stalled(tmp_path: Path) -> None:
    servicer = health.HealthServicer()
    for service in ("", probe.node_service("n0", "a")):  # as the agent says (_set_health)
        servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)  # a wedged loop
    deposed: list[str] = []

    class _Cluster(FakeCluster):
        def depose(self, node_id: str) -> bool:
            deposed.append(node_id)
            return True

    agent = Agent(
        AgentConfig("n1", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC, cluster=_Cluster()
    )
    for address in _serve(servicer):  # type: ignore[arg-type]
        agent.view.state.members = {"n0": {"address": address, "incarnation": "a"}}
        agent.view.state.record = GenerationRecord(2, {}, "n0", time.time())
        agent.view.state.leader = "n0"
        agent.follower.state.reported = 2  # this node reported generation 2 failed
        agent.liveness.state.suspect_since = {2: time.monotonic() - 10}
        agent.watch_leader()
    assert deposed == ["n0"]
    assert agent.liveness.state.dead == {}  # alive: deposed, not declared dead
    agent.liveness.close()


def test_a_node_confirmed_dead_that_answers_again_is_no_longer_dead(
    tmp_path: Path, slow_once: tuple[str, _SlowFirstHealth]
) -> None:
    address, _ = slow_once
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC)
    agent.view.state.members = {
        "n1": {"address": address, "incarnation": "a"},
        "n2": {"address": _closed_port(), "incarnation": "b"},
    }
    agent.liveness.state.dead = {"n1": "a", "n2": "b"}
    agent.liveness.recheck_dead()  # the probes start; their verdicts come with later cycles

    def answered() -> bool:
        agent.liveness.probes_done()
        return not agent.liveness.probes()

    assert wait_until(answered, 10, interval_s=0.01)
    # n1 answered (after one slow reply); n2 is gone
    assert agent.liveness.state.dead == {"n2": "b"}
    agent.liveness.close()


def _health_server(port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, bound


def test_probes_with_kept_channels_reuse_one_channel_per_peer() -> None:
    channels = probe.ProbeChannels(size=2)
    server, port = _health_server()
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(3):
            assert probe.check(address, channels=channels) is ProbeResult.SERVING
        kept = channels.get(address)
        assert channels.get(address) is kept
        channels.get("127.0.0.1:1"), channels.get("127.0.0.1:2")  # the least recent goes
        assert channels.get(address) is not kept
    finally:
        server.stop(0)
        channels.close()


def test_a_peer_back_at_its_address_answers_though_its_kept_channel_saw_it_go() -> None:
    """The kept channel saw the connection refused and waits out a reconnect backoff; the
    peer is back meanwhile. The probe retries on a new channel: SERVING, not DEAD."""
    channels = probe.ProbeChannels()
    server, port = _health_server()
    address = f"127.0.0.1:{port}"
    try:
        assert probe.check(address, channels=channels) is ProbeResult.SERVING
        server.stop(0).wait()
        assert probe.check(address, channels=channels, budget_s=2.0) is ProbeResult.DEAD
        kept = channels.get(address)
        _ = probe.check(address, channels=channels, budget_s=2.0)  # refused again: backoff
        server, again = _health_server(port)
        assert again == port
        assert probe.check(address, channels=channels, budget_s=2.0) is ProbeResult.SERVING
        assert channels.get(address) is not kept
    finally:
        server.stop(0)
        channels.close()
