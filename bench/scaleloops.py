"""The decision loops of many simulated agents on a few threads (bench/scalesim.py).

A real agent runs its loop on a thread of its own (`Agent.run`): it waits until woken or
until its tick is due, then takes a `turn`. A simulated process of a thousand agents would
hold a thousand loop threads and a thousand watchdog threads, and the GIL's hand-offs
between them, not the agents' work, would use the core. `LoopPool` runs the same turns
from `threads` threads: an agent whose wake is set (`PoolWake`, the event its watches,
workers and futures set) or whose tick is due gets its next turn on the first free thread.

A real agent's etcd round trip holds only its own loop. Here a turn that waits for etcd
(`waiting()`, around the simulated nodes' requests) gives its slot to the next agent's turn,
on one of `parked` more threads, and takes a slot again when the answer came (before any new
turn starts). With none parked, every process's agents sent their requests 2 at a time: the
last node held a new plan at 2,048 nodes after 1,024 etcd round trips on each of 2 threads.

Invariants:
- one turn of an agent at a time (an agent is queued once, and a wake that comes during
  its turn queues it again after the turn), in the order agents became ready;
- at most `threads` turns run outside `waiting()` at once; a turn back from its wait goes
  on before a new turn starts;
- an agent's turn begins with its wake cleared, as `Agent.run`'s does; between turns the
  agent is idle (`Agent.idle_for`), so a queue behind other agents is not a stalled loop;
- an agent whose turn returns an exit code, raises, or whose stop was requested is shut
  down on the pool thread and leaves the pool; `close()` stops every agent and waits for
  the threads;
- one watchdog thread looks at every agent's loop each LOOP_WATCH_S (`Agent.check_loop`);
- with `profile_to`, each pool thread profiles the turns it runs (cProfile on the thread's
  CPU clock, on only while a turn runs) and writes them there as it ends (`close()`).
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import heapq
import itertools
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elasticpp.agent.kernel.limits import LOOP_WATCH_S
from elasticpp.agent.node import Agent

log = logging.getLogger("elasticpp.bench.scale")
SLOW_TURN_S = 3.0  # a turn this long is logged with its stack (once per turn)


def merge_turn_profiles(directory: Path) -> Path | None:
    """The pool threads' turn profiles under `directory` (`LoopPool(profile_to=...)`, of
    every process) merged into `directory/turns.prof`; None if there are none."""
    import pstats

    parts = sorted(directory.glob("turns-*.prof"))
    if not parts:
        return None
    merged = pstats.Stats(str(parts[0]))
    for part in parts[1:]:
        merged.add(str(part))
    out = directory / "turns.prof"
    merged.dump_stats(str(out))
    return out


class PoolWake(threading.Event):
    """An agent's wake event whose `set()` also queues the agent on its pool."""

    def __init__(self, pool: LoopPool) -> None:
        super().__init__()
        self._pool = pool
        self.agent: Agent | None = None  # bound once the agent exists

    def set(self) -> None:
        super().set()
        if self.agent is not None:
            self._pool.ready(self.agent)


class LoopPool:
    """Turns of many agents' decision loops on `threads` threads (see the module)."""

    def __init__(
        self,
        threads: int,
        name: str = "loops",
        slow_turn_s: float = SLOW_TURN_S,
        parked: int = 0,
        profile_to: Path | None = None,
    ) -> None:
        self._slow_turn_s = slow_turn_s
        self._profile_to = profile_to
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # pool threads wait on it for ready agents
        self._back = threading.Condition(lock)  # turns back from `waiting()` wait for a slot
        self._slots = threads  # turns that may run (outside `waiting()`) at once
        self._running = 0  # turns holding a slot
        self._returning = 0  # turns back from `waiting()` waiting for a slot
        self._in_turn = threading.local()  # .turn: this pool thread runs a turn
        self._timer_cond = threading.Condition(lock)  # the timer waits on it for due ticks
        self._left = threading.Condition(lock)  # close() waits on it for agents to leave
        self._closing = threading.Event()
        self._ready: collections.deque[Agent] = collections.deque()
        self._due: list[tuple[float, int, int, Agent]] = []  # (monotonic, seq, token, agent)
        self._seq = itertools.count()
        self._agents: dict[int, _Slot] = {}  # id(agent) -> its slot
        self._closed = False
        self.exit_codes: dict[str, int | str] = {}  # node id -> exit code or error
        self._cpu_s: collections.Counter[str] = collections.Counter()  # node id -> its turns'
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads + parked)
        ]
        self._threads.append(
            threading.Thread(target=self._timer, name=f"{name}-timer", daemon=True)
        )
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        for t in self._threads:
            t.start()
        self._watchdog.start()

    def wake(self) -> PoolWake:
        """The wake event to construct an agent with; `add` binds it."""
        return PoolWake(self)

    def add(self, agent: Agent, wake: PoolWake) -> None:
        """Run `agent`'s loop here (after its `start()`): its first turn now."""
        wake.agent = agent
        with self._cond:
            self._agents[id(agent)] = _Slot(agent)
        self.ready(agent)

    def ready(self, agent: Agent) -> None:
        """Queue `agent`'s next turn now (its wake was set, or its stop requested)."""
        with self._cond:
            slot = self._agents.get(id(agent))
            if slot is None:
                return
            if slot.running:
                slot.again = True
                return
            if slot.queued:
                return
            slot.queued = True
            slot.token += 1  # a due entry in the heap is stale now
            self._ready.append(agent)
            self._cond.notify()

    def _next(self) -> Agent | None:
        """The next agent to take a turn; waits for one (only the timer thread waits for
        due ticks: one wake-up per due tick, not one per pool thread)."""
        with self._cond:
            while not self._closed and (
                not self._ready or self._running >= self._slots or self._returning
            ):
                self._cond.wait()
            if self._closed:
                return None
            self._running += 1
            agent = self._ready.popleft()
            slot = self._agents[id(agent)]
            slot.queued, slot.running, slot.again = False, True, False
            slot.since, slot.ident, slot.told = time.monotonic(), threading.get_ident(), False
            return agent

    def _timer(self) -> None:
        """Moves agents whose tick is due to the ready queue."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._due and self._due[0][0] <= now:
                    _, _, token, agent = heapq.heappop(self._due)
                    slot = self._agents.get(id(agent))
                    if slot is not None and slot.token == token and not slot.queued:
                        slot.queued = True
                        self._ready.append(agent)
                        self._cond.notify()
                self._timer_cond.wait(self._due[0][0] - now if self._due else None)

    def _free_slot(self) -> None:
        """A turn gave its slot back (the pool's lock held): to a turn back from its wait
        first, else to a new turn."""
        self._running -= 1
        (self._back if self._returning else self._cond).notify()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a turn's wait for etcd: its slot goes to another turn meanwhile. Anywhere
        but in a turn on this pool's thread (a watch thread, the harness) it does nothing."""
        if not getattr(self._in_turn, "turn", False):
            yield
            return
        with self._cond:
            self._free_slot()
        try:
            yield
        finally:
            with self._cond:
                self._returning += 1
                while self._running >= self._slots and not self._closed:
                    self._back.wait()
                self._returning -= 1
                self._running += 1
                if not self._returning and self._running < self._slots:
                    self._cond.notify()  # a slot is still free: a new turn may take it

    def _work(self) -> None:
        if self._profile_to is None:
            self._turns(None)
            return
        # The thread's CPU clock: a turn's waits (etcd, the pool's slots) are not its cost.
        profile = cProfile.Profile(timer=time.thread_time)
        try:
            self._turns(profile)
        finally:
            name = f"turns-{os.getpid()}-{threading.current_thread().name}.prof"
            profile.dump_stats(str(self._profile_to / name))

    def _turns(self, profile: cProfile.Profile | None) -> None:
        while (agent := self._next()) is not None:
            self._in_turn.turn = True
            code: int | str | None = None
            if not agent.stopping():
                agent.wake.clear()
                cpu_s = time.thread_time()
                try:
                    code = agent.turn() if profile is None else profile.runcall(agent.turn)
                except Exception as exc:  # NodeIdConflictError, or a bug: the agent ends
                    log.warning("node %s: loop ended: %s", agent.node_id, exc)
                    code = str(exc)
                finally:
                    self._cpu_s[agent.node_id] += time.thread_time() - cpu_s
            if code is not None or agent.stopping():
                self._finish(agent, 0 if code is None else code)
                continue
            tick_s = agent.idle_for()
            self._in_turn.turn = False
            with self._cond:
                self._free_slot()
                slot = self._agents[id(agent)]
                slot.running, slot.since = False, None
                if slot.again or agent.wake.is_set():
                    slot.queued = True
                    self._ready.append(agent)
                    self._cond.notify()
                else:
                    slot.token += 1
                    due = (time.monotonic() + tick_s, next(self._seq), slot.token, agent)
                    if not self._due or due < self._due[0]:
                        self._timer_cond.notify()
                    heapq.heappush(self._due, due)

    def _finish(self, agent: Agent, code: int | str) -> None:
        self._in_turn.turn = False
        with self._cond:
            self._free_slot()
            self._agents.pop(id(agent), None)
            self.exit_codes[agent.node_id] = code
            self._left.notify_all()
        try:
            agent.shutdown()
        except Exception:
            log.exception("node %s: shutdown failed", agent.node_id)

    def cpu_s(self, node_id: str) -> float:
        """CPU seconds `node_id`'s turns have used (its loop's CPU, as its own thread's)."""
        return self._cpu_s[node_id]

    def running(self, agent: Agent) -> bool:
        """True until `agent` left the pool (stopped and shut down)."""
        with self._cond:
            return id(agent) in self._agents

    def _watch(self) -> None:
        while not self._closing.wait(LOOP_WATCH_S):
            with self._cond:
                agents = [s.agent for s in self._agents.values()]
            self._tell_slow_turns()
            for agent in agents:
                try:
                    agent.control.check_loop()
                except Exception:
                    log.exception("node %s: loop watchdog failed", agent.node_id)

    def _tell_slow_turns(self) -> None:
        """Log, once per turn, where a turn longer than `slow_turn_s` is (its thread's stack):
        a turn that blocks holds one of the pool's threads and its node's lease gate."""
        now = time.monotonic()
        with self._cond:
            slow = [
                s
                for s in self._agents.values()
                if s.since is not None and not s.told and now - s.since > self._slow_turn_s
            ]
            for s in slow:
                s.told = True
            found = [(s.agent.node_id, now - s.since, s.ident) for s in slow if s.since]
        if not found:
            return
        frames = sys._current_frames()
        for node_id, took, ident in found:
            frame = frames.get(ident) if ident is not None else None
            where = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "?"
            log.warning("node %s: turn running for %.1f s, at:\n%s", node_id, took, where)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every agent still here, wait until each is shut down, end the threads."""
        with self._cond:
            agents = [s.agent for s in self._agents.values()]
        for agent in agents:
            agent.request_stop()
        deadline = time.monotonic() + timeout_s
        self._closing.set()
        with self._cond:
            while self._agents and time.monotonic() < deadline:
                self._left.wait(0.1)
            self._closed = True
            self._cond.notify_all()
            self._back.notify_all()
            self._timer_cond.notify_all()
        for t in [*self._threads, self._watchdog]:
            t.join(timeout=max(0.0, deadline - time.monotonic()) + 5.0)


class _Slot:
    __slots__ = ("again", "agent", "ident", "queued", "running", "since", "token", "told")

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.queued = False  # in the ready queue
        self.running = False  # a pool thread is in its turn
        self.again = False  # woken during its turn: queued again after it
        self.token = 0  # the due entry that is current (older ones are skipped)
        self.since: float | None = None  # monotonic start of the turn in progress
        self.ident: int | None = None  # the pool thread running it
        self.told = False  # the turn in progress was logged as slow
