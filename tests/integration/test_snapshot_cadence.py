"""The time rule for periodic snapshots (`snapshot_every_s`, the agent's default): every rank
takes a snapshot on the same steps, only on steps divisible by `snapshot_align` (the anchors
replication sends), once every rank's writer has been free for the interval; the final state
is always written. Real worker processes over gloo."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elasticpp.plan import ModelSpec
from tests.workers import run_snapshots

MODEL = ModelSpec("t4", num_layers=4, hidden_size=32, num_heads=4, vocab_size=256, seq_len=16)
STEPS = 40


def _run(tmp_path: Path, every_s: float, align: int) -> tuple[dict[int, list[int]], float]:
    """The steps each rank wrote, and the run's wall time (the workers' start included)."""
    started = time.monotonic()
    written = run_snapshots(
        tmp_path,
        MODEL,
        STEPS,
        snapshot_every=0,
        snapshot_every_s=every_s,
        snapshot_align=align,
    )
    return written, time.monotonic() - started


@pytest.mark.timeout(300)
def test_with_an_interval_shorter_than_a_step_snapshots_follow_each_other_on_aligned_steps(
    tmp_path: Path,
) -> None:
    written, _ = _run(tmp_path, every_s=1e-6, align=3)
    assert written[0] == written[1], written
    *periodic, final = written[0]
    assert final == STEPS
    assert periodic and all(step % 3 == 0 for step in periodic), periodic
    # Each one waits until the write before it has ended (training never waits for it), so
    # on a fast disk every aligned step is one and on a slow one some are passed over.
    assert periodic[0] == 3, periodic


@pytest.mark.timeout(300)
def test_an_interval_longer_than_the_run_writes_only_the_final_state(tmp_path: Path) -> None:
    written, _ = _run(tmp_path, every_s=3600.0, align=1)
    assert written[0] == written[1] == [STEPS]


@pytest.mark.timeout(300)
def test_timed_snapshots_are_the_same_steps_on_every_rank_and_no_more_than_the_interval_allows(
    tmp_path: Path,
) -> None:
    every_s = 0.2
    written, wall = _run(tmp_path, every_s=every_s, align=2)
    assert written[0] == written[1], written
    periodic = written[0][:-1]
    assert written[0][-1] == STEPS
    assert all(step % 2 == 0 for step in periodic), periodic
    # Each periodic snapshot comes at least `every_s` after the previous one was taken (or
    # after the start), so the run's wall time bounds their number.
    assert len(periodic) <= wall / every_s, (periodic, wall)
