"""The soak's curve check replays the layouts its kept curve was trained in (bench/soak.py):
which generation keeps each step, and the runs of steps that are replayed one after another;
and the step completions its stalls are measured on."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from bench.soak import (
    DRIFT_LIMIT,
    REPLAY_FLOOR,
    REPLAY_JUMP,
    REPLAY_WINDOW,
    completion_times,
    kept_runs,
    replay_errors,
)


def _row(step: int, generation: int, layout: str, node: str = "n0") -> dict[str, Any]:
    return {"step": step, "generation": generation, "layout": layout, "node": node}


def test_the_newest_generation_that_trained_a_step_keeps_it() -> None:
    """Generation 2 trained steps 0-5, failed, and generation 3 resumed at step 4: steps 4
    and 5 are generation 3's, trained in its layout; every node's row of a step counts once."""
    rows = [_row(s, 2, "pp=1,tp=1,dp=3", n) for s in range(6) for n in ("n0", "n1")]
    rows += [_row(s, 3, "pp=2,tp=1,dp=1") for s in range(4, 9)]
    assert kept_runs(rows) == [(0, 4, "pp=1,tp=1,dp=3"), (4, 9, "pp=2,tp=1,dp=1")]


def test_two_generations_of_one_layout_are_two_runs() -> None:
    """A recovery into the same layout resumes from a saved state as well: it is replayed
    as a run of its own (the resume is part of what the replay checks)."""
    rows = [_row(s, 1, "pp=1,tp=1,dp=3") for s in range(3)]
    rows += [_row(s, 2, "pp=1,tp=1,dp=3") for s in range(2, 5)]
    assert kept_runs(rows) == [(0, 2, "pp=1,tp=1,dp=3"), (2, 5, "pp=1,tp=1,dp=3")]


def test_a_generation_older_rows_of_which_come_back_after_a_newer_is_not_merged() -> None:
    """Steps kept by one generation but not contiguous (a gap another generation kept) are
    separate runs; a gap nobody kept shows as runs that do not follow on."""
    rows = [_row(0, 1, "a"), _row(1, 2, "b"), _row(2, 1, "a")]
    assert kept_runs(rows) == [(0, 1, "a"), (1, 2, "b"), (2, 3, "a")]
    rows = [_row(0, 1, "a"), _row(2, 1, "a")]
    assert kept_runs(rows) == [(0, 1, "a"), (2, 3, "a")]


@pytest.mark.parametrize("rows", [[]])
def test_no_rows_no_runs(rows: list[dict[str, Any]]) -> None:
    assert kept_runs(rows) == []


def test_a_stall_is_the_pause_in_training_and_recomputed_steps_are_training() -> None:
    """Generation 1 trains steps 0-9 (0.1 s each), a fault at 1.0 s, generation 2 resumes at
    step 5 at 3.0 s. Only the newest generation's times gave step 4 -> 5 a gap of 2.6 s (the
    steps 5-9 trained before the fault inside the stall) and left nothing between the fault
    and a second fault at 3.2 s once steps 5 and 6 were trained again later."""
    rows = [
        {"step": s, "generation": 1, "time": 0.1 * s, "node": n}
        for s in range(10)
        for n in ("n0", "n1")
    ]
    rows += [{"step": s, "generation": 2, "time": 3.0 + 0.1 * (s - 5)} for s in range(5, 8)]
    times = completion_times(rows)
    assert len(times) == 13  # one per (step, generation), however many nodes report it
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(times)]
    assert max(gaps) == 2.1  # the last step before the fault to the first after it
    assert [t for t in times if 1.0 < t <= 3.2] == [3.0, 3.1, 3.2]


def _curves(
    runs: list[tuple[int, int, str]], apart: dict[int, float]
) -> tuple[dict[int, float], dict[int, float]]:
    """A replayed curve of loss 2.0 and a kept one `apart[s]` (relative) from it."""
    steps = range(runs[0][0], runs[-1][1])
    replay = {s: 2.0 for s in steps}
    return {s: 2.0 * (1.0 + apart.get(s, 0.0)) for s in steps}, replay


RUNS = [(0, 40, "a"), (40, 90, "b"), (90, 120, "a")]


def test_noise_that_compounds_without_a_jump_at_a_resume_passes_however_far_it_grows() -> None:
    """A 10,380-step soak's kept curve was 8.5e-5 from its replay by the end, growing step by
    step inside runs (its first step past 1e-5 was 48 steps into one): noise, not a wrong
    resume, which a check of every step against 1e-5 called a failure."""
    apart = {s: 1e-8 * 1.1**s for s in range(120)}  # 1e-8 at step 0, ~9e-4 at step 119
    curve, replay = _curves(RUNS, apart)
    errors, seams = replay_errors(curve, replay, RUNS)
    assert errors == []
    assert [first for first, _, _ in seams] == [0, 40, 90]
    _, before, after = seams[2]
    assert before == pytest.approx(apart[89], rel=1e-9)
    assert after == pytest.approx(apart[90 + REPLAY_WINDOW - 1], rel=1e-9)


def test_a_resume_from_a_wrong_state_jumps_and_fails_however_much_noise_came_before() -> None:
    for noise in (1e-8, 1e-6, 5e-5):
        apart = {s: noise * (s + 1) / 90 for s in range(120)}  # grown to `noise` by step 89
        apart.update({s: 3e-3 for s in range(90, 120)})  # the resume at step 90 was wrong
        curve, replay = _curves(RUNS, apart)
        errors, _ = replay_errors(curve, replay, RUNS)
        assert len(errors) == 1 and errors[0].startswith("step 90: resumed 3.0e-03"), noise
    # Under the floor nothing is a jump; at the floor's edge, REPLAY_JUMP times decides.
    curve, replay = _curves(RUNS, {s: 1e-9 if s < 40 else REPLAY_FLOOR * 0.9 for s in range(120)})
    assert replay_errors(curve, replay, RUNS)[0] == []
    before = 2e-5
    for after, fails in ((before * REPLAY_JUMP * 0.9, False), (before * REPLAY_JUMP * 1.1, True)):
        apart = {s: before * (s + 1) / 40 if s < 40 else after for s in range(120)}
        curve, replay = _curves(RUNS, apart)
        assert bool(replay_errors(curve, replay, RUNS)[0]) is fails


def test_the_first_run_agrees_from_step_0_and_no_step_may_pass_the_drift_limit() -> None:
    curve, replay = _curves(RUNS, {0: 2 * REPLAY_FLOOR})
    [error] = replay_errors(curve, replay, RUNS)[0]
    assert error.startswith("step 0: resumed")
    apart = {s: min(DRIFT_LIMIT / 2, 1e-6 * 1.2**s) for s in range(120)}
    apart[100] = 2 * DRIFT_LIMIT  # mid-run, no resume there
    curve, replay = _curves(RUNS, apart)
    [error] = replay_errors(curve, replay, RUNS)[0]
    assert error.startswith("step 100:") and f"more than {DRIFT_LIMIT} apart" in error
