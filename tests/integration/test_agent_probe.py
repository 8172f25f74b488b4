"""Peer probes on real gRPC: a slow reply is retried within the budget instead of evicting
a live node, a closed port is final at once, and a node confirmed dead that answers again
is taken back."""

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
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticpp.agent import probe
from elasticpp.agent.node import Agent, AgentConfig
from tests.unit.test_agent_done import SPEC


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


def test_a_closed_port_is_dead_at_once() -> None:
    started = time.monotonic()
    assert not probe.answers(_closed_port(), timeout_s=0.5, budget_s=5.0)
    assert time.monotonic() - started < 2.0  # refused: no retries until the budget


def test_a_process_that_never_answers_is_dead_when_the_budget_is_spent() -> None:
    servicer = _SlowFirstHealth([3.0])
    for address in _serve(servicer):
        started = time.monotonic()
        assert not probe.answers(address, timeout_s=0.2, budget_s=0.6)
        assert time.monotonic() - started < 2.0


def test_a_node_confirmed_dead_that_answers_again_is_no_longer_dead(
    tmp_path: Path, slow_once: tuple[str, _SlowFirstHealth]
) -> None:
    address, _ = slow_once
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC)
    agent._members = {
        "n1": {"address": address, "incarnation": "a"},
        "n2": {"address": _closed_port(), "incarnation": "b"},
    }
    agent._dead = {"n1": "a", "n2": "b"}
    agent._recheck_dead()
    assert agent._dead == {"n2": "b"}  # n1 answered (after one slow reply); n2 is gone
