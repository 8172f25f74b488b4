"""`snapshot_when_busy`: with "skip", a periodic snapshot due while some rank's writer is still
busy is skipped by every rank alike, so the steps written are the same on every rank and
training does not wait for the disk; with "wait" (the default) every due step is written.

The state here is large (a 32,768-token vocabulary: ~50 MB of weights and moments on the
first stage) and a step is small, so the writer is busy for several steps after each
snapshot on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers import STEPS, run_snapshots


def _run(tmp_path: Path, when_busy: str) -> dict[int, set[int]]:
    written = run_snapshots(tmp_path, snapshot_every=1, snapshot_when_busy=when_busy)
    return {rank: set(steps) for rank, steps in written.items()}


@pytest.mark.timeout(300)
def test_skip_writes_the_same_steps_on_every_rank_and_skips_while_a_writer_is_busy(
    tmp_path: Path,
) -> None:
    written = _run(tmp_path, "skip")
    assert written[0] == written[1], written
    assert STEPS in written[0]  # the final state is always written
    assert len(written[0]) < STEPS, f"nothing was skipped: {sorted(written[0])}"


@pytest.mark.timeout(300)
def test_wait_writes_every_due_step(tmp_path: Path) -> None:
    written = _run(tmp_path, "wait")
    assert written[0] == written[1] == set(range(1, STEPS + 1))
