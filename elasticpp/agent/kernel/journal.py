"""The agent's journal of decisions (`ctl events`) and its error policy.

Every part writes its decisions to the `Journal` (an output, like the log: thread-safe, read
by the WatchEvents streams) and hands the errors its step survived to the `ErrorPolicy`,
which logs each distinct one once and counts them all. Neither decides anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.inbox import Event, EventLog
from elasticpp.agent.kernel.metrics import AgentMetrics

log = logging.getLogger("elasticpp.agent")

ERRORS_REMEMBERED = 1000  # distinct errors logged once each; past this, logged again


class Journal:
    """The decisions and observations of one agent, each also one INFO line."""

    def __init__(
        self, clock: Clock, generation: Callable[[], int], log_: EventLog | None = None
    ) -> None:
        self._clock = clock
        self._generation = generation  # the generation followed when an event is written
        self.log = log_ if log_ is not None else EventLog()

    def write(self, kind: str, message: str) -> None:
        log.info("%s", message)
        self.record(kind, message)

    def record(self, kind: str, message: str, generation: int | None = None) -> None:
        """Journal an event the caller logged itself (at its own level)."""
        g = self._generation() if generation is None else generation
        self.log.append(kind, message, g, at=self._clock.time())

    def since(self, index: int, timeout_s: float) -> tuple[list[Event], int]:
        """Events after the `index`-th one ever written (for the WatchEvents stream)."""
        return self.log.since(index, timeout_s)


class ErrorPolicy:
    """Nothing from outside (an etcd value, a disk error, a worker event) ends the agent: an
    error a part's step raised is logged once per distinct error, with its traceback, and
    always counted (`elasticpp_errors_total{source}`)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics
        self.seen: set[tuple[str, str, str]] = set()

    def survive(self, source: str, exc: BaseException) -> None:
        m = self._metrics
        m.errors_total.labels(**m.labels, source=source).inc()
        key = (source, type(exc).__name__, str(exc)[:200])
        if key in self.seen:
            return
        if len(self.seen) >= ERRORS_REMEMBERED:
            self.seen.clear()  # bounded: a flood of distinct errors is logged again
        self.seen.add(key)
        log.error(
            "%s error, the agent goes on: %s: %s", source, type(exc).__name__, exc, exc_info=exc
        )
