"""The simulated worker (bench/scalesim.SimWorker) against the real one (WorkerProcess): the
same cases, on the methods and events the agent relies on, run on both. What the simulated
one leaves out (training steps, snapshots) is what bench/scale.py says it does not measure."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.scalesim import SimWorker
from elasticpp.errors import ElasticppError
from elasticpp.train.config import TrainConfig
from elasticpp.train.worker.procs import EXITED, WorkerProcess
from tests.workers import assignment, make_plan
from tests.workers import rendezvous_store as store

Events = queue.Queue[dict[str, Any]]


@pytest.fixture(params=["real", "simulated"])
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    make: Callable[[Path], Any] = WorkerProcess if request.param == "real" else SimWorker
    w = make(tmp_path / "w.log")
    try:
        yield w
    finally:
        w.kill()


def listen(w: Any) -> Events:
    q: Events = queue.Queue()
    w.listen(lambda _w, ev: q.put(ev))
    return q


def next_kind(q: Events, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        ev = q.get(timeout=max(0.01, deadline - time.monotonic()))
        if ev.get("event") != "error":
            return ev


@pytest.mark.timeout(120)
def test_a_warm_worker_says_ready_first_even_to_a_late_listener(worker: Any) -> None:
    q = listen(worker)
    assert next_kind(q)["event"] == "ready"
    assert worker.alive()


@pytest.mark.timeout(120)
def test_an_assigned_worker_says_started_then_stops_when_asked(worker: Any) -> None:
    q = listen(worker)
    assert next_kind(q)["event"] == "ready"
    plan = make_plan("pp=1,tp=1,dp=1")
    s = store()
    worker.assign(assignment(plan, 0, s.port, TrainConfig(steps=100_000)))
    assert next_kind(q)["event"] == "started"
    worker.stop_at(0)
    kinds = []
    while not kinds or kinds[-1] != EXITED:
        kinds.append(next_kind(q)["event"])
    assert "stopped" in kinds
    assert not worker.alive()


@pytest.mark.timeout(120)
def test_a_killed_worker_exits_non_zero_and_refuses_commands(worker: Any) -> None:
    q = listen(worker)
    assert next_kind(q)["event"] == "ready"
    worker.kill(wait=False)
    while (ev := next_kind(q))["event"] != EXITED:
        pass
    assert ev["returncode"] != 0
    assert not worker.alive()
    with pytest.raises(ElasticppError):
        worker.stop_at(0)
