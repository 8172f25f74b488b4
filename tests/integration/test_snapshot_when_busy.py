"""`snapshot_when_busy`: with "skip", a periodic snapshot due while some rank's writer is still
busy is skipped by every rank alike, so the steps written are the same on every rank and
training does not wait for the disk; with "wait" (the default) every due step is written.

The state here is large (a 32,768-token vocabulary: ~50 MB of weights and moments on the
first stage) and a step is small, so the writer is busy for several steps after each
snapshot on any machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elasticpp.plan import ClusterSpec, Layout, ModelSpec, build_plan, load_device_spec
from elasticpp.train.config import TrainConfig
from elasticpp.train.launch import kill_all, run_local, spawn_workers

MODEL = ModelSpec("wide", num_layers=2, hidden_size=128, num_heads=4, vocab_size=32768, seq_len=8)
STEPS = 8


def run_snapshots(
    tmp_path: Path, model: ModelSpec = MODEL, steps: int = STEPS, **rule: Any
) -> dict[int, list[int]]:
    """Train `model` at pp=2 over real workers with the snapshot `rule` (run_local's
    snapshot_* arguments); the steps each rank wrote, in order."""
    plan = build_plan(
        model,
        ClusterSpec.uniform(1, 2, load_device_spec("cpu")),
        Layout.parse("pp=2,tp=1,dp=1"),
        global_batch=4,
        micro_batch=2,
    )
    written: dict[int, list[int]] = {0: [], 1: []}

    def on_snapshot(ev: dict[str, Any]) -> None:
        written[int(ev["rank"])].append(int(ev["step"]))

    workers = spawn_workers(2, tmp_path / "logs", tag="rank")
    try:
        run_local(
            plan,
            TrainConfig(seed=0, steps=steps),
            workers,
            snapshot_dir=tmp_path / "snap",
            num_threads=1,
            on_snapshot=on_snapshot,
            **rule,
        )
    finally:
        kill_all(workers)
    return written


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
