"""bench/gpu.py's arithmetic and its refusals, which run without a GPU: the agent's tax is a
mean interval (a periodic snapshot step counts), split into the engine's own time and the
rest; py-spy's collapsed stacks summed per thread and per frame; rounds each against their
own baseline; an unknown mode or no rounds refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import (
    LLAMA_1B,
    TAX_WARMUP,
    StackSampler,
    Timing,
    flops_per_token,
    matmul_params,
    mean_interval_s,
)
from elasticpp.plan.flops import forward_flops
from elasticpp.plan.specs import ModelSpec

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def test_the_bench_counts_flops_with_the_agents_function() -> None:
    spec = LLAMA_1B
    assert flops_per_token(spec) == forward_flops(ModelSpec.from_dict(spec)).train_per_token
    # 6 x the matmul parameters + causal attention's half of 12 x layers x seq x q width
    attention = 6.0 * spec["num_layers"] * spec["seq_len"] * spec["hidden_size"]
    assert flops_per_token(spec) == pytest.approx(6.0 * matmul_params(spec) + attention)


def test_the_tax_interval_is_the_mean_after_the_warm_up_slow_steps_included() -> None:
    warm = [0.0] + [10.0 + 0.1 * i for i in range(TAX_WARMUP)]  # start-up, then warm-up
    last = warm[-1]
    steady = [last + 0.1, last + 0.2, last + 0.7, last + 0.8]  # one 0.5 s snapshot step
    assert mean_interval_s(warm + steady) == pytest.approx((0.8 - 0.0) / 4)


def test_a_run_too_short_for_its_warm_up_is_refused() -> None:
    with pytest.raises(RuntimeError, match="too few"):
        mean_interval_s([float(i) for i in range(TAX_WARMUP)])


def test_the_engine_time_is_the_mean_over_the_same_steps() -> None:
    n = TAX_WARMUP + 5
    times = [float(i) for i in range(n)]
    engine = [9.0] * (TAX_WARMUP + 1) + [0.5, 0.5, 0.7, 0.7]  # the warm-up's steps left out
    timing = Timing.of(times, engine)
    assert timing.interval_s == pytest.approx(1.0)
    assert timing.engine_s == pytest.approx(0.6)


def test_the_median_leaves_a_stall_out_and_the_slowest_intervals_name_their_steps() -> None:
    times = [float(i) for i in range(TAX_WARMUP + 1)]  # 1 s apart through the warm-up
    last = times[-1]
    for gap in (0.1, 0.1, 2.0, 0.1, 0.3):
        last += gap
        times.append(last)
    timing = Timing.of(times, [0.1] * len(times))
    assert timing.median_s == pytest.approx(0.1)
    assert [i for i, _ in timing.slowest] == [TAX_WARMUP + 3, TAX_WARMUP + 5, TAX_WARMUP + 1]
    assert timing.slowest[0][1] == pytest.approx(2.0)
    assert timing.slowest_text().startswith(f"2.00 (step {TAX_WARMUP + 3})")


def test_collapsed_stacks_are_summed_per_thread_and_per_own_frame(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks-train.txt"
    stacks.write_text(
        "thread (1): MainThread;main (w.py:1);step (e.py:5) 6\n"
        "thread (1): MainThread;main (w.py:1);emit (w.py:9) 2\n"
        "thread (2): snapshot-writer;_run (s.py:3);step (e.py:5) 2\n"
        "not a sample line\n"
    )
    sampler = StackSampler(None, tmp_path)
    sampler.files["train"] = stacks
    text = sampler.summary()
    assert "train: 10 samples" in text
    assert " 80.0 %  thread (1): MainThread" in text
    assert " 20.0 %  thread (2): snapshot-writer" in text
    assert " 80.0 %  step (e.py:5)" in text  # own frame, whichever thread
    assert " 20.0 %  emit (w.py:9)" in text


def test_without_py_spy_nothing_is_sampled(tmp_path: Path) -> None:
    sampler = StackSampler(None, tmp_path)
    sampler.sample("train", 1)
    assert sampler.files == {} and sampler.summary() == ""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tax-modes", "time,hourly"], "--tax-modes: unknown hourly"),
        (["--tax-rounds", "0"], "--tax-rounds: 0: at least 1"),
    ],
)
def test_a_bad_flag_is_refused_naming_it(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert message in done.stderr


def test_rounds_are_each_against_their_own_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    import bench.gpu as gpu

    def timing(step_s: float) -> Timing:
        times = [step_s * i for i in range(TAX_WARMUP + 4)]
        return Timing.of(times, [step_s] * len(times))

    baselines = iter([0.1, 0.2])  # round 2's machine is twice as slow
    runs: list[tuple[str, str]] = []

    def train(spec: object, b: int, steps: int, work: Path, sampler: object, tag: str) -> Timing:
        runs.append(("train", tag))
        return timing(next(baselines))

    def agent(
        spec: object, b: int, steps: int, work: Path, mode: str, sampler: object, tag: str
    ) -> Timing:
        runs.append((mode, tag))
        return timing(0.11 if tag == "-r1" else 0.22)

    monkeypatch.setattr(gpu, "train_step_times", train)
    monkeypatch.setattr(gpu, "agent_step_times", agent)
    monkeypatch.setattr(gpu, "agent_plan", lambda *a: "pp=1 tp=1 dp=1")
    monkeypatch.setattr(gpu, "device_model", lambda: "h200")
    args = argparse.Namespace(tax_steps=20, py_spy=None, tax_rounds=2, tax_modes=["time"])
    out, text = gpu.tax_section(args, tmp_path)
    assert runs == [("train", "-r1"), ("time", "-r1"), ("train", "-r2"), ("time", "-r2")]
    assert [r["train_step_s"] for r in out["rounds"]] == pytest.approx([0.1, 0.2])
    assert "| 1 | agent, time | 0.110 | 1.10× |" in text
    assert "| 2 | agent, time | 0.220 | 1.10× |" in text  # not 2.20× against round 1's
