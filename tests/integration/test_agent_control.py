"""The agent's control surface on real gRPC: health follows the decision loop's heartbeat,
and event streams and piece transfers have limits of their own, so neither can take the
threads that health checks need."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from elasticpp.agent.control.shell import Control, ControlConfig
from elasticpp.agent.kernel.clock import LoopHeartbeat, SystemClock
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.summaries import (
    AgentStatus,
    FollowerSummary,
    HealthSummary,
    ProgressSummary,
    RecoveryStatus,
    ViewSummary,
    WorkerStatus,
)
from elasticpp.agent.service import AgentServicer
from elasticpp.plan import Coord
from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
from elasticpp.waiting import wait_until


def _health(address: str) -> str:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


@pytest.fixture
def server() -> Iterator[tuple[grpc.Server, str]]:
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    port = srv.add_insecure_port("127.0.0.1:0")
    yield srv, f"127.0.0.1:{port}"
    srv.stop(grace=None)


class _Pool:
    """The control part's pool port, with no workers."""

    def counts(self) -> dict[str, int]:
        return {}

    def any_alive(self) -> bool:
        return False

    def has_spares(self) -> bool:
        return False

    def release_spares(self) -> None:
        pass

    def seen(self) -> tuple[()]:
        return ()


@pytest.mark.timeout(60)
def test_health_is_not_serving_while_the_decision_loop_is_stalled(
    server: tuple[grpc.Server, str],
) -> None:
    """The control part's loop watchdog, on its ports: a real health service on a real
    server, and the loop's heartbeat on a clock the test moves."""
    srv, address = server
    now = [1000.0]
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    srv.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    heartbeat = LoopHeartbeat(lambda: now[0])
    control = Control(
        ControlConfig("n0", "inc0", "ctl", 10, exit_on_end=False),
        clock=SystemClock(),
        pool=_Pool(),
        health=servicer,
        metrics=AgentMetrics.create("n0", "ctl"),
        heartbeat=heartbeat,
        serving=lambda: True,
        wake=lambda: None,
    )
    heartbeat.busy()
    now[0] += 60.0  # the loop began a tick a minute ago and is still in it
    stop = threading.Event()
    watchdog = threading.Thread(target=control.watch_loop, args=(stop,), daemon=True)
    watchdog.start()
    try:
        assert wait_until(lambda: _health(address) == "NOT_SERVING", 10)
        heartbeat.idle()  # the tick ended: the loop waits for work
        assert wait_until(lambda: _health(address) == "SERVING", 10)
    finally:
        stop.set()
        watchdog.join(timeout=5)


class _Agent:
    """The two calls the control servicer makes, on a quiet agent: `events_since` long-polls
    like the real one and returns nothing (or at once, when `quiet` is set)."""

    def __init__(self) -> None:
        self.quiet = threading.Event()

    def status_snapshot(self) -> AgentStatus:
        return AgentStatus(
            "n0", "ctl", generation=1, leader="n0", phase="running", last_step=3,
            last_loss=1.0, members=("n0",),
        )  # fmt: skip

    def request_drain(self, timeout_s: float) -> tuple[bool, str]:
        return False, "not in this test"

    def since(self, index: int, timeout_s: float) -> tuple[list[Any], int]:
        self.quiet.wait(min(timeout_s, 0.2))
        return [], index


def _servicer(agent: _Agent, **kwargs: Any) -> AgentServicer:
    """The servicer on `agent`'s status and events (no quarantine to lift here)."""
    return AgentServicer(agent, agent, lambda node: (False, "not in this test"), **kwargs)


@pytest.mark.timeout(60)
def test_event_streams_beyond_their_limit_are_refused_and_health_still_answers(
    server: tuple[grpc.Server, str],
) -> None:
    srv, address = server
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(
        _servicer(_Agent(), max_event_streams=2),
        srv,
    )
    srv.start()
    channel = grpc.insecure_channel(address)
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    try:
        streams = [stub.WatchEvents(agent_pb2.WatchEventsRequest()) for _ in range(2)]
        # Streams are admitted as the server gets to them: wait until both hold their slot.
        assert wait_until(lambda: _refused(stub), 10)
        assert _health(address) == "SERVING"
        assert stub.GetStatus(agent_pb2.GetStatusRequest(), timeout=5).last_step == 3
        for s in streams:
            s.cancel()
        assert wait_until(lambda: not _refused(stub), 10)  # a closed stream frees its slot
    finally:
        channel.close()


def _refused(stub: agent_pb2_grpc.AgentServiceStub) -> bool:
    """Whether one more event stream is refused with RESOURCE_EXHAUSTED now."""
    probe = stub.WatchEvents(agent_pb2.WatchEventsRequest(), timeout=0.5)
    try:
        next(probe)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        probe.cancel()
    return False


class _RankZero(_Agent):
    """A status whose interesting numbers are zeros: rank 0 at pp=tp=dp=0, and a first
    recovery that resumed at step 0 from no layout."""

    def status_snapshot(self) -> AgentStatus:
        worker = WorkerStatus(0, 4242, "running", 0, 1, Coord(pp=0, tp=0, dp=0))
        recovery = RecoveryStatus(
            generation=1, reason="initial plan", layout_before="",
            layout_after="pp=1,tp=1,dp=1", resume_step=0, steps_recomputed=0,
            planned_s=0.25, stopped_s=0.5, moved_s=0.75, resumed_s=1.0,
        )  # fmt: skip
        return replace(super().status_snapshot(), workers=(worker,), recoveries=(recovery,))


@pytest.mark.timeout(60)
def test_status_json_prints_numbers_as_numbers_and_every_field(
    server: tuple[grpc.Server, str],
) -> None:
    srv, address = server
    agent_pb2_grpc.add_AgentServiceServicer_to_server(
        _servicer(_RankZero()),
        srv,
    )
    srv.start()
    run = subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "ctl", "--agent", address, "status",
         "--json"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    assert (status["generation"], status["last_step"]) == (1, 3)  # int64: numbers, not "1"
    assert status["ended"] == "" and status["quarantined"] == []  # empty fields are there
    [worker] = status["workers"]
    assert worker == {
        "rank": 0, "local_rank": 0, "pp": 0, "tp": 0, "dp": 0, "pid": 4242,
        "state": "running", "last_step": 0,
    }  # fmt: skip
    [recovery] = status["recoveries"]
    assert (recovery["resume_step"], recovery["steps_recomputed"]) == (0, 0)
    assert recovery["layout_before"] == "" and recovery["generation"] == 1


def test_a_timeline_that_is_not_one_is_left_out_of_the_status_not_a_broken_rpc() -> None:
    """Timelines come from etcd: one whose numbers are not numbers is not shown (before, the
    status RPC failed on it with an internal error for every `ctl status`)."""
    control = Control(
        ControlConfig("n0", "inc0", "ctl", 10, exit_on_end=False),
        clock=SystemClock(),
        pool=_Pool(),
        health=health.HealthServicer(),
        metrics=AgentMetrics.create("n0", "ctl"),
        heartbeat=LoopHeartbeat(),
        serving=lambda: True,
        wake=lambda: None,
    )
    good = {"generation": 2, "reason": "node lost", "resume_step": 7, "planned_s": 0.5}
    bad = {"generation": "two", "reason": "?", "resume_step": 7}
    status = control.publish_status(
        FollowerSummary(),
        ViewSummary(timelines={"gen-2": good, "gen-3": bad}),
        HealthSummary(),
        ProgressSummary(),
    )
    assert [(r.generation, r.resume_step, r.planned_s) for r in status.recoveries] == [(2, 7, 0.5)]
    assert control.status_snapshot() is status and status.phase == "waiting"
    stopping = control.publish_status(
        FollowerSummary(), ViewSummary(), HealthSummary(), ProgressSummary(), job_stopping=True
    )
    assert stopping.phase == "stopping-job"  # an operator's `job stop` under way
