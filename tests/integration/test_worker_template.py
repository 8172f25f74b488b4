"""The worker template (elasticpp.train.worker.forkserver): warm workers forked from one process
that imported torch once, real processes throughout.

A forked worker must be what an exec'd one is to its supervisor (ready, its events, its
exit status, its own session, dead with its supervisor); a template that cannot be trusted
to fork (it never becomes ready, it has a second thread, it died) must not be used, and
workers then start with exec as before. That forked workers train the same curves as
exec'd ones is test_train_layouts.py's (its workers are forked).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elasticpp.proctree import blocked_reading_stdin, descendants, worker_processes
from elasticpp.train.worker.launch import kill_all, spawn_workers, start_template
from elasticpp.train.worker.procs import EXITED, WorkerError, WorkerTemplate
from elasticpp.waiting import wait_until
from tests.workers import alive as _alive

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _hooked_env(tmp_path: Path, source: str) -> dict[str, str]:
    """ENV with a sitecustomize (run by every interpreter at start-up) of `source`."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(source))
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(hook), *sys.path])}


@pytest.mark.timeout(120)
def test_forked_workers_are_ready_in_their_own_sessions_and_report_their_exits(
    tmp_path: Path, no_orphans: None
) -> None:
    template = start_template(tmp_path, env=ENV)
    workers = []
    try:
        assert template.usable(), template.why_not
        workers = spawn_workers(3, tmp_path, template=template, env=ENV)
        assert [w.forked for w in workers] == [True, True, True]
        for w in workers:
            w.wait_ready(30)
            assert os.getpgid(w.pid) == w.pid  # a kill of its group takes only it
            assert w.pid not in (template.pid, os.getpid())
        killed, refused, stopped = workers
        killed.kill()
        assert killed.proc.returncode == -signal.SIGKILL
        refused.send({"not": "an assignment"})
        with pytest.raises(Exception, match="format_version"):
            refused.wait_for("started", 30)
        assert wait_until(lambda: refused.proc.poll() is not None, 30)
        assert refused.proc.returncode == 1
        # The last event of a forked worker is the exit, with its status, as for any.
        assert wait_until(lambda: not refused.alive(), 10)
        stopped.proc.stdin.close()  # type: ignore[union-attr]  # no assignment: it fails
        event = None
        for _ in range(3):
            event = stopped.poll_event(30)
            if event is not None and event.get("event") == EXITED:
                break
        assert event == {"event": EXITED, "returncode": 1}
    finally:
        kill_all(workers)
        template.close()
    assert template.proc.poll() is not None


@pytest.mark.timeout(120)
def test_when_the_template_dies_its_workers_die_and_workers_start_with_exec(
    tmp_path: Path, no_orphans: None
) -> None:
    template = start_template(tmp_path, env=ENV)
    workers = []
    try:
        assert template.usable(), template.why_not
        workers = spawn_workers(1, tmp_path, tag="forked", template=template, env=ENV)
        workers[0].wait_ready(30)
        os.kill(template.pid, signal.SIGKILL)
        assert wait_until(lambda: not _alive(workers[0].pid), 10), "worker outlived template"
        assert wait_until(lambda: not template.usable(), 10)
        assert "exited" in str(template.why_not)
        workers += spawn_workers(1, tmp_path, tag="exec", template=template, env=ENV)
        assert not workers[1].forked
        workers[1].wait_ready(60)
    finally:
        kill_all(workers)
        template.close()


@pytest.mark.timeout(120)
def test_a_template_with_a_second_thread_is_not_used(tmp_path: Path, no_orphans: None) -> None:
    env = _hooked_env(
        tmp_path,
        """
        import threading, time
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        """,
    )
    template = start_template(tmp_path, env=env)
    workers = []
    try:
        assert not template.usable()
        assert "2 threads" in str(template.why_not), template.why_not
        workers = spawn_workers(1, tmp_path, template=template, env=env)
        assert not workers[0].forked
        workers[0].wait_ready(60)
    finally:
        kill_all(workers)
        template.close()


@pytest.mark.timeout(60)
def test_a_template_that_never_becomes_ready_is_given_up_and_killed(
    tmp_path: Path, no_orphans: None
) -> None:
    env = _hooked_env(
        tmp_path,
        "import os, time\nif 'ELASTICPP_TEMPLATE_FD' in os.environ:\n    time.sleep(3600)\n",
    )
    template = start_template(tmp_path, env=env, timeout_s=3)
    try:
        assert not template.usable()
        assert template.why_not == "not ready within 3 s"
        assert wait_until(lambda: template.proc.poll() is not None, 10)
    finally:
        template.close()


@pytest.mark.timeout(120)
def test_a_killed_supervisor_takes_its_template_and_forked_workers_with_it(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    script = textwrap.dedent(
        f"""
        import os, time
        from pathlib import Path
        from elasticpp.train.worker.launch import spawn_workers, start_template
        env = {{**os.environ, "OMP_NUM_THREADS": "1"}}
        template = start_template(Path({str(tmp_path)!r}), env=env)
        assert template.usable(), template.why_not
        workers = spawn_workers(2, Path({str(tmp_path)!r}), template=template, env=env)
        for w in workers:
            w.wait_ready(60)
        Path({str(ready)!r}).write_text("ok")
        time.sleep(3600)
        """
    )
    sup = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    started: list[int] = []
    try:
        assert wait_until(lambda: ready.is_file() or sup.poll() is not None, 90)
        assert sup.poll() is None, "the supervisor failed"
        started = descendants(sup.pid)
        assert len(started) == 3  # the template and two workers
        # What a harness counts as the supervisor's workers: not the template.
        workers = worker_processes(sup.pid)
        assert len(workers) == 2 and all(blocked_reading_stdin(p) for p in workers), workers
        os.kill(sup.pid, signal.SIGKILL)  # no handler runs: only the lifelines help
        sup.wait(timeout=10)
        assert wait_until(lambda: not any(_alive(p) for p in started), 10), (
            f"outlived their killed supervisor: {[p for p in started if _alive(p)]}"
        )
    finally:
        for p in started:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_a_template_is_not_asked_before_it_is_ready(tmp_path: Path) -> None:
    # The agent's loop must never block on a template that is still importing.
    template = WorkerTemplate(tmp_path / "t.log", env=ENV)
    try:
        assert template.loading() and not template.usable()
        workers = spawn_workers(1, tmp_path, template=template, env=ENV)
        try:
            assert not workers[0].forked
        finally:
            kill_all(workers)
    finally:
        template.close()


@pytest.mark.timeout(60)
def test_a_template_forks_whatever_the_thread_settings(tmp_path: Path, no_orphans: None) -> None:
    # Without OMP_NUM_THREADS, or with several intra-op threads, numpy's BLAS would start a
    # thread pool at import (and a template with two threads must not fork): the template
    # keeps it to one thread unless OPENBLAS_NUM_THREADS says otherwise.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    for threads in (None, "4"):
        run_env = env if threads is None else {**env, "OMP_NUM_THREADS": threads}
        template = start_template(tmp_path / str(threads), env=run_env)
        try:
            assert template.usable(), (threads, template.why_not)
        finally:
            template.close()


@pytest.mark.timeout(120)
def test_a_stopped_template_answers_no_ping_and_is_asked_for_no_fork_it_would_not_answer(
    tmp_path: Path, no_orphans: None
) -> None:
    template = start_template(tmp_path, env=ENV)
    fds = [fd for pair in (os.pipe(), os.pipe()) for fd in pair]
    try:
        assert template.usable(), template.why_not
        template.ping()
        assert wait_until(lambda: template.unanswered_s() is None, 10), "no answer"
        os.kill(template.pid, signal.SIGSTOP)
        template.ping()
        assert wait_until(lambda: (template.unanswered_s() or 0.0) > 2.0, 10)
        # A fork request would wait answer_timeout_s for an answer that never comes: the
        # caller (the agent's loop) is told at once, and starts its worker with exec.
        began = time.monotonic()
        with pytest.raises(WorkerError, match="no answer to a ping"):
            template.fork(ENV, fds[0], fds[3], fds[3])
        assert time.monotonic() - began < 3.0
        assert template.usable()  # its supervisor decides (it replaces a hung template)
        os.kill(template.pid, signal.SIGCONT)
        assert wait_until(lambda: template.unanswered_s() is None, 10), "no answer once running"
    finally:
        for fd in fds:
            os.close(fd)
        template.close()
    assert template.proc.poll() is not None
