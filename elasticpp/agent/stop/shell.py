"""A job's stop as the agent carries it out (the decisions: `elasticpp.agent.stop.step`).

`JobStop` is built with its ports: the etcd calls it makes (the stop request and the job's
end: `StopRecords`; the `stop` barrier: `StopArrivals`), the clock, the pool (the workers
with a rank that have not exited), this node's newest own commit, the durability part's
final persist (`persist_outcome`, `persist_now`), the view's members, the registration
lease its arrival is written on, and what to raise once the end is on record (the health
part reads it). It owns a plain `StopState`. Every agent reads the request when the `stop`
key changes (a watch raises `changed`) and once at the start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from elasticpp.agent.actions import Action, ArriveStop, EndStopped, PersistFinal
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.inbox import Signal
from elasticpp.agent.kernel.limits import FINAL_PERSIST_S, STOP_END_MARGIN_S, STOP_GRACE_S
from elasticpp.agent.kernel.ports import PoolPort
from elasticpp.agent.kernel.records import JSONValue, Record
from elasticpp.agent.stop.step import (
    StopLeadObservation,
    StopObservation,
    StopState,
    stop_lead_step,
    stop_step,
)
from elasticpp.cluster.barriers import STOP_BARRIER
from elasticpp.cluster.records import JobEnd, StopRequest


class StopRequests(Protocol):
    """The operator's stop request in etcd (elasticpp.cluster.requests.Requests)."""

    def stop_request(self, *, cached: bool = ...) -> StopRequest | None: ...


class StopRecords(Protocol):
    """The job's end in etcd (elasticpp.cluster.health.Health)."""

    def end_job(self, status: str, reason: str, by: str, step: int = ...) -> JobEnd: ...


class StopArrivals(Protocol):
    """The `stop` barrier (elasticpp.cluster.arrivals.Arrivals)."""

    def arrive(
        self, barrier: str, node_id: str, value: JSONValue = ..., *, lease_id: int | None = ...
    ) -> None: ...
    def barrier_state(
        self, barrier: str, *, cached: bool = ...
    ) -> tuple[Mapping[str, Record], int]: ...


@dataclass(frozen=True)
class StopConfig:
    node_id: str
    stop_timeout_s: float  # the job's: killed workers not gone this long are left behind


class JobStop:
    """The stop part: an operator's `elasticpp job stop`, from request to the job's end."""

    def __init__(
        self,
        config: StopConfig,
        *,
        clock: Clock,
        requests: StopRequests,
        records: StopRecords,
        arrivals: StopArrivals,
        pool: PoolPort,
        committed: Callable[[], int],
        persist_outcome: Callable[[int], str],
        persist_now: Callable[[int], bool],
        members: Callable[[], Mapping[str, Record]],
        member_lease: Callable[[], int | None],
        ended: Callable[[], None],
    ) -> None:
        self.config = config
        self.state = StopState()
        self.changed = Signal(raised=True)  # the `stop` key changed (and at the start)
        self._clock = clock
        self._requests = requests
        self._records = records
        self._arrivals = arrivals
        self._pool = pool
        self._committed = committed
        self._persist_outcome = persist_outcome
        self._persist_now = persist_now
        self._members = members
        self._member_lease = member_lease
        self._ended = ended

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only this part emits."""
        executor.register(PersistFinal, self._persist)
        executor.register(ArriveStop, self._arrive)
        executor.register(EndStopped, self._end)

    def requested(self) -> bool:
        """Whether the job is being stopped (nothing is planned or followed meanwhile)."""
        return self.state.request is not None

    def read(self) -> None:
        """Read the stop request, when a watch said its key changed (and once at the start).
        A request, once read, stays: a stop is not taken back (`job reset` ends it)."""
        if not self.changed.take() or self.state.request is not None:
            return
        try:
            self.state.request = self._requests.stop_request(cached=True)
        except BaseException:
            self.changed.raise_()  # read again on the next tick
            raise

    def step(self) -> list[Action]:
        """Every agent's step of the stop (`stop_step`, pure)."""
        committed = self._committed()
        return stop_step(
            self.state,
            StopObservation(
                now_s=self._clock.monotonic(),
                workers=tuple(self._pool.seen()),
                committed=committed,
                checkpoint=self._persist_outcome(committed) if committed >= 0 else "none",
                grace_s=STOP_GRACE_S,
                stuck_s=self.config.stop_timeout_s,
                persist_s=FINAL_PERSIST_S,
            ),
        )

    def lead(self) -> list[Action]:
        """The leader's step of the stop (`stop_lead_step`, pure), on the arrivals at `stop`
        from the job's cache (the leader caches every node's arrivals)."""
        if self.state.request is None or self.state.ended:
            return []
        arrivals, _ = self._arrivals.barrier_state(STOP_BARRIER, cached=True)
        return stop_lead_step(
            self.state,
            StopLeadObservation(
                now_s=self._clock.monotonic(),
                members=frozenset(self._members()),
                arrivals=arrivals,
                end_after_s=STOP_GRACE_S
                + self.config.stop_timeout_s
                + FINAL_PERSIST_S
                + STOP_END_MARGIN_S,
            ),
        )

    def _persist(self, action: PersistFinal) -> None:
        # Refused (the step is no commit held here): the step says so at arrival.
        self._persist_now(action.step)

    def _arrive(self, action: ArriveStop) -> None:
        try:
            self._arrivals.arrive(
                STOP_BARRIER,
                self.config.node_id,
                {"step": action.step, "checkpoint": action.checkpoint},
                lease_id=self._member_lease(),
            )
        except BaseException:
            self.state.arrived = False  # written on a later turn
            raise

    def _end(self, action: EndStopped) -> None:
        try:
            self._records.end_job(
                "stopped", action.reason, by=self.config.node_id, step=action.step
            )
        except BaseException:
            self.state.ended = False  # asked again on a later turn
            raise
        self._ended()
