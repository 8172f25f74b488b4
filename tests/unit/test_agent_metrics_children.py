"""An agent's metric children are looked up once: `AgentMetrics.of` gives the child of the
agent's own labels (and any extra ones) that `labels(**kw)` gives, the same object every
time, and what is set on it is what the registry exports."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.node import Agent, AgentConfig
from tests.agents import SPEC


def test_a_child_is_the_labelled_one_looked_up_once() -> None:
    m = AgentMetrics.create("n0", "job-a")
    child = m.of(m.generation)
    assert child is m.of(m.generation)
    assert child is m.generation.labels(node_id="n0", job_name="job-a")
    running = m.of(m.workers, state="running")
    assert running is m.workers.labels(node_id="n0", job_name="job-a", state="running")
    assert running is not m.of(m.workers, state="warm")


def test_what_is_set_on_a_child_is_exported() -> None:
    m = AgentMetrics.create("n0", "job-a")
    m.of(m.generation).set(7)
    m.of(m.workers, state="running").set(2)
    m.of(m.steps_total).inc()
    text = generate_latest(m.registry).decode()
    assert 'elasticpp_generation{job_name="job-a",node_id="n0"} 7.0' in text
    assert 'elasticpp_workers{job_name="job-a",node_id="n0",state="running"} 2.0' in text
    assert 'elasticpp_steps_total{job_name="job-a",node_id="n0"} 1.0' in text


def test_the_gauges_are_set_again_only_when_their_values_change(tmp_path: Path) -> None:
    # A view refresh (every watch event and quiet tick) set every gauge, 12 a turn, whether
    # or not anything had changed: a visible share of an idle agent's turn.
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    sets: list[str] = []
    for name in ("etcd_up", "members", "generation"):
        child = agent.metrics.of(getattr(agent.metrics, name))
        real = child.set
        child.set = lambda v, name=name, real=real: (sets.append(name), real(v))  # type: ignore[method-assign]
    agent.update_gauges()
    assert sorted(sets) == ["etcd_up", "generation", "members"]
    sets.clear()
    agent.update_gauges()
    assert sets == []  # nothing changed: nothing set
    agent.view.state.etcd_ok = not agent.view.state.etcd_ok
    agent.update_gauges()
    assert "etcd_up" in sets
    up = int(agent.view.state.etcd_ok)
    text = generate_latest(agent.metrics.registry).decode()
    assert f'elasticpp_etcd_up{{job_name="{SPEC.name}",node_id="n0"}} {up}.0' in text


def test_only_the_gauges_whose_values_changed_are_set(tmp_path: Path) -> None:
    # One change (the generation) set all twelve gauges again: on every node at every
    # transition, and at every step where the safe step moves.
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    agent.update_gauges()
    sets: list[str] = []
    m = agent.metrics
    for name in ("etcd_up", "members", "is_leader", "generation", "safe_step"):
        child = m.of(getattr(m, name))
        real = child.set
        child.set = lambda v, name=name, real=real: (sets.append(name), real(v))  # type: ignore[method-assign]
    for state in ("warm", "running"):
        child = m.of(m.workers, state=state)
        real = child.set
        child.set = lambda v, state=state, real=real: (sets.append(state), real(v))  # type: ignore[method-assign]
    agent.view.state.etcd_ok = not agent.view.state.etcd_ok
    agent.update_gauges()
    assert sets == ["etcd_up"]


def test_etcd_up_is_set_again_after_an_outage_with_nothing_else_changed(tmp_path: Path) -> None:
    # The outage sets the gauge to 0 apart from `update_gauges`: the next update, whose
    # values equal those it last set, must still set it back to 1.
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    agent.view.state.etcd_ok = True
    agent.update_gauges()
    agent.etcd_down(RuntimeError("connection refused"))
    text = generate_latest(agent.metrics.registry).decode()
    assert f'elasticpp_etcd_up{{job_name="{SPEC.name}",node_id="n0"}} 0.0' in text
    agent.view.state.etcd_ok = True  # the next refresh reached etcd
    agent.update_gauges()
    text = generate_latest(agent.metrics.registry).decode()
    assert f'elasticpp_etcd_up{{job_name="{SPEC.name}",node_id="n0"}} 1.0' in text
