"""A checkpoint now as the agent carries it out (the decisions:
`elasticpp.agent.checkpoint.step`).

`JobCheckpoint` is built with its ports: the etcd calls it makes (the request:
`CheckpointRecords`; the `checkpoint` barrier: `CheckpointArrivals`), the clock, the
committed steps this node holds, the durability part's persist (`persist_outcome`,
`persist_now`) and the registration lease its reports are written on. It owns a plain
`CheckpointState`. Every agent reads the request when the `checkpoint` key changes (a watch
raises `changed`) and once at the start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from elasticpp.agent.actions import Action, PersistStep, ReportCheckpoint, ReportHeld
from elasticpp.agent.checkpoint.step import (
    CheckpointObservation,
    CheckpointState,
    checkpoint_step,
)
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.inbox import Signal
from elasticpp.agent.kernel.limits import FINAL_PERSIST_S
from elasticpp.agent.kernel.records import JSONValue
from elasticpp.cluster.barriers import CHECKPOINT_BARRIER
from elasticpp.cluster.records import CheckpointRequest


class CheckpointRecords(Protocol):
    """The request in etcd (elasticpp.cluster.requests.Requests)."""

    def checkpoint_request(self, *, cached: bool = ...) -> CheckpointRequest | None: ...


class CheckpointArrivals(Protocol):
    """The `checkpoint` barrier (elasticpp.cluster.arrivals.Arrivals)."""

    def arrive(
        self, barrier: str, node_id: str, value: JSONValue = ..., *, lease_id: int | None = ...
    ) -> None: ...


@dataclass(frozen=True)
class CheckpointConfig:
    node_id: str


class JobCheckpoint:
    """The checkpoint part: an operator's `elasticpp job checkpoint`."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        clock: Clock,
        records: CheckpointRecords,
        arrivals: CheckpointArrivals,
        held: Callable[[], list[int]],
        persist_outcome: Callable[[int], str],
        persist_now: Callable[[int], bool],
        member_lease: Callable[[], int | None],
    ) -> None:
        self.config = config
        self.state = CheckpointState()
        self.changed = Signal(raised=True)  # the `checkpoint` key changed (and at the start)
        self._clock = clock
        self._records = records
        self._arrivals = arrivals
        self._held = held
        self._persist_outcome = persist_outcome
        self._persist_now = persist_now
        self._member_lease = member_lease

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only this part emits."""
        executor.register(ReportHeld, self._report_held)
        executor.register(PersistStep, self._persist)
        executor.register(ReportCheckpoint, self._report_outcome)

    def read(self) -> None:
        """Read the request when a watch said its key changed (and once at the start)."""
        if not self.changed.take():
            return
        try:
            request = self._records.checkpoint_request(cached=True)
        except BaseException:
            self.changed.raise_()  # read again on the next tick
            raise
        if request is not None:
            self.state.request = request

    def step(self) -> list[Action]:
        """Every agent's step of a checkpoint now (`checkpoint_step`, pure)."""
        request = self.state.request
        if request is None:
            return []
        step = request.step
        return checkpoint_step(
            self.state,
            CheckpointObservation(
                now_s=self._clock.monotonic(),
                held=tuple(sorted(self._held(), reverse=True)),
                outcome="" if step is None else self._persist_outcome(step),
                persist_s=FINAL_PERSIST_S,
            ),
        )

    def _persist(self, action: PersistStep) -> list[Action]:
        if self._persist_now(action.step):
            return []
        self.state.answered = action.request
        why = "failed: not submitted (no persist_dir, or the step is no commit held here)"
        return [ReportCheckpoint(action.request, action.step, why)]

    def _arrive(self, value: JSONValue) -> None:
        self._arrivals.arrive(
            CHECKPOINT_BARRIER, self.config.node_id, value, lease_id=self._member_lease()
        )

    def _report_held(self, action: ReportHeld) -> None:
        try:
            self._arrive({"id": action.request, "held": list(action.held)})
        except BaseException:
            self.state.reported = None  # reported again on a later turn
            raise

    def _report_outcome(self, action: ReportCheckpoint) -> None:
        try:
            self._arrive({"id": action.request, "step": action.step, "outcome": action.outcome})
        except BaseException:
            self.state.answered = None  # reported again on a later turn
            raise
