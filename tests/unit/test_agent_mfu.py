"""The MFU an agent reports (elasticpp.agent): the job spec's `peak_tflops`, the model
TFLOP/s and MFU of a node's newest steps (durabilitystep), and the gauges: `elasticpp_mfu`
absent, not 0, where no peak is known, and both dropped while no rank trains."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client import generate_latest

from elasticpp.agent.durability.step import (
    THROUGHPUT_STEPS,
    DurabilityState,
    StepObservation,
    durability_on_step,
)
from elasticpp.agent.jobspec import parse_job_spec
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.errors import ConfigError

BASE_SPEC = {
    "name": "j", "model": "tiny", "global_batch": 4, "micro_batch": 2, "steps": 10, "seed": 0,
    "min_nodes": 1, "max_nodes": 1,
}  # fmt: skip


@pytest.mark.parametrize("bad", [0, -1, "989", True, math.inf, math.nan, [989]])
def test_a_job_specs_peak_tflops_must_be_a_positive_number(bad: object) -> None:
    with pytest.raises(ConfigError, match="peak_tflops"):
        parse_job_spec(BASE_SPEC | {"peak_tflops": bad})


def test_a_job_specs_peak_tflops_is_optional() -> None:
    assert parse_job_spec(BASE_SPEC).peak_tflops is None
    assert parse_job_spec(BASE_SPEC | {"peak_tflops": 400}).peak_tflops == 400.0


def _obs(step: int, seconds: float, peak: float | None, generation: int = 1) -> StepObservation:
    return StepObservation(
        step=step, generation=generation, loss=1.0, lr=1e-3, grad_norm=1.0,
        step_seconds=seconds, layout="pp=1,tp=1,dp=1", node_id="n", wall_s=0.0,
        model_flops=2e12, peak_flops=peak,
    )  # fmt: skip


def _metrics(actions: list[Any]) -> Any:
    return actions[0]


def test_model_tflops_is_the_flops_over_the_time_of_the_newest_steps() -> None:
    state = DurabilityState()
    m = _metrics(durability_on_step(state, _obs(0, 1.0, 8e12)))
    assert (m.model_tflops, m.mfu) == (pytest.approx(2.0), pytest.approx(0.25))
    m = _metrics(durability_on_step(state, _obs(1, 3.0, 8e12)))
    assert m.model_tflops == pytest.approx(4e12 / 4.0 / 1e12)
    for step in range(2, 2 + THROUGHPUT_STEPS):  # the slow steps leave the window
        m = _metrics(durability_on_step(state, _obs(step, 0.5, 8e12)))
    assert m.model_tflops == pytest.approx(4.0)
    assert m.mfu == pytest.approx(0.5)
    # A new generation (another layout) starts afresh.
    m = _metrics(durability_on_step(state, _obs(20, 2.0, 8e12, generation=2)))
    assert m.model_tflops == pytest.approx(1.0)


def test_without_a_peak_there_is_tflops_and_no_mfu() -> None:
    m = _metrics(durability_on_step(DurabilityState(), _obs(0, 1.0, None)))
    assert m.model_tflops == pytest.approx(2.0) and m.mfu is None


def test_the_mfu_gauge_is_absent_until_set_and_dropped_when_no_rank_trains() -> None:
    metrics = AgentMetrics.create("n0", "job")
    metrics.of(metrics.model_tflops).set(3.0)
    scraped = generate_latest(metrics.registry).decode()
    assert 'elasticpp_model_tflops{job_name="job",node_id="n0"} 3.0' in scraped
    assert "\nelasticpp_mfu{" not in scraped  # a CPU slot without a peak: absent, not 0
    metrics.of(metrics.mfu).set(0.4)
    assert (
        'elasticpp_mfu{job_name="job",node_id="n0"} 0.4'
        in generate_latest(metrics.registry).decode()
    )
    metrics.drop(metrics.mfu)
    metrics.drop(metrics.model_tflops)
    metrics.drop(metrics.mfu)  # twice: nothing to remove
    scraped = generate_latest(metrics.registry).decode()
    assert "\nelasticpp_mfu{" not in scraped and "\nelasticpp_model_tflops{" not in scraped
    metrics.of(metrics.mfu).set(0.5)  # the next generation's steps bring it back
    assert (
        'elasticpp_mfu{job_name="job",node_id="n0"} 0.5'
        in generate_latest(metrics.registry).decode()
    )
