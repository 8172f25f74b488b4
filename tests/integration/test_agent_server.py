"""The agent's servers (elasticpp.agent.server) on real gRPC: the control socket is the
agent's own, a path that holds anything else is refused and left as it was, and the
servers are gone once the agent stops."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.errors import ConfigError
from tests.agents import SPEC


def _agent(tmp_path: Path, sock: Path) -> Agent:
    cfg = AgentConfig(
        "n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path / "state", control_socket=sock
    )
    return Agent(cfg, SPEC)


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def test_a_control_socket_path_that_is_no_socket_is_refused_and_left_as_it_was(
    tmp_path: Path,
) -> None:
    """Once, the refusal was followed by the agent's shutdown unlinking the path it had
    refused: an operator's file given by mistake was deleted."""
    path = tmp_path / "ctl.sock"
    path.write_text("an operator's file\n")
    agent = _agent(tmp_path, path)
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        agent.serve()
    agent.shutdown()
    assert path.read_text() == "an operator's file\n"


def test_a_stale_control_socket_is_taken_over_served_and_gone_after_the_stop(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ctl.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # what a crashed agent left
    stale.close()
    agent = _agent(tmp_path, path)
    try:
        agent.serve()
        assert path.stat().st_mode & 0o777 == 0o600
        assert _health(f"unix:{path}") == health_pb2.HealthCheckResponse.SERVING
        assert _health(agent.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        agent.shutdown()
    assert not path.exists()
    with pytest.raises(grpc.RpcError):
        _health(agent.address)
