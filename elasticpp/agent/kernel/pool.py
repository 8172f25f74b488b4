"""The node's worker processes, as one object: the supervisor's state.

`WorkerPool` holds the warm spares (spawned ahead, torch imported, idle until assigned),
which of them reported ready and since when they wait, the workers of every generation still
alive, and the queue their reader threads put events on. It is written only through its
methods, all called from the agent's decision loop; the reader threads only `deliver` events
(a thread-safe queue) and wake the loop. Other parts read it through `workers()`, `spares()`
and `counts()` and act on it through commands (`take_ready`, `add_worker`, `ask_stop`,
`kill_worker`, `release_spares`), never by writing its fields.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from elasticpp.agent.kernel.decide import WorkerState, transition
from elasticpp.agent.kernel.records import JSONValue
from elasticpp.agent.kernel.summaries import WorkerSeen
from elasticpp.errors import ElasticppError
from elasticpp.plan import Plan
from elasticpp.train.worker.procs import WorkerProcess

# A worker's events that say it trains: each step, and each snapshot of one.
TRAINING_EVENTS = frozenset({"step", "snapshot"})


# A worker and one event it reported (JSON: checked where it is read).
WorkerEvent = tuple[WorkerProcess, dict[str, JSONValue]]


@dataclass
class Worker:
    """A worker with a rank of one generation (the pool's record of it)."""

    proc: WorkerProcess
    rank: int
    generation: int
    plan: Plan
    state: WorkerState = WorkerState.STARTING
    last_progress_s: float = field(default_factory=time.monotonic)
    last_step: int = -1
    killed_by_us: bool = False
    followed_a_peer: bool = False  # its error said a peer went away (a victim, not a cause)

    def move(self, new: WorkerState) -> None:
        self.state = transition(self.state, new)


class WorkerPool:
    def __init__(
        self, wake: threading.Event | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._wake = wake
        self._clock = clock  # the agent's (elasticpp.agent.kernel.clock)
        # SimpleQueue: a get on an empty one is one C call, where queue.Queue's takes its
        # condition's lock in Python; every turn of every agent asks it (bench/scale.py).
        self._events: queue.SimpleQueue[tuple[WorkerProcess, dict[str, JSONValue]]] = (
            queue.SimpleQueue()
        )
        self._spares: list[WorkerProcess] = []  # spawned, maybe not yet ready
        self._ready: set[int] = set()  # pids of spares that reported "ready"
        self._since: dict[int, float] = {}  # pid of a spare -> when it was spawned
        self._workers: dict[int, Worker] = {}  # by pid, current and old generations
        # Ranks that reported "done", by generation: kept here, not on the worker, because
        # a worker's "done" and its exit can arrive in one tick and the exit forgets it.
        self._done: dict[int, set[int]] = {}
        self._halted: dict[int, str] = {}  # generation -> the first halt's message
        self._replaced: list[float] = []  # when never-ready spares were replaced (newest 16)
        # When a worker last reported training (a step or a snapshot; monotonic): ready,
        # started and exit events are not training, and wake the loop all the same.
        self.trained_at_s = float("-inf")

    # ------------------------------------------------------------------ events
    def deliver(self, proc: WorkerProcess, event: dict[str, JSONValue]) -> None:
        """From a worker's reader thread: queue the event and wake the loop."""
        self._events.put((proc, event))
        if event.get("event") in TRAINING_EVENTS:
            self.trained_at_s = time.monotonic()  # one float, written here only: read by the loop
        if self._wake is not None:
            self._wake.set()

    def next_event(self) -> WorkerEvent | None:
        try:
            return self._events.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------------ spares
    def add_spare(self, proc: WorkerProcess, now_s: float | None = None) -> None:
        self._spares.append(proc)
        self._since[proc.pid] = self._clock() if now_s is None else now_s

    def spares(self) -> tuple[WorkerProcess, ...]:
        return tuple(self._spares)

    def is_spare(self, proc: WorkerProcess) -> bool:
        return proc in self._spares

    def mark_ready(self, pid: int) -> None:
        self._ready.add(pid)

    def ready_spares(self) -> int:
        return sum(1 for p in self._spares if p.pid in self._ready)

    def overdue_spares(self, now_s: float, timeout_s: float) -> list[tuple[WorkerProcess, float]]:
        """Spares not ready `timeout_s` after their start, with how long they waited."""
        return [
            (p, now_s - self._since.get(p.pid, now_s))
            for p in self._spares
            if p.pid not in self._ready and now_s - self._since.get(p.pid, now_s) > timeout_s
        ]

    def replace_overdue(self, proc: WorkerProcess, now_s: float) -> None:
        """Kill and drop a spare that never became ready (the caller spawns another)."""
        self.drop_spare(proc, kill=True)
        self.note_never_ready(now_s)

    def note_never_ready(self, now_s: float) -> None:
        """A warm worker that never became ready was given up on (the worker template)."""
        self._replaced = [*self._replaced[-15:], now_s]

    def replaced_since(self, since_s: float) -> int:
        """Never-ready spares replaced at or after `since_s` (monotonic)."""
        return sum(1 for t in self._replaced if t >= since_s)

    def drop_spare(self, proc: WorkerProcess, *, kill: bool = False) -> None:
        if kill:
            proc.kill(wait=False)
        with contextlib.suppress(ValueError):
            self._spares.remove(proc)
        self._ready.discard(proc.pid)
        self._since.pop(proc.pid, None)

    def take_ready(self, count: int) -> list[WorkerProcess] | None:
        """`count` ready spares out of the pool, or None (and nothing taken) if fewer."""
        ready = [p for p in self._spares if p.pid in self._ready and p.alive()]
        if len(ready) < count:
            return None
        taken = ready[:count]
        for p in taken:
            self._spares.remove(p)
            self._since.pop(p.pid, None)
        return taken

    def give_back(self, procs: Iterable[WorkerProcess]) -> None:
        """Spares taken but never assigned go back (still ready, still waiting)."""
        for p in procs:
            if p.alive() and p not in self._spares:
                self._spares.append(p)
                self._since.setdefault(p.pid, self._clock())

    def release_spares(self) -> None:
        """Kill every spare (the job is over, or the agent leaves)."""
        for p in self._spares:
            p.kill(wait=False)
        self._spares.clear()
        self._ready.clear()
        self._since.clear()

    # ------------------------------------------------------------------ workers with ranks
    def add_worker(self, w: Worker) -> None:
        self._workers[w.proc.pid] = w
        self._ready.discard(w.proc.pid)

    def worker(self, pid: int) -> Worker | None:
        return self._workers.get(pid)

    def abandon(self, proc: WorkerProcess) -> None:
        """An assignment that did not go through (all or nothing): kill the worker it
        went to, without waiting, and forget it."""
        w = self.forget(proc.pid)
        if w is not None:
            w.killed_by_us = True
        proc.kill(wait=False)

    def forget(self, pid: int) -> Worker | None:
        return self._workers.pop(pid, None)

    def workers(self) -> tuple[Worker, ...]:
        return tuple(self._workers.values())

    def older_than(self, generation: int) -> list[Worker]:
        return [w for w in self._workers.values() if w.generation < generation]

    def of_generation(self, generation: int) -> list[Worker]:
        return [w for w in self._workers.values() if w.generation == generation]

    def seen(self) -> tuple[WorkerSeen, ...]:
        """The workers with a rank, as other parts see them (the control part's status)."""
        return tuple(
            WorkerSeen(w.rank, w.proc.pid, w.state.value, w.last_step, w.generation)
            for w in self._workers.values()
        )

    def has_spares(self) -> bool:
        return bool(self._spares)

    def any_alive(self) -> bool:
        return any(w.proc.alive() for w in self._workers.values())

    def ask_stop(self, w: Worker) -> None:
        """Stop `w` at the next step boundary (ranks agree on it by all-reduce)."""
        with contextlib.suppress(ElasticppError):
            w.proc.stop_at(0)
        w.move(WorkerState.STOPPING)

    def stop_workers(self) -> None:
        """Kill every worker still alive (never waiting on one that will not go) and release
        the spares: the job ended, or this node is set aside."""
        for w in self.workers():
            if w.proc.alive():
                self.kill_worker(w)
        self.release_spares()

    def kill_worker(self, w: Worker) -> None:
        """SIGKILL `w` without waiting: its reader thread reports the exit."""
        w.killed_by_us = True
        if w.state not in (WorkerState.DONE, WorkerState.STOPPED, WorkerState.FAILED):
            w.move(WorkerState.FAILED)
        w.proc.kill(wait=False)

    def rank_done(self, generation: int, rank: int) -> None:
        self._done.setdefault(generation, set()).add(rank)
        for old in sorted(self._done)[:-4]:  # bounded: only the newest generations matter
            del self._done[old]

    def rank_halted(self, generation: int, message: str) -> None:
        self._halted.setdefault(generation, message)
        for old in sorted(self._halted)[:-4]:
            del self._halted[old]

    def halted(self, generation: int) -> str | None:
        """Why a rank of `generation` halted (a non-finite step), if one did."""
        return self._halted.get(generation)

    def done_ranks(self, generation: int) -> frozenset[int]:
        return frozenset(self._done.get(generation, ()))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {"warm": len(self._spares)}
        for w in self._workers.values():
            out[w.state.value] = out.get(w.state.value, 0) + 1
        return out

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """No process outlives the agent: signal all at once, then reap them, all within
        `timeout_s` (a worker in uninterruptible sleep is left to the agent's last stop)."""
        procs = [w.proc for w in self._workers.values()] + list(self._spares)
        for p in procs:
            p.kill(wait=False)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.kill(timeout_s=max(0.0, deadline - time.monotonic()))
        self._spares.clear()
        self._ready.clear()
        self._since.clear()
