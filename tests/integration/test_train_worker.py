"""The worker protocol, driven the way the node agent drives it (WorkerProcess)."""

from __future__ import annotations

import math
import queue
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elasticpp.checkpoint.manifest import (
    Manifest,
    PieceEntry,
    PieceKey,
    sha256_bytes,
    verify_step_dir,
    write_manifest,
)
from elasticpp.checkpoint.tensors import encode_piece, load_units, read_piece
from elasticpp.train.config import TrainConfig
from elasticpp.train.worker.launch import kill_all, spawn_workers, wait_gone
from elasticpp.train.worker.procs import EXITED, WorkerProcess
from tests.workers import MODEL, assignment, make_plan
from tests.workers import rendezvous_store as store


def collect(workers: list[WorkerProcess], timeout_s: float) -> queue.Queue[tuple[int, dict]]:
    q: queue.Queue[tuple[int, dict]] = queue.Queue()
    for r, w in enumerate(workers):
        w.listen(lambda _w, ev, r=r: q.put((r, ev)))
    return q


def next_event(q: queue.Queue[tuple[int, dict]], deadline: float) -> tuple[int, dict]:
    left = deadline - time.monotonic()
    assert left > 0, "deadline passed"
    return q.get(timeout=left)


@pytest.mark.timeout(120)
def test_stop_at_sent_to_one_rank_stops_every_rank_at_the_same_step_with_a_full_snapshot(
    tmp_path: Path,
) -> None:
    plan = make_plan("pp=2,tp=2,dp=1")
    job = TrainConfig(steps=200, lr=3e-3)
    s = store()
    workers = spawn_workers(4, tmp_path / "logs")
    try:
        for w in workers:
            ev = w.wait_ready(120)
            assert ev["pid"] == w.pid
        q = collect(workers, 60)
        snap_root = tmp_path / "snap"
        for r, w in enumerate(workers):
            w.assign(
                assignment(plan, r, s.port, job, snapshot_dir=str(snap_root), snapshot_every=0)
            )
        deadline = time.monotonic() + 100
        steps: dict[int, list[int]] = {r: [] for r in range(4)}
        ends: dict[int, dict] = {}
        snapshots: list[dict] = []
        sent = False
        exits: dict[int, int] = {}
        while len(exits) < 4:
            r, ev = next_event(q, deadline)
            kind = ev["event"]
            if kind == "step":
                steps[r].append(ev["step"])
                assert ev["generation"] == 3
                if not sent and r == 0 and ev["step"] == 0:
                    # Only the last rank hears of the stop; the others learn it collectively.
                    workers[3].stop_at(3)
                    sent = True
            elif kind in ("stopped", "done", "error"):
                ends[r] = ev
            elif kind == "snapshot":
                snapshots.append(ev)
            elif kind == EXITED:
                exits[r] = ev["returncode"]
        assert exits == {0: 0, 1: 0, 2: 0, 3: 0}
        stop_steps = {ev["step"] for ev in ends.values()}
        assert {ev["event"] for ev in ends.values()} == {"stopped"}
        assert len(stop_steps) == 1
        stop = stop_steps.pop()
        assert 3 <= stop <= 5  # 3 unless the command arrived after that boundary
        assert all(got == list(range(stop)) for got in steps.values())
        # A complete snapshot of the state after `stop` steps, from all four ranks.
        assert {ev["step"] for ev in snapshots} == {stop}
        entries = [
            PieceEntry(PieceKey.parse(p["name"]), p["size"], p["sha256"])
            for ev in snapshots
            for p in ev["pieces"]
        ]
        step_dir = Path(snapshots[0]["dir"])
        write_manifest(step_dir, Manifest(stop, MODEL.units, tuple(entries)))
        manifest = verify_step_dir(step_dir)
        assert manifest.is_full_model()
        loaded = load_units(step_dir, MODEL.units, 0, 1)
        assert {u.step for u in loaded.values()} == {stop}
    finally:
        kill_all(workers)


@pytest.mark.timeout(90)
def test_closing_stdin_does_not_stop_training_and_snapshots_follow_every_step(
    tmp_path: Path,
) -> None:
    plan = make_plan("pp=1,tp=1,dp=1", generation=0)
    s = store()
    (w,) = spawn_workers(1, tmp_path / "logs")
    try:
        w.wait_ready(60)
        snap = tmp_path / "snap"
        w.assign(assignment(plan, 0, s.port, TrainConfig(steps=3), snapshot_dir=str(snap)))
        assert w.proc.stdin is not None
        w.proc.stdin.close()
        done = w.wait_for("done", 60)
        assert done["step"] == 3
        assert w.wait_for(EXITED, 30)["returncode"] == 0
        assert sorted(p.name for p in snap.iterdir()) == [
            "step-0000000001",
            "step-0000000002",
            "step-0000000003",
        ]
    finally:
        w.kill()


@pytest.mark.timeout(120)
def test_snapshots_written_off_the_training_thread_are_the_bytes_write_piece_writes(
    tmp_path: Path,
) -> None:
    """Every piece of every step, as the agent receives it: its file is exactly what
    `encode_piece` makes of its tensors and metadata, and its size and sha256 are the event's."""
    plan = make_plan("pp=1,tp=2,dp=1", generation=0)
    s = store()
    workers = spawn_workers(2, tmp_path / "logs")
    try:
        for w in workers:
            w.wait_ready(60)
        q = collect(workers, 60)
        snap = tmp_path / "snap"
        for r, w in enumerate(workers):
            w.assign(assignment(plan, r, s.port, TrainConfig(steps=4), snapshot_dir=str(snap)))
        deadline = time.monotonic() + 100
        snapshots: list[dict] = []
        exits: dict[int, int] = {}
        while len(exits) < 2:
            r, ev = next_event(q, deadline)
            if ev["event"] == "snapshot":
                snapshots.append(ev)
            elif ev["event"] == EXITED:
                exits[r] = ev["returncode"]
        assert exits == {0: 0, 1: 0}
        assert sorted((ev["step"], ev["rank"]) for ev in snapshots) == [
            (k, r) for k in (1, 2, 3, 4) for r in (0, 1)
        ]
        for ev in snapshots:
            for p in ev["pieces"]:
                path = Path(ev["dir"]) / p["name"]
                data = path.read_bytes()
                piece = read_piece(path, p["sha256"])
                assert piece.meta.step == ev["step"] and piece.meta.tp_rank == ev["rank"]
                assert encode_piece(piece.tensors, piece.meta) == data
                assert len(data) == p["size"] and sha256_bytes(data) == p["sha256"]
    finally:
        kill_all(workers)


def run_to_exit(w: WorkerProcess, timeout_s: float) -> list[dict[str, Any]]:
    events = []
    deadline = time.monotonic() + timeout_s
    while not events or events[-1]["event"] != EXITED:
        ev = w.poll_event(max(deadline - time.monotonic(), 0.01))
        assert ev is not None, f"no exit within {timeout_s} s; events: {events}"
        events.append(ev)
    return events


@pytest.mark.timeout(90)
def test_a_snapshot_that_cannot_be_written_is_reported_and_training_goes_on(
    tmp_path: Path,
) -> None:
    plan = make_plan("pp=1,tp=1,dp=1", generation=0)
    s = store()
    snap = tmp_path / "snap"
    snap.mkdir()
    # Where step 2's directory goes, a file: every write into it fails as on a full disk.
    (snap / "step-0000000002").write_text("in the way")
    (w,) = spawn_workers(1, tmp_path / "logs")
    try:
        w.wait_ready(60)
        w.assign(assignment(plan, 0, s.port, TrainConfig(steps=4), snapshot_dir=str(snap)))
        events = run_to_exit(w, 60)
        kinds = [ev["event"] for ev in events]
        assert kinds[-2:] == ["done", EXITED] and events[-1]["returncode"] == 0
        assert [ev["step"] for ev in events if ev["event"] == "step"] == [0, 1, 2, 3]
        failed = [ev for ev in events if ev["event"] == "snapshot_failed"]
        assert [ev["step"] for ev in failed] == [2]
        assert "step-0000000002" in failed[0]["message"]
        written = [ev["step"] for ev in events if ev["event"] == "snapshot"]
        assert written == [1, 3, 4]
    finally:
        w.kill()


@pytest.mark.timeout(90)
def test_a_step_that_is_not_finite_halts_training_and_nothing_after_it_is_written(
    tmp_path: Path,
) -> None:
    plan = make_plan("pp=1,tp=1,dp=1", generation=0)
    s = store()
    snap = tmp_path / "snap"
    # A learning rate this large overflows the weights after the first update.
    job = TrainConfig(steps=6, lr=1e30, min_lr=0.0, warmup_steps=0, clip_grad=0.0)
    (w,) = spawn_workers(1, tmp_path / "logs")
    try:
        w.wait_ready(60)
        w.assign(assignment(plan, 0, s.port, job, snapshot_dir=str(snap)))
        events = run_to_exit(w, 60)
        assert events[-1]["returncode"] == 0
        halted = [ev for ev in events if ev["event"] == "halted"]
        assert len(halted) == 1 and "not finite" in halted[0]["message"]
        k = halted[0]["step"]
        assert not any(ev["event"] in ("done", "stopped", "error") for ev in events)
        steps = [ev for ev in events if ev["event"] == "step"]
        assert [ev["step"] for ev in steps] == list(range(k + 1))
        assert all(math.isfinite(ev["loss"]) for ev in steps[:-1])
        assert not (math.isfinite(steps[-1]["loss"]) and math.isfinite(steps[-1]["grad_norm"]))
        # Snapshots hold only states before the poisoned update, and every tensor is finite.
        written = [ev for ev in events if ev["event"] == "snapshot"]
        assert [ev["step"] for ev in written] == list(range(1, k + 1))
        assert sorted(p.name for p in snap.iterdir()) == [f"step-{i:010d}" for i in range(1, k + 1)]
        for ev in written:
            step_dir = Path(ev["dir"])
            entries = [
                PieceEntry(PieceKey.parse(p["name"]), p["size"], p["sha256"]) for p in ev["pieces"]
            ]
            write_manifest(step_dir, Manifest(ev["step"], MODEL.units, tuple(entries)))
            for unit in load_units(step_dir, MODEL.units, 0, 1).values():
                for t in unit.tensors.values():
                    assert bool(t.isfinite().all())
    finally:
        w.kill()


@pytest.mark.timeout(60)
def test_a_bad_assignment_gives_an_error_event_and_exit_1(tmp_path: Path) -> None:
    (w,) = spawn_workers(1, tmp_path / "logs")
    try:
        w.wait_ready(60)
        w.send({"format_version": 1, "rank": 0})
        events = run_to_exit(w, 30)
        assert events[0]["event"] == "error" and "plan" in events[0]["message"]
        assert events[-1]["returncode"] == 1
    finally:
        w.kill()


@pytest.mark.timeout(90)
def test_a_peer_killed_mid_run_makes_the_survivor_exit_non_zero_quickly(
    tmp_path: Path,
) -> None:
    plan = make_plan("pp=2,tp=1,dp=1", generation=1)
    job = TrainConfig(steps=100000, pg_timeout_s=30)
    s = store()
    workers = spawn_workers(2, tmp_path / "logs")
    try:
        for w in workers:
            w.wait_ready(60)
        for r, w in enumerate(workers):
            w.assign(assignment(plan, r, s.port, job))
        workers[0].wait_for("step", 60)
        workers[1].kill()
        killed_at = time.monotonic()
        rc = None
        while rc is None:
            ev = workers[0].poll_event(40)
            assert ev is not None, "survivor neither failed nor exited"
            if ev["event"] == EXITED:
                rc = ev["returncode"]
        assert rc != 0
        # Gloo reports the closed connection at once; well inside the 30 s pg timeout.
        assert time.monotonic() - killed_at < 25
        assert wait_gone([w.pid for w in workers], 10) == []
    finally:
        kill_all(workers)


@pytest.mark.timeout(60)
def test_terminate_and_kill_take_the_whole_process_group(tmp_path: Path) -> None:
    workers = spawn_workers(2, tmp_path / "logs")
    try:
        for w in workers:
            w.wait_ready(60)
        workers[0].terminate(grace_s=5)
        workers[1].kill()
        assert wait_gone([w.pid for w in workers], 10) == []
        assert workers[1].returncode == -signal.SIGKILL or workers[1].proc.returncode == -9
    finally:
        kill_all(workers)


@pytest.mark.timeout(60)
def test_what_a_library_prints_to_stdout_is_logged_and_never_taken_for_an_event(
    tmp_path: Path,
) -> None:
    # A stand-in for a C library that writes to the process's stdout: a line that looks
    # like an event, and half a line, before the worker itself starts.
    wrapper = tmp_path / "python-that-prints"
    wrapper.write_text(
        "#!/bin/sh\n"
        'printf \'%s\\n\' \'{"event": "done", "step": 999}\'\n'
        "printf 'half a line without its end'\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    w = WorkerProcess(tmp_path / "w.log", python=str(wrapper))
    try:
        ready = w.wait_ready(60)
        assert ready["event"] == "ready" and ready["pid"] == w.pid
        w.send({"format_version": 1, "rank": 0})  # refused: an error event, then exit 1
        events = run_to_exit(w, 30)
        assert [ev["event"] for ev in events] == ["error", EXITED]
        log = (tmp_path / "w.log").read_text()
        assert '{"event": "done", "step": 999}' in log and "half a line" in log
    finally:
        w.kill()
