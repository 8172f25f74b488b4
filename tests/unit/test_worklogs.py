"""Worker logs split per assignment and teed with a prefix (elasticpp.agent.kernel.worklogs), on
real files written as a worker writes them."""

from __future__ import annotations

import io
from pathlib import Path

from elasticpp.agent.kernel import worklogs
from elasticpp.agent.kernel.worklogs import WorkerLogs, assignment_log, tail_of


def _logs(tmp_path: Path) -> tuple[WorkerLogs, io.BytesIO]:
    out = io.BytesIO()
    return WorkerLogs(tmp_path / "logs", out=lambda: out, poll_s=3600), out


def test_what_a_worker_writes_after_its_assignment_is_its_assignments_and_teed(
    tmp_path: Path,
) -> None:
    logs, out = _logs(tmp_path)
    raw = tmp_path / "w1.log"
    raw.write_bytes(b"importing torch\n")  # while warm: nobody's rank yet
    target = logs.follow(raw, 3, 1)
    assert target == assignment_log(tmp_path / "logs", 3, 1)
    with raw.open("ab") as f:
        f.write(b"step 1\nTraceback (most recent call last):\n  File x\nRuntimeError: boo")
    tail = logs.failure_tail(raw)  # copies what is left, the unfinished line too
    assert target.read_bytes() == (
        b"step 1\nTraceback (most recent call last):\n  File x\nRuntimeError: boo"
    )
    assert tail.splitlines()[-1] == "RuntimeError: boo"
    assert out.getvalue().decode().splitlines() == [
        "[gen 3 rank 1] step 1",
        "[gen 3 rank 1] Traceback (most recent call last):",
        "[gen 3 rank 1]   File x",
        "[gen 3 rank 1] RuntimeError: boo",
    ]
    logs.close()


def test_a_worker_assigned_again_writes_to_its_new_assignment(tmp_path: Path) -> None:
    logs, out = _logs(tmp_path)
    raw = tmp_path / "w1.log"
    raw.write_bytes(b"")
    logs.follow(raw, 1, 0)
    raw.write_bytes(b"in gen 1\n")
    logs.follow(raw, 2, 5)
    with raw.open("ab") as f:
        f.write(b"in gen 2\n")
    logs.forget(raw)
    assert assignment_log(tmp_path / "logs", 1, 0).read_bytes() == b"in gen 1\n"
    assert assignment_log(tmp_path / "logs", 2, 5).read_bytes() == b"in gen 2\n"
    assert b"[gen 2 rank 5] in gen 2\n" in out.getvalue()
    logs.close()


def test_failure_logs_keep_the_jobs_first_and_the_newest_whatever_the_rotation(
    tmp_path: Path,
) -> None:
    logs, _ = _logs(tmp_path)
    kept = []
    for g in range(1, 31):
        raw = tmp_path / f"w{g}.log"
        raw.write_bytes(b"")
        logs.follow(raw, g, 0)
        raw.write_bytes(f"failure {g}\n".encode())
        logs.failure_tail(raw)
        kept.append(logs.keep(raw))
        logs.forget(raw)
    names = sorted(p.name for p in (tmp_path / "logs" / "failures").iterdir())
    first, newest = worklogs.FIRST_FAILURES_KEPT, worklogs.NEWEST_FAILURES_KEPT
    assert len(names) == first + newest
    assert names[0] == "000001-gen-1-rank-0.log"  # the root cause of the crash loop
    assert names[-1] == "000030-gen-30-rank-0.log"
    assert (tmp_path / "logs" / "failures" / names[0]).read_text() == "failure 1\n"
    gens = sorted(p.name for p in (tmp_path / "logs").iterdir() if p.name.startswith("gen-"))
    assert len(gens) == worklogs.GENERATIONS_KEPT and gens[-1] == "gen-000030"
    logs.close()


def test_a_tail_is_bounded_in_lines_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert tail_of(path, lines=3).splitlines() == ["line 997", "line 998", "line 999"]
    assert len(tail_of(path, lines=10_000, max_bytes=100)) <= 100
    assert tail_of(tmp_path / "missing.log") == ""
