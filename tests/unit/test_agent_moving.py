"""MOVING's deadline while the state fetch runs: held while bytes arrive, not for ever
(pure logic: a constructed agent, a fetch that never ends, a progress record on a
fake clock, a fake of the cluster's one call)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

from elasticpp.agent.decide import Phase
from elasticpp.agent.follower import _GenState
from elasticpp.agent.limits import FETCH_STALL_S
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.records import GenerationRecord
from elasticpp.store.resume import TransferProgress
from tests.unit.test_agent_done import SPEC, _Cluster, _plan


def test_a_fetch_that_stops_receiving_bytes_no_longer_holds_movings_deadline(
    tmp_path: Path,
) -> None:
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    cluster = _Cluster()
    agent.cluster = cluster  # type: ignore[assignment]
    record = GenerationRecord(3, _plan(3).to_dict(), "n9", time.time(), resume_step=5)
    gs = _GenState(record=record, phase=Phase.MOVING)
    agent._fs.gen = gs
    gs.fetch = Future()  # a fetch in flight
    now = [time.monotonic()]
    gs.fetch_progress = TransferProgress(clock=lambda: now[0])
    try:
        # Bytes keep arriving: the deadline is held, however long the phase has run.
        gs.phase_since_s -= 1000.0
        gs.fetch_progress.add(1 << 20)
        agent._follow_generation()
        assert gs.phase is Phase.MOVING and cluster.arrivals == []
        # Nothing for longer than FETCH_STALL_S, then past MOVING's own deadline: failed.
        now[0] -= FETCH_STALL_S + 1
        gs.fetch_progress.add(0)
        gs.phase_since_s -= 1000.0
        agent._follow_generation()
        assert gs.phase is Phase.FAILED
        [(barrier, node, _)] = cluster.arrivals
        assert (barrier, node) == ("failed-3", "n0")
    finally:
        agent._probe_pool.shutdown()
