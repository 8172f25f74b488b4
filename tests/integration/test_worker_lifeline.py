"""A worker never outlives its supervisor, even one killed with SIGKILL mid-training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from elasticpp.proctree import descendants
from elasticpp.waiting import wait_until
from tests.workers import alive as _alive


def _wait(cond: Callable[[], bool], timeout_s: float) -> bool:
    return wait_until(cond, timeout_s)


@pytest.mark.timeout(180)
def test_training_workers_die_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    sup = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elasticpp.cli.main",
            "train",
            "--model",
            "tiny",
            "--layout",
            "pp=2,tp=1,dp=1",
            "--global-batch",
            "4",
            "--micro-batch",
            "2",
            "--steps",
            "100000",
            "--metrics",
            str(metrics),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    workers: list[int] = []
    try:
        assert _wait(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 120)
        workers = descendants(sup.pid)
        assert len(workers) >= 2
        os.kill(sup.pid, signal.SIGKILL)  # no handler runs: only the workers' lifeline helps
        sup.wait(timeout=10)
        assert _wait(lambda: not any(_alive(p) for p in workers), 10), (
            f"workers outlived their killed supervisor: {[p for p in workers if _alive(p)]}"
        )
    finally:
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if sup.poll() is None:
            sup.kill()
            sup.wait()
