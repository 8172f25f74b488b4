"""MOVING's deadline while the state fetch runs: held while bytes arrive, not for ever
(pure logic: a constructed agent, a fetch that never ends, a progress record on a
fake clock, a fake of the cluster's one call); where the fetch finds its sources."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

from elasticpp.agent.follower.step import GenerationProgress, fetch_addresses
from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.kernel.limits import FETCH_STALL_S
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.cluster.records import GenerationRecord, node_fields
from elasticpp.plan import Plan
from elasticpp.store.resume import TransferProgress
from tests.agents import SPEC
from tests.agents import dp_plan as _plan
from tests.fakes import FakeCluster


def test_a_fetch_that_stops_receiving_bytes_no_longer_holds_movings_deadline(
    tmp_path: Path,
) -> None:
    cluster = FakeCluster()
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC, cluster=cluster
    )
    record = GenerationRecord(3, _plan(3).to_dict(), "n9", time.time(), resume_step=5)
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    agent.follower.state.gen = gs
    now = [time.monotonic()]
    progress = TransferProgress(clock=lambda: now[0])
    agent.follower.track_fetch(3, Future(), progress)  # a fetch in flight
    try:
        # Bytes keep arriving: the deadline is held, however long the phase has run.
        gs.phase_since_s -= 1000.0
        progress.add(1 << 20)
        agent.follower.step()
        assert gs.phase is Phase.MOVING and cluster.arrived() == []
        # Nothing for longer than FETCH_STALL_S, then past MOVING's own deadline: failed.
        now[0] -= FETCH_STALL_S + 1
        progress.add(0)
        gs.phase_since_s -= 1000.0
        agent.follower.step()
        assert gs.phase is Phase.FAILED
        [(barrier, node, _)] = cluster.arrived()
        assert (barrier, node) == ("failed-3", "n0")
    finally:
        agent.liveness.close()


def _planned(*nodes: str) -> GenerationRecord:
    plan = _plan(3).to_dict()  # ranks on n0; the others planned as spares
    fields = node_fields(plan, nodes, {n: f"i-{n}" for n in nodes})
    return GenerationRecord(3, plan, "n9", time.time(), resume_step=5, extra=fields)


def test_a_fetch_takes_sources_addresses_from_member_keys_unless_re_registered() -> None:
    record = _planned("n0", "n1")
    members = {
        "n0": {"address": "h0:1", "incarnation": "i-n0"},
        "n1": {"address": "h1:1", "incarnation": "i-n1-restarted"},  # not the planned agent
        "d": {"address": "hd:1", "incarnation": "i-d"},  # draining, outside the plan
    }
    assert fetch_addresses(record, members) == {"n0": "h0:1", "d": "hd:1"}


def test_a_fetch_from_a_source_without_an_address_fails_naming_it(tmp_path: Path) -> None:
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    gs = GenerationProgress(
        record=_planned("n0", "a"),
        plan=Plan.from_dict(_planned("n0", "a").plan),
        phase=Phase.MOVING,
    )
    units = SPEC.model.units
    resume = {
        "format_version": 2,
        "step": 5,
        "pieces": {PieceKey(u, 0, 1).filename: ["0" * 64, 10] for u in units},
        "reshard": dict.fromkeys(units, 1),
        "reshard_by_node": {},
        "nodes": ["a"],
        "by_node": {"n0": [[len(units), 0]]},
        "infos_by_node": {},
    }
    agent.view.state.members = {"a": {"address": "ha:1", "incarnation": "i-a-restarted"}}
    try:
        outcome = agent.follower.fetch(gs, resume)
    finally:
        agent.liveness.close()
    assert outcome.error is not None
    assert "StateUnavailableError: generation 3: no address of source(s) a" in outcome.error
