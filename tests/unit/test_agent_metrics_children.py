"""An agent's metric children are looked up once: `AgentMetrics.of` gives the child of the
agent's own labels (and any extra ones) that `labels(**kw)` gives, the same object every
time, and what is set on it is what the registry exports."""

from __future__ import annotations

from prometheus_client import generate_latest

from elasticpp.agent.metrics import AgentMetrics


def test_a_child_is_the_labelled_one_looked_up_once() -> None:
    m = AgentMetrics.create("n0", "job-a")
    child = m.of(m.generation)
    assert child is m.of(m.generation)
    assert child is m.generation.labels(node="n0", job_name="job-a")
    running = m.of(m.workers, state="running")
    assert running is m.workers.labels(node="n0", job_name="job-a", state="running")
    assert running is not m.of(m.workers, state="warm")


def test_what_is_set_on_a_child_is_exported() -> None:
    m = AgentMetrics.create("n0", "job-a")
    m.of(m.generation).set(7)
    m.of(m.workers, state="running").set(2)
    m.of(m.steps_total).inc()
    text = generate_latest(m.registry).decode()
    assert 'elasticpp_generation{job_name="job-a",node="n0"} 7.0' in text
    assert 'elasticpp_workers{job_name="job-a",node="n0",state="running"} 2.0' in text
    assert 'elasticpp_steps_total{job_name="job-a",node="n0"} 1.0' in text
