"""bench/steady.py's arithmetic: step intervals from per-step records, paired ratios, and the
agent's tax split into phases that add up to the whole."""

from __future__ import annotations

import pytest

from bench.steady import (
    PHASE_CONFIGS,
    Config,
    completion_times,
    ratio_summary,
    run_order,
    steady_interval_s,
    table,
    trained_to_the_end,
)


def test_a_step_completes_when_its_last_rank_or_node_reports_it() -> None:
    rows = [
        {"step": 1, "time": 10.5},
        {"step": 0, "time": 10.0},
        {"step": 0, "time": 10.2},
        {"step": 1, "time": 10.4},
    ]
    assert completion_times(rows) == [10.2, 10.5]


def test_the_steady_interval_is_the_mean_step_after_the_warm_up_slow_steps_included() -> None:
    # The first gap is start-up; the 0.5 s one is a periodic snapshot, which a median hid.
    times = [0.0, 5.0, 5.1, 5.2, 5.7, 5.8]
    assert steady_interval_s(times, warmup=1) == pytest.approx(0.2)
    with pytest.raises(RuntimeError, match="too few"):
        steady_interval_s([0.0, 1.0], warmup=1)


def _never(_: object) -> list[float]:
    raise AssertionError("not run")


def test_two_configs_run_mirrored_so_a_steady_drift_cancels_and_more_rotate() -> None:
    a, b = Config("dp=2", "A", _never), Config("dp=2", "B", _never, "A", 1)
    names = [[c.name for c in run_order([a, b], rep)] for rep in range(3)]
    assert names == [["A", "B", "B", "A"], ["B", "A", "A", "B"], ["A", "B", "B", "A"]]
    # A machine slowing 1 % a run: each config's mean position is the same, so is its speed.
    slow: dict[str, list[float]] = {name: [] for name in "AB"}
    for n, name in enumerate(names[0]):
        slow[name].append(1.0 + 0.01 * n)
    assert sum(slow["A"]) == pytest.approx(sum(slow["B"]))
    three = [Config("agent", n, _never) for n in "XYZ"]
    assert [[c.name for c in run_order(three, r)] for r in range(3)] == [
        list("XYZ"),
        list("YZX"),
        list("ZXY"),
    ]


def test_a_table_of_some_groups_has_no_phase_rows() -> None:
    a, b = Config("dp=2", "A", _never), Config("dp=2", "B", _never, "A", 1)
    # `--groups dp`: the agent's configs were not run, their lists are empty.
    tput = {"A": [100.0, 110.0], "B": [105.0, 110.0]} | {n: [] for n in PHASE_CONFIGS}
    out = table("compute", [a, b], tput, seq_len=128)
    assert "1.02× [1.00–1.05] of A" in out
    assert "by phase" not in out


def test_ratios_pair_the_runs_of_the_same_repetition() -> None:
    assert ratio_summary([100.0, 50.0, 90.0], [100.0, 100.0, 90.0]) == (1.0, 0.5, 1.0)


def test_the_agents_tax_by_phase_adds_up_to_the_agents_step_minus_trains() -> None:
    def never(_: object) -> list[float]:
        raise AssertionError("not run")

    names = PHASE_CONFIGS
    reps = [[0.04, 0.05, 0.045, 0.07, 0.08], [0.08, 0.10, 0.09, 0.14, 0.16]]  # a slow repetition
    configs = [
        Config("agent", n, never, None if i == 0 else names[0], i) for i, n in enumerate(names)
    ]
    tput = {n: [32 * 16 / r[i] for r in reps] for i, n in enumerate(names)}
    out = table("small", configs, tput, seq_len=32)
    phase_rows = out.split("the agent's tax, by phase")[1].splitlines()[2:]
    values = [float(r.split("|")[2].split()[0]) for r in phase_rows]
    # Each phase is taken within a repetition, then the median (of 2: the mean) over them.
    assert values[:4] == pytest.approx([0.015, 0.0075, 0.0225, 0.015])
    assert sum(values[:4]) == pytest.approx(values[4]) == pytest.approx(0.06)


def test_a_baseline_crashed_after_its_last_step_counts_one_stopped_early_does_not() -> None:
    rows = [{"step": s, "rank": r} for s in range(5) for r in (0, 1)]
    assert trained_to_the_end(rows, 5)
    assert not trained_to_the_end(rows[:-2], 5)  # no record of step 4
    assert not trained_to_the_end([], 5)
