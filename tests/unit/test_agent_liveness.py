"""Who the agent probes, how often, and what it does with the answer (pure logic: a
constructed agent, a counting stand-in for the probe, a fake of the cluster's one call)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent import probe
from elasticpp.agent.kernel.limits import DEAD_RECHECK_S
from elasticpp.agent.leader import shell as leader_module
from elasticpp.agent.liveness import shell as liveness
from elasticpp.agent.liveness.step import paced_keep_s
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.agent.probe import ProbeResult
from elasticpp.cluster.records import GenerationRecord
from elasticpp.waiting import wait_until
from tests.agents import SPEC
from tests.agents import dp_plan as _plan
from tests.fakes import FakeCluster

NODES = [f"n{i:02d}" for i in range(16)]


class _Probes:
    """Stands in for `probe.check` (and the old `probe.answers`); counts who is probed."""

    def __init__(self, results: dict[str, ProbeResult] | None = None) -> None:
        self.calls: list[str] = []
        self.results = results or {}
        self.sequences: dict[str, list[ProbeResult]] = {}  # answers in turn, then `results`
        self.gate: threading.Event | None = None  # set: every probe waits for it to open
        self.gates: dict[str, threading.Event] = {}  # the probe of one address waits

    def check(self, address: str, **_: Any) -> ProbeResult:
        self.calls.append(address)
        for gate in (self.gate, self.gates.get(address)):
            if gate is not None:
                gate.wait()
        if self.sequences.get(address):
            return self.sequences[address].pop(0)
        return self.results.get(address, ProbeResult.SERVING)

    def answers(self, address: str, **_: Any) -> bool:
        return self.check(address) in (ProbeResult.SERVING, ProbeResult.NOT_SERVING)


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> _Probes:
    fake = _Probes()
    monkeypatch.setattr(probe, "check", fake.check, raising=False)
    monkeypatch.setattr(probe, "answers", fake.answers)
    return fake


def _cluster() -> FakeCluster:
    """The job's etcd, n00's term as leader on record (as n00 itself wrote it)."""
    cluster = FakeCluster()
    cluster.memory.put(cluster.keys.leader, "n00")
    return cluster


def _deposed(agent: Agent) -> list[str]:
    """The leaders whose term this agent deposed (n00's key deleted)."""
    return [] if agent.cluster.leader() == "n00" else ["n00"]


def settle(agent: Agent) -> None:
    """Wait for the probes that are out and give their verdicts, as the next cycles would."""

    def done() -> bool:
        agent.liveness.probes_done()
        return not agent.liveness.probes()

    assert wait_until(done, 10, interval_s=0.005)


def _agent(tmp_path: Path, node_id: str = "n00") -> Agent:
    agent = Agent(
        AgentConfig(node_id, ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path),
        SPEC,
        cluster=_cluster(),
    )
    agent.view.state.members = {n: {"address": f"{n}:1", "incarnation": f"i-{n}"} for n in NODES}
    agent.view.state.record = GenerationRecord(
        5,
        _plan(5).to_dict(),
        "n00",
        time.time(),
        extra={"nodes": {n: f"{n}:1" for n in NODES}},
    )
    agent.view.state.barriers = {
        "failed-5": {"n03": {"reason": "worker exited 1", "at": time.time()}}
    }
    return agent


def test_a_failed_generation_probes_each_suspect_once_per_recheck_period_not_every_tick(
    tmp_path: Path, probes: _Probes
) -> None:
    agent = _agent(tmp_path)
    agent.leader.state.replan_not_before_s = (
        time.monotonic() + 60
    )  # in re-plan backoff: the failure waits
    for _ in range(20):
        agent.leader.lead()
    settle(agent)
    for _ in range(20):
        agent.leader.lead()
    # Not the leader itself, not n03 (its report is proof of life): the 14 silent nodes,
    # once each, not 15 per tick.
    assert sorted(probes.calls) == [f"{n}:1" for n in NODES if n not in ("n00", "n03")]
    # Once the results are older than DEAD_RECHECK_S, each suspect is probed once more.
    agent.liveness.state.probe_cache = {
        k: (at - DEAD_RECHECK_S, r) for k, (at, r) in agent.liveness.state.probe_cache.items()
    }
    probes.calls.clear()
    for _ in range(20):
        agent.leader.lead()
    settle(agent)
    assert len(probes.calls) == 14
    agent.liveness.close()


def _aged(agent: Agent, by_s: float) -> None:
    """Every probe result as if it had come `by_s` earlier."""
    agent.liveness.state.probe_cache = {
        k: (at - by_s, r) for k, (at, r) in agent.liveness.state.probe_cache.items()
    }


def test_paced_keep_is_the_recheck_period_or_the_time_a_round_takes_at_the_pace() -> None:
    assert paced_keep_s(14, 100.0) == DEAD_RECHECK_S
    assert paced_keep_s(2047, 100.0) == pytest.approx(20.47)
    assert paced_keep_s(0, 100.0) == DEAD_RECHECK_S


def test_live_suspects_of_a_large_round_are_probed_again_at_the_pace_not_every_period(
    tmp_path: Path, probes: _Probes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 14 suspects at 4 probes a second: their SERVING answers are kept 3.5 s, not 2 s. (A
    # 2,048-node leader re-probed 2,047 live suspects every ~2 s while a failure waited.)
    monkeypatch.setattr(liveness, "PROBE_RECHECK_PER_S", 4.0)
    agent = _agent(tmp_path)
    agent.leader.state.replan_not_before_s = (
        time.monotonic() + 60
    )  # in re-plan backoff: the failure waits
    agent.leader.lead()
    settle(agent)
    assert len(probes.calls) == 14
    probes.calls.clear()
    _aged(agent, DEAD_RECHECK_S + 0.1)
    for _ in range(5):
        agent.leader.lead()
    settle(agent)
    assert probes.calls == []
    _aged(agent, 1.5)  # 3.6 s after the round: past 14 / 4
    for _ in range(5):
        agent.leader.lead()
    settle(agent)
    assert len(probes.calls) == 14
    agent.liveness.close()


def test_only_live_answers_are_kept_past_the_recheck_period(
    tmp_path: Path, probes: _Probes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "PROBE_RECHECK_PER_S", 4.0)
    probes.results["n05:1"] = ProbeResult.DEAD
    probes.results["n06:1"] = ProbeResult.NOT_SERVING
    agent = _agent(tmp_path)
    agent.liveness.probe(NODES)  # 15 probes: a SERVING answer is kept 3.75 s
    settle(agent)
    keep = agent.liveness.state.probe_keep
    assert set(keep) == {(n, f"i-{n}") for n in NODES if n not in ("n00", "n05", "n06")}
    assert all(k == pytest.approx(3.75) for k in keep.values())
    assert not agent.liveness.state.round_keep  # nothing left of the round
    agent.liveness.close()


def test_a_newly_failed_generation_probes_its_suspects_afresh(
    tmp_path: Path, probes: _Probes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "PROBE_RECHECK_PER_S", 4.0)
    agent = _agent(tmp_path)
    agent.leader.state.replan_not_before_s = time.monotonic() + 60
    agent.leader.lead()
    settle(agent)
    probes.calls.clear()
    _aged(agent, DEAD_RECHECK_S + 0.1)  # kept (3.5 s) for generation 5's failure, which waits
    agent.leader.lead()
    settle(agent)
    assert probes.calls == []
    # Generation 6 is planned and fails too: the answers about generation 5 are not reused.
    agent.view.state.record = GenerationRecord(
        6, _plan(6).to_dict(), "n00", time.time(), extra={"nodes": {n: f"{n}:1" for n in NODES}}
    )
    agent.view.state.barriers = {
        "failed-6": {"n03": {"reason": "worker exited 1", "at": time.time()}}
    }
    agent.leader.lead()
    settle(agent)
    assert len(probes.calls) == 14
    agent.liveness.close()


def test_a_new_incarnation_is_probed_without_waiting_for_the_old_ones_result_to_expire(
    tmp_path: Path, probes: _Probes
) -> None:
    agent = _agent(tmp_path)
    assert agent.liveness.probe(["n05"]) == {}  # started; its result comes with a later cycle
    settle(agent)
    assert agent.liveness.probe(["n05"]) == {"n05": ProbeResult.SERVING}
    agent.view.state.members["n05"]["incarnation"] = "restarted"
    assert agent.liveness.probe(["n05"]) == {}
    settle(agent)
    assert probes.calls == ["n05:1", "n05:1"]
    agent.liveness.close()


def test_a_suspect_that_answers_not_serving_is_unhealthy_not_dead(
    tmp_path: Path, probes: _Probes
) -> None:
    probes.results = {"n07:1": ProbeResult.NOT_SERVING, "n08:1": ProbeResult.DEAD}
    agent = _agent(tmp_path)
    agent.liveness.confirm_dead(["n07", "n08", "n09"])
    settle(agent)
    assert agent.liveness.state.dead == {"n08": "i-n08"}
    assert agent.liveness.state.unhealthy == {"n07": "i-n07"}
    agent.liveness.close()


def test_a_suspect_silent_once_is_probed_again_and_its_answer_is_the_verdict(
    tmp_path: Path, probes: _Probes
) -> None:
    """A probe unanswered within its budget (a healthy node on a saturated machine) is
    followed by a second one before any verdict: answered, the node is alive; silent again,
    it is dead. (2,047 suspects probed on one overloaded machine: a healthy node's single
    silent probe had it planned out and taken back a generation later.)"""
    probes.sequences = {
        "n04:1": [ProbeResult.SILENT, ProbeResult.SERVING],
        "n05:1": [ProbeResult.SILENT, ProbeResult.NOT_SERVING],
        "n06:1": [ProbeResult.SILENT, ProbeResult.SILENT],
    }
    agent = _agent(tmp_path)
    agent.liveness.confirm_dead(["n04", "n05", "n06", "n07"])
    settle(agent)
    assert sorted(probes.calls) == ["n04:1", "n04:1", "n05:1", "n05:1", "n06:1", "n06:1", "n07:1"]
    assert agent.liveness.state.dead == {"n06": "i-n06"}
    assert agent.liveness.state.unhealthy == {"n05": "i-n05"}
    assert agent.liveness.state.silent_once == set()
    assert {
        n for (n, _), (_, r) in agent.liveness.state.probe_cache.items() if r is ProbeResult.DEAD
    } == {"n06"}
    agent.liveness.close()


@pytest.mark.timeout(30)
def test_a_round_of_serving_answers_wakes_the_loop_once_not_per_answer(
    tmp_path: Path, probes: _Probes
) -> None:
    """A leader woken by each of 2,047 answers took ~2,000 turns a round, each going over
    every suspect. SERVING answers wake it when the round ends; an answer that needs a look
    (here NOT_SERVING) wakes it at once."""
    agent = _agent(tmp_path)
    held = {f"n{i:02d}:1": threading.Event() for i in (4, 5, 6)}
    probes.gates = dict(held)
    probes.results = {"n05:1": ProbeResult.NOT_SERVING}
    woken = agent.wake
    woken.clear()
    try:
        agent.liveness.confirm_dead(["n04", "n05", "n06", "n07", "n08"])
        assert wait_until(lambda: agent.liveness.probes()[("n08", "i-n08")], 10)
        assert agent.liveness.probes()[("n07", "i-n07")] and not woken.is_set()
        held["n04:1"].set()
        assert wait_until(lambda: agent.liveness.probes()[("n04", "i-n04")], 10)
        assert not woken.is_set()  # SERVING, and two probes still out
        held["n05:1"].set()
        assert wait_until(woken.is_set, 10)  # NOT_SERVING: a verdict to give now
        woken.clear()
        held["n06:1"].set()
        assert wait_until(woken.is_set, 10)  # the round's last answer
    finally:
        for gate in held.values():
            gate.set()
    settle(agent)
    assert agent.liveness.state.unhealthy == {"n05": "i-n05"} and agent.liveness.state.dead == {}
    agent.liveness.close()


@pytest.mark.timeout(30)
def test_the_leader_waits_for_the_second_look_at_a_silent_suspect(
    tmp_path: Path, probes: _Probes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second probe of a silent suspect belongs to the first round: the leader's step
    waits for it, so it neither plans around a live node nor keeps a dead one in."""
    steps: list[Any] = []
    monkeypatch.setattr(leader_module, "leader_step", lambda ls, obs: steps.append(obs) or [])
    probes.sequences = {"n09:1": [ProbeResult.SILENT]}
    probes.results = {"n09:1": ProbeResult.SILENT}
    agent = _agent(tmp_path)
    agent.leader.lead()  # the first round: only this thread starts a second look
    assert agent.liveness.probes() and steps == []
    assert wait_until(lambda: all(agent.liveness.probes().values()), 10)
    gate = probes.gates["n09:1"] = threading.Event()  # the second look is held open
    try:
        agent.leader.lead()  # the first verdicts; the second look at n09 starts
        agent.leader.lead()
        assert steps == [] and agent.liveness.state.dead == {}
        assert ("n09", "i-n09") in agent.liveness.probes()
        assert wait_until(lambda: probes.calls.count("n09:1") == 2, 10, interval_s=0.005)
        agent.leader.lead()
        assert steps == [] and agent.liveness.state.dead == {}
    finally:
        gate.set()
    settle(agent)
    agent.leader.lead()
    assert agent.liveness.state.dead == {"n09": "i-n09"}
    assert len(steps) == 1 and "n09" in steps[0].view.dead
    agent.liveness.close()


@pytest.mark.timeout(30)
def test_the_leader_never_waits_on_a_probe_and_replans_with_the_verdicts(
    tmp_path: Path, probes: _Probes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes of a failed generation's suspects are out (held open here): the leader's cycle
    returns at once (its loop goes on ticking and renewing its lease) and its step waits;
    the verdicts in, the step sees the dead node. (A leader that waited on its loop for the
    probes of every silent node of a 1,024-node job stalled 3-4 s a turn and lost its lease.)"""
    steps: list[Any] = []
    monkeypatch.setattr(leader_module, "leader_step", lambda ls, obs: steps.append(obs) or [])
    probes.gate = threading.Event()
    probes.results = {"n09:1": ProbeResult.DEAD}
    agent = _agent(tmp_path)
    woken = agent.wake
    woken.clear()
    agent.leader.lead()  # would hang here if the cycle waited on its probes
    assert steps == [] and agent.liveness.probes() and agent.liveness.state.dead == {}
    assert not woken.is_set()
    probes.gate.set()
    assert wait_until(woken.is_set, 10, interval_s=0.005)  # a result wakes the loop
    settle(agent)
    agent.leader.lead()
    assert agent.liveness.state.dead == {"n09": "i-n09"}
    assert len(steps) == 1 and "n09" in steps[0].view.dead
    agent.liveness.close()


@pytest.mark.timeout(30)
def test_a_round_of_probes_longer_than_the_recheck_period_ends_and_the_leader_steps(
    tmp_path: Path, probes: _Probes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thousands of suspects take longer to probe than DEAD_RECHECK_S: the first answers'
    results expire while the round is still out. They are not probed anew before the
    round ends (else it never would, and the leader's step would wait for ever)."""
    steps: list[Any] = []
    monkeypatch.setattr(leader_module, "leader_step", lambda ls, obs: steps.append(obs) or [])
    probes.gates = {"n15:1": threading.Event()}  # the round's last answer is slow
    agent = _agent(tmp_path)
    agent.leader.lead()
    assert wait_until(
        lambda: len(agent.liveness.state.probe_cache) == 13 or agent.liveness.probes_done(), 10
    )
    agent.liveness.state.probe_cache = {  # DEAD_RECHECK_S has passed for the first answers
        k: (at - DEAD_RECHECK_S, r) for k, (at, r) in agent.liveness.state.probe_cache.items()
    }
    for _ in range(5):
        agent.leader.lead()
    assert len(probes.calls) == 14 and steps == []  # no new round while this one is out
    probes.gates["n15:1"].set()
    settle(agent)
    agent.leader.lead()
    assert len(steps) == 1  # the first round's verdicts are in: the step is taken
    # The expired ones are probed anew: held open, so that they are still out when looked
    # at (an answer that came at once could end the round before the assertion).
    probes.gate = threading.Event()
    agent.leader.lead()
    assert len(steps) == 2  # later rounds (the expired ones, started now) are not waited for
    assert agent.liveness.probes()
    probes.gate.set()
    settle(agent)
    agent.liveness.close()


def _follower(tmp_path: Path) -> Agent:
    agent = _agent(tmp_path, "n05")
    agent.view.state.leader = "n00"
    agent.follower.state.reported = 5  # this node reported generation 5 failed (etcd has it)
    agent.liveness.state.suspect_since = {
        5: time.monotonic() - 10
    }  # the failure waits for a new plan
    return agent


def test_a_follower_suspects_the_leader_only_of_a_failure_it_reported_itself(
    tmp_path: Path, probes: _Probes
) -> None:
    """A follower no longer reads the other nodes' failure reports (N² watch events a
    transition): it probes the leader over a failure of its own, reported or pending."""
    probes.results = {"n00:1": ProbeResult.DEAD}
    agent = _follower(tmp_path)
    agent.follower.state.reported = 4  # another node's report of generation 5 is not seen here
    agent.watch_leader()
    assert probes.calls == [] and _deposed(agent) == []
    agent.follower.state.pending_failures[5] = {"reason": "worker exited 1"}  # not in etcd yet
    agent.liveness.state.suspect_since = {5: time.monotonic() - 10}
    agent.watch_leader()
    assert probes.calls == ["n00:1"]
    assert _deposed(agent) == ["n00"]
    agent.liveness.close()


def test_a_follower_does_not_depose_a_leader_whose_member_key_is_absent(
    tmp_path: Path, probes: _Probes
) -> None:
    agent = _follower(tmp_path)
    del agent.view.state.members["n00"]  # re-registering after a lost lease: no address known
    agent.watch_leader()
    assert _deposed(agent) == []
    assert "n00" not in agent.liveness.state.dead
    agent.liveness.close()


@pytest.mark.parametrize(
    ("result", "deposed", "dead"),
    [
        (ProbeResult.SERVING, [], False),
        (ProbeResult.NOT_SERVING, ["n00"], False),
        (ProbeResult.DEAD, ["n00"], True),
    ],
)
def test_a_follower_deposes_the_leader_only_after_a_failed_probe(
    tmp_path: Path, probes: _Probes, result: ProbeResult, deposed: list[str], dead: bool
) -> None:
    probes.results = {"n00:1": result}
    agent = _follower(tmp_path)
    agent.watch_leader()
    assert probes.calls == ["n00:1"]
    assert _deposed(agent) == deposed
    assert ("n00" in agent.liveness.state.dead) is dead
    agent.liveness.close()


@pytest.mark.parametrize("second", [ProbeResult.SILENT, ProbeResult.SERVING])
def test_a_follower_deposes_a_silent_leader_only_when_the_next_probe_is_silent_too(
    tmp_path: Path, probes: _Probes, second: ProbeResult
) -> None:
    """The leader of a large job is its busiest node: one probe it leaves unanswered is
    probed again DEAD_RECHECK_S later, and only a second silence deposes its term."""
    probes.sequences = {"n00:1": [ProbeResult.SILENT, second]}
    agent = _follower(tmp_path)
    agent.watch_leader()
    assert probes.calls == ["n00:1"]
    assert _deposed(agent) == []
    agent.watch_leader()
    assert probes.calls == ["n00:1"]  # not before DEAD_RECHECK_S
    agent.liveness.state.leader_probed_s -= DEAD_RECHECK_S
    agent.watch_leader()
    assert probes.calls == ["n00:1", "n00:1"]
    silent = second is ProbeResult.SILENT
    assert _deposed(agent) == (["n00"] if silent else [])
    assert ("n00" in agent.liveness.state.dead) is silent
    assert agent.liveness.state.leader_silent is None
    agent.liveness.close()
