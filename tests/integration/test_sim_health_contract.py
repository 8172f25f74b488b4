"""The simulated nodes' shared health service (bench/scalesim.SharedServer) against an agent's
own gRPC server: the same probes (elasticpp.agent.probe, over loopback gRPC) get the same
answers from both, for a healthy node, an unhealthy one, another incarnation, and a node
whose server stopped as a crashed node's does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from bench.scalesim import SharedServer, SimAgent, SimWorker, sim_spec
from elasticpp.agent import probe
from elasticpp.agent.node import AgentConfig
from elasticpp.agent.probe import ProbeResult
from elasticpp.agent.server import serve

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(params=["own server", "shared server"])
def agents(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[SimAgent]]:
    """Two agents serving health (not joined to any job), on their own servers or one."""
    shared = SharedServer() if request.param == "shared server" else None
    made: list[SimAgent] = []
    try:
        for name in ("node-a", "node-b"):
            cfg = AgentConfig(name, ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path / name)
            agent = SimAgent(
                cfg,
                sim_spec("j", 2, 1),
                worker_factory=lambda p, e, n: SimWorker(p, e, n),
                health=shared.health if shared is not None else None,
                server_factory=shared.serve if shared is not None else serve,
            )
            agent.serve()
            made.append(agent)
        yield made
    finally:
        for agent in made:
            agent.shutdown()
        if shared is not None:
            shared.stop()


def check(agent: SimAgent, incarnation: str | None = None) -> ProbeResult:
    service = probe.node_service(agent.node_id, incarnation or agent.incarnation)
    return probe.check(agent.address, service=service, budget_s=5.0, timeout_s=2.0)


def test_a_probe_sees_each_nodes_own_health(agents: list[SimAgent]) -> None:
    a, b = agents
    a.control.set_health(SERVING)
    b.control.set_health(NOT_SERVING)
    assert check(a) is ProbeResult.SERVING
    assert check(b) is ProbeResult.NOT_SERVING
    b.control.set_health(SERVING)
    assert check(b) is ProbeResult.SERVING


def test_another_incarnation_at_the_address_is_dead(agents: list[SimAgent]) -> None:
    a, _ = agents
    a.control.set_health(SERVING)
    assert check(a, incarnation="0123456789ab") is ProbeResult.DEAD


def test_a_node_whose_server_stopped_is_dead_and_the_others_live_on(
    agents: list[SimAgent],
) -> None:
    a, b = agents
    a.control.set_health(SERVING)
    b.control.set_health(SERVING)
    assert a.server is not None
    a.server.stop()  # as SimAgent.crash() stops it
    assert check(a) is ProbeResult.DEAD
    assert check(b) is ProbeResult.SERVING
