"""The simulation's pool of decision-loop threads (bench/scaleloops.py) with fake agents that
record their turns: one turn of an agent at a time, a wake during a turn gives one more turn
after it, due ticks come without a wake, a stopped agent is shut down once and leaves the
pool, and close() stops every agent."""

from __future__ import annotations

import logging
import pstats
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench.scaleloops import LoopPool, PoolWake, merge_turn_profiles
from elasticpp.waiting import wait_until


class _FakeAgent:
    def __init__(self, node_id: str, wake: PoolWake, tick_s: float = 60.0) -> None:
        self.node_id = node_id
        self.wake = wake
        self._stop = threading.Event()
        self.tick_s = tick_s
        self.turns = 0
        self.inside = 0  # turns in progress (never above 1)
        self.most_inside = 0
        self.shutdowns = 0
        self.loop_checks = 0
        self.exit_code: int | None = None
        self.during_turn: Any = None  # called inside the next turn
        self.lock = threading.Lock()
        self.control = self  # the watchdog looks at `agent.control.check_loop()`

    def turn(self) -> int | None:
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            action, self.during_turn = self.during_turn, None
            if action is not None:
                action()
            self.turns += 1
            return self.exit_code
        finally:
            with self.lock:
                self.inside -= 1

    def idle_for(self) -> float:
        return self.tick_s

    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        self._stop.set()
        self.wake.set()

    def shutdown(self) -> None:
        self.shutdowns += 1

    def check_loop(self) -> bool:
        self.loop_checks += 1
        return True


def _busy(pool: LoopPool, agent: _FakeAgent) -> bool:
    """Whether `agent` is in a turn or queued for one (not waiting for a wake or its tick)."""
    with pool._cond:
        slot = pool._agents[id(agent)]
        return slot.running or slot.queued


def _agents(pool: LoopPool, n: int, tick_s: float = 60.0) -> list[_FakeAgent]:
    agents = []
    for i in range(n):
        wake = pool.wake()
        agent = _FakeAgent(f"n{i}", wake, tick_s)
        pool.add(agent, wake)  # type: ignore[arg-type]
        agents.append(agent)
    return agents


def test_each_agent_takes_its_first_turn_and_then_waits_for_its_wake() -> None:
    pool = LoopPool(3)
    try:
        agents = _agents(pool, 5)
        assert wait_until(lambda: all(a.turns == 1 for a in agents), 10)
        agents[2].wake.set()
        assert wait_until(lambda: agents[2].turns == 2, 10)
        assert [a.turns for a in agents] == [1, 1, 2, 1, 1]  # no tick was due
    finally:
        pool.close()


def test_a_wake_during_a_turn_gives_one_more_turn_after_it_never_two_at_once() -> None:
    pool = LoopPool(4)
    try:
        (agent,) = _agents(pool, 1)
        assert wait_until(lambda: agent.turns == 1, 10)
        agent.during_turn = lambda: [agent.wake.set() for _ in range(5)]
        agent.wake.set()
        assert wait_until(lambda: agent.turns == 3, 10)  # the woken turn, then one more
        assert wait_until(lambda: not _busy(pool, agent), 10)  # then waits for a wake
        assert agent.turns == 3 and agent.most_inside == 1
    finally:
        pool.close()


def test_a_due_tick_comes_without_a_wake() -> None:
    pool = LoopPool(2)
    try:
        (agent,) = _agents(pool, 1, tick_s=0.05)
        assert wait_until(lambda: agent.turns >= 5, 10)
    finally:
        pool.close()


def test_an_agent_that_stops_is_shut_down_once_and_leaves_the_pool() -> None:
    pool = LoopPool(2)
    try:
        quitter, stopped, other = _agents(pool, 3)
        assert wait_until(lambda: all(a.turns == 1 for a in (quitter, stopped, other)), 10)
        quitter.exit_code = 3
        quitter.wake.set()
        stopped.request_stop()
        assert wait_until(lambda: not pool.running(quitter) and not pool.running(stopped), 10)
        assert pool.exit_codes == {"n0": 3, "n1": 0}
        assert (quitter.shutdowns, stopped.shutdowns, other.shutdowns) == (1, 1, 0)
        turns = stopped.turns
        stopped.wake.set()  # woken after it left: nothing runs
        other.wake.set()
        assert wait_until(lambda: other.turns == 2, 10)
        assert stopped.turns == turns
    finally:
        pool.close()
    assert other.shutdowns == 1  # close() stopped it


def test_one_watchdog_looks_at_every_agents_loop() -> None:
    pool = LoopPool(2)
    try:
        agents = _agents(pool, 3)
        assert wait_until(lambda: all(a.loop_checks >= 1 for a in agents), 10)
    finally:
        pool.close()


def test_a_long_turn_is_logged_once_with_where_it_is(caplog: pytest.LogCaptureFixture) -> None:
    """A turn that blocks holds a pool thread and its node's lease gate: the watchdog names
    the node and the frame it is in, once per turn."""
    caplog.set_level(logging.WARNING, logger="elasticpp.bench.scale")
    pool = LoopPool(2, slow_turn_s=0.1)
    release = threading.Event()

    def blocked_in_etcd_call() -> None:
        release.wait(30)

    try:
        (agent, quick) = _agents(pool, 2)
        assert wait_until(lambda: agent.turns == 1 and quick.turns == 1, 10)
        agent.during_turn = blocked_in_etcd_call
        agent.wake.set()
        assert wait_until(lambda: "node n0: turn running for" in caplog.text, 10)
        release.set()
        assert wait_until(lambda: agent.turns == 2, 10)
        quick.wake.set()
        assert wait_until(lambda: quick.turns == 2, 10)
    finally:
        release.set()
        pool.close()
    slow = [r.getMessage() for r in caplog.records if "turn running for" in r.getMessage()]
    assert len(slow) == 1, slow
    assert "blocked_in_etcd_call" in slow[0]


def test_a_turn_waiting_on_etcd_gives_its_slot_to_another_agents_turn() -> None:
    """A real node's etcd round trip holds its own loop only: with one slot and a parked
    thread, a second agent's turn runs while the first waits inside `waiting()`."""
    pool = LoopPool(1, parked=1)
    release = threading.Event()
    try:
        (waiter, other) = _agents(pool, 2)
        assert wait_until(lambda: waiter.turns == 1 and other.turns == 1, 10)

        def round_trip() -> None:
            with pool.waiting():
                release.wait(30)

        waiter.during_turn = round_trip
        waiter.wake.set()
        assert wait_until(lambda: waiter.inside == 1, 10)
        other.wake.set()
        assert wait_until(lambda: other.turns == 2, 10)  # ran while the first waited
        assert waiter.turns == 1
    finally:
        release.set()
        pool.close()
    assert waiter.turns == 2


def test_turns_outside_waiting_never_run_more_than_the_slots_at_once() -> None:
    """However many threads are parked, at most `threads` turns run outside `waiting()`; a
    turn back from its wait takes a slot before a new turn starts."""
    pool = LoopPool(1, parked=3)
    lock = threading.Lock()
    running = [0]
    most = [0]

    def work() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            for _ in range(3):
                with lock:
                    running[0] -= 1
                with pool.waiting():
                    threading.Event().wait(0.005)
                with lock:
                    running[0] += 1
                    most[0] = max(most[0], running[0])
        finally:
            with lock:
                running[0] -= 1

    try:
        agents = _agents(pool, 6)
        assert wait_until(lambda: all(a.turns == 1 for a in agents), 10)
        for a in agents:
            a.during_turn = work
        for a in agents:
            a.wake.set()
        assert wait_until(lambda: all(a.turns == 2 for a in agents), 10)
        assert most[0] == 1
    finally:
        pool.close()


def test_waiting_outside_a_turn_does_nothing() -> None:
    pool = LoopPool(1)
    try:
        with pool.waiting():  # the harness's own thread: no slot to give back
            pass
        (agent,) = _agents(pool, 1)
        assert wait_until(lambda: agent.turns == 1, 10)
    finally:
        pool.close()


def _spin_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_turns_are_profiled_on_the_threads_cpu_clock_and_merged(tmp_path: Path) -> None:
    # A turn that burns CPU shows in the profile; one that waits (etcd, a slot) does not.
    pool = LoopPool(2, profile_to=tmp_path)
    inside, released = threading.Event(), threading.Event()
    blocked_s: list[float] = []

    def block() -> None:  # a turn waiting on something else: released after the spin
        inside.set()
        t0 = time.monotonic()
        assert released.wait(10)
        blocked_s.append(time.monotonic() - t0)

    try:
        agents = _agents(pool, 3)
        assert wait_until(lambda: all(a.turns == 1 for a in agents), 10)
        agents[1].during_turn = block
        agents[1].wake.set()
        assert inside.wait(10)  # it holds one of the two threads, waiting
        agents[0].during_turn = lambda: _spin_cpu(0.05)
        agents[0].wake.set()
        assert wait_until(lambda: agents[0].turns == 2, 10)
        released.set()
        assert wait_until(lambda: agents[1].turns == 2, 10)
    finally:
        released.set()
        pool.close()
    merged = merge_turn_profiles(tmp_path)
    assert merged == tmp_path / "turns.prof"
    stats = pstats.Stats(str(merged)).stats  # type: ignore[attr-defined]
    by_name = {f"{fn[0].rsplit('/', 1)[-1]}:{fn[2]}": v for fn, v in stats.items()}
    calls, _, _, spin_cum, _ = by_name["test_scale_loops.py:_spin_cpu"]
    assert calls == 1 and spin_cum >= 0.04
    turn_calls, _, _, turn_cum, _ = by_name["test_scale_loops.py:turn"]
    assert turn_calls == 5  # every turn of every agent, on whichever thread ran it
    # The blocked turn waited at least as long as the spin ran; had its wait counted, the
    # turns' CPU would be the spin's plus all of it.
    assert blocked_s and blocked_s[0] >= 0.04
    assert turn_cum < spin_cum + blocked_s[0] / 2


def test_no_profiles_merge_to_nothing(tmp_path: Path) -> None:
    assert merge_turn_profiles(tmp_path) is None
