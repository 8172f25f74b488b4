"""The agent's control service: translates RPCs into calls on the agent's parts (their ports:
the control part's status and drain, the journal's events, the health part's lift), nothing
more."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc

from elasticpp.agent.kernel.inbox import Event
from elasticpp.agent.kernel.summaries import AgentStatus
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.keys import check_name
from elasticpp.errors import ConfigError
from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc


class StatusPort(Protocol):
    def status_snapshot(self) -> AgentStatus: ...
    def request_drain(self, timeout_s: float) -> tuple[bool, str]: ...


class EventsPort(Protocol):
    def since(self, index: int, timeout_s: float) -> tuple[list[Event], int]: ...


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(
        self,
        control: StatusPort,
        events: EventsPort,
        lift_quarantine: Callable[[str], tuple[bool, str]],
        max_event_streams: int = 4,
    ) -> None:
        self._control = control
        self._events = events
        self._lift = lift_quarantine
        # Event streams live as long as their clients (`ctl events`); a limit of their own
        # keeps them from taking the threads that health checks and drains need.
        self._event_slots = threading.BoundedSemaphore(max_event_streams)

    def GetStatus(
        self, request: agent_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> agent_pb2.GetStatusResponse:
        s = self._control.status_snapshot()
        reply = agent_pb2.GetStatusResponse(
            node_id=s.node_id,
            job=s.job,
            generation=s.generation,
            leader=s.leader,
            phase=s.phase,
            layout=s.layout,
            last_step=s.last_step,
            last_loss=s.last_loss if math.isfinite(s.last_loss) else 0.0,
            members=s.members,
            ended=s.ended,
            waiting=s.waiting,
        )
        for node, q in s.quarantined.items():
            reply.quarantined.add(node_id=node, reason=q.reason, until=q.until, count=q.count)
        for w in s.workers:
            coord = w.coord
            reply.workers.add(
                rank=w.rank,
                pid=w.pid,
                state=w.state,
                last_step=w.last_step,
                pp=coord.pp if coord else -1,
                tp=coord.tp if coord else -1,
                dp=coord.dp if coord else -1,
            )
        for t in s.recoveries:
            reply.recoveries.add(
                generation=t.generation,
                reason=t.reason,
                layout_before=t.layout_before,
                layout_after=t.layout_after,
                resume_step=t.resume_step,
                steps_recomputed=t.steps_recomputed,
                planned_s=t.planned_s,
                stopped_s=t.stopped_s,
                moved_s=t.moved_s,
                resumed_s=t.resumed_s,
            )
        return reply

    def Drain(
        self, request: agent_pb2.DrainRequest, context: grpc.ServicerContext
    ) -> agent_pb2.DrainResponse:
        timeout_s = request.timeout_s or 120.0
        if not math.isfinite(timeout_s) or timeout_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be >= 0 and finite")
        accepted, message = self._control.request_drain(timeout_s)
        return agent_pb2.DrainResponse(accepted=accepted, message=message)

    def LiftQuarantine(
        self, request: agent_pb2.LiftQuarantineRequest, context: grpc.ServicerContext
    ) -> agent_pb2.LiftQuarantineResponse:
        try:
            check_name("node_id", request.node_id)
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            lifted, message = self._lift(request.node_id)
        except ClusterUnavailableError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        if not lifted:
            context.abort(grpc.StatusCode.NOT_FOUND, message)
        return agent_pb2.LiftQuarantineResponse(lifted=True, message=message)

    def WatchEvents(
        self, request: agent_pb2.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[agent_pb2.AgentEvent]:
        if not self._event_slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too many event streams open on this agent; close one and retry",
            )
        try:
            index = 0
            while context.is_active():
                items, index = self._events.since(index, timeout_s=1.0)
                for at, kind, message, generation in items:
                    yield agent_pb2.AgentEvent(
                        time=at, kind=kind, message=message, generation=generation
                    )
        finally:
            self._event_slots.release()
