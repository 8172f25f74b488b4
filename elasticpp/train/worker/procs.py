"""Supervisor side of the worker protocol: spawn, talk to and kill worker processes.

A `WorkerProcess` runs `python -m elasticpp.train.worker.main` in its own session (its own
process group, so a kill takes every child with it and a terminal's Ctrl-C never reaches
it). It is started with exec, never a bare fork: a supervisor that holds gRPC or etcd
connections must not fork. Events come on a pipe of their own (its descriptor is named by
`EVENT_FD_ENV`), not on stdout: whatever a C library prints goes to the worker's log with
stdout and stderr and can never be taken for an event or split one. A reader thread turns
event lines into dicts; when the pipe closes it adds one synthesized event
`{"event": "exited", "returncode": rc}` so a supervisor learns of a death from the same
queue as of everything else.

Pure standard library (no torch): the supervisor stays light.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from elasticpp.errors import ElasticppError
from elasticpp.proctree import counts_as_gone, read_stat

log = logging.getLogger(__name__)

EXITED = "exited"  # the synthesized last event of every worker
EVENT_FD_ENV = "ELASTICPP_EVENT_FD"  # the worker's descriptor of the event pipe
# "cuda": the warm worker initialises CUDA (driver, libraries) before it says "ready", so a
# spare's readiness includes it and a recovery does not pay it. No device context is made
# until the assignment names the GPU.
WORKER_DEVICE_ENV = "ELASTICPP_WORKER_DEVICE"
TEMPLATE_FD_ENV = "ELASTICPP_TEMPLATE_FD"  # as elasticpp.train.worker.forkserver's
MAX_TEMPLATE_MESSAGE = 1 << 16
# How often a wait for a forked worker's exit looks whether it is a zombie its template
# cannot reap (a template that is stopped or hung reports no exit).
ZOMBIE_CHECK_S = 0.5
# A fork is asked of a template only once it answered a ping sent just before, within
# PING_LATE_S: one that is stopped or hung would keep a fork request waiting for its
# answer_timeout_s, and the caller (the agent's decision loop) with it.
PING_LATE_S = 1.0


class WorkerError(ElasticppError):
    """A worker died, timed out or refused its input."""


class WorkerProcess:
    """One worker process, warm until it is assigned."""

    def __init__(
        self,
        log_path: Path,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        on_event: Callable[[WorkerProcess, dict[str, Any]], None] | None = None,  # see listen
        name: str = "",
        template: WorkerTemplate | None = None,
    ) -> None:
        """`template`: fork it from this worker template when the template is usable (it
        imported torch already); else, or when the fork is refused, start it with exec."""
        self.name = name
        self.log_path = log_path
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._on_event = on_event
        self._listen_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.returncode: int | None = None
        self.forked = False  # forked from a template (else exec'd)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        child_env = dict(env) if env is not None else dict(os.environ)
        read_fd, write_fd = os.pipe()
        try:
            self.proc: subprocess.Popen[str] | _ForkedChild = self._start(
                python, child_env, write_fd, template
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._event_pipe: IO[str] = os.fdopen(read_fd, "r", encoding="utf-8")
        self.pid = self.proc.pid
        self._reader = threading.Thread(
            target=self._read, name=f"worker-{self.pid}-events", daemon=True
        )
        self._reader.start()

    def _start(
        self,
        python: str,
        env: dict[str, str],
        event_fd: int,
        template: WorkerTemplate | None,
    ) -> subprocess.Popen[str] | _ForkedChild:
        with self.log_path.open("ab") as out:  # the child holds its own descriptors
            if template is not None and template.usable():
                stdin_r, stdin_w = os.pipe()
                try:
                    child = template.fork(env, stdin_r, event_fd, out.fileno())
                except WorkerError:
                    os.close(stdin_w)  # the template said why (its log); exec instead
                else:
                    child.stdin = os.fdopen(stdin_w, "w", encoding="utf-8", buffering=1)
                    self.forked = True
                    return child
                finally:
                    os.close(stdin_r)
            env[EVENT_FD_ENV] = str(event_fd)
            return subprocess.Popen(
                [python, "-m", "elasticpp.train.worker.main"],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
                text=True,
                bufsize=1,
                pass_fds=(event_fd,),
            )

    # ----- events -----

    def _read(self) -> None:
        with self._event_pipe as events:
            for line in events:
                line = line.strip()
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    log.warning("worker %d: not a JSON line: %r", self.pid, line[:200])
                    continue
                if isinstance(event, dict):
                    self._deliver(event)
        self.returncode = self.proc.wait()
        self._deliver({"event": EXITED, "returncode": self.returncode})

    def _deliver(self, event: dict[str, Any]) -> None:
        with self._listen_lock:
            if self._on_event is None:
                self._events.put(event)
            else:
                self._on_event(self, event)

    def listen(self, on_event: Callable[[WorkerProcess, dict[str, Any]], None]) -> None:
        """From now on hand every event to `on_event` (from the reader thread) instead of
        queueing it; events already queued are handed over first, in order. The callback
        must be quick (e.g. put onto a queue shared by several workers)."""
        with self._listen_lock:
            while True:
                try:
                    on_event(self, self._events.get_nowait())
                except queue.Empty:
                    break
            self._on_event = on_event

    def poll_event(self, timeout_s: float = 0.0) -> dict[str, Any] | None:
        """The next event, waiting up to `timeout_s`; None if none came."""
        try:
            if timeout_s <= 0:
                return self._events.get_nowait()
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def events(self) -> Iterator[dict[str, Any]]:
        """The events received so far (does not wait)."""
        while True:
            event = self.poll_event(0)
            if event is None:
                return
            yield event

    def wait_for(self, kind: str, timeout_s: float) -> dict[str, Any]:
        """Wait for the next event of `kind`, skipping others; raises on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"worker {self.pid}: no {kind!r} event in {timeout_s:.0f} s")
            event = self.poll_event(left)
            if event is None:
                continue
            if event.get("event") == kind:
                return event
            if event.get("event") == "error":
                raise WorkerError(f"worker {self.pid}: {event.get('message')}")
            if event.get("event") == EXITED:
                raise WorkerError(
                    f"worker {self.pid} exited with {event.get('returncode')} "
                    f"before {kind!r} (log: {self.log_path})"
                )

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        return self.wait_for("ready", timeout_s)

    # ----- commands -----

    def send(self, obj: Mapping[str, Any]) -> None:
        """Write one JSON line to the worker's stdin."""
        line = json.dumps(obj, sort_keys=True) + "\n"
        with self._write_lock:
            stdin = self.proc.stdin
            if stdin is None:
                raise WorkerError(f"worker {self.pid}: stdin closed")
            try:
                stdin.write(line)
                stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise WorkerError(f"worker {self.pid}: cannot write: {exc}") from exc

    def assign(self, assignment: Mapping[str, Any]) -> None:
        self.send(assignment)

    def stop_at(self, step: int) -> None:
        self.send({"cmd": "stop_at", "step": step})

    # ----- lifetime -----

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, *, wait: bool = True, timeout_s: float = 10.0) -> None:
        """SIGKILL the worker's whole process group; with `wait`, reap it (up to
        `timeout_s`).

        A supervisor's loop passes `wait=False`: a process in uninterruptible sleep (a
        driver or NFS hang) outlives SIGKILL for as long as it likes, and the loop must not
        wait with it. The reader thread reaps it when it goes and reports `exited`."""
        self._signal_group(signal.SIGKILL)
        if wait:
            self._reap(timeout_s)

    def terminate(self, grace_s: float = 5.0) -> None:
        """SIGTERM the group, then SIGKILL what is left after `grace_s`."""
        self._signal_group(signal.SIGTERM)
        if not self._reap(grace_s):
            self.kill()

    def _signal_group(self, sig: int) -> None:
        if self.proc.returncode is not None:
            # Reaped: its id may be reused. A worker starts no processes of its own.
            return
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.pid, sig)

    def _reap(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        for stream in (self.proc.stdin,):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return True

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class WorkerTemplate:
    """Client of the worker template (elasticpp.train.worker.forkserver): a process that imported
    torch once and forks warm workers on request, so that a warm pool's refill costs a fork,
    not an import. Usable once it reported ready and forkable; until then, and for good once
    it failed (it died, refused, or did not answer a request in time), `WorkerProcess`
    spawns with exec as before. `close()` kills it and, by their parent-death signal, the
    workers it forked.

    Between requests its supervisor pings it (`ping`): a template that does not answer
    within its deadline (`unanswered_s`; stopped, or hung) is hung, and its supervisor
    kills it and starts another. A template that served forks and then failed is `lost`:
    another one may serve again, where one that never could (it never became ready, or has
    a second thread) would fail the same way."""

    def __init__(
        self,
        log_path: Path,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        answer_timeout_s: float = 10.0,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.log_path = log_path
        self.answer_timeout_s = answer_timeout_s
        self.why_not: str | None = None  # why it is not used, once it is not
        self._on_ready = on_ready
        self._ready = False
        self._settled = threading.Event()  # ready, or failed
        self._lock = threading.Lock()
        self._next_id = 0
        self._answers: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._children: dict[int, _ForkedChild] = {}
        self._served = False  # it reported ready and forkable
        # Pings, on this process's monotonic clock: the one unanswered (id, when sent) and
        # when the last was sent; `_answered` is set by an answer.
        self._ping: tuple[int, float] | None = None
        self._pinged_s: float | None = None
        self._answered = threading.Event()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child_env = dict(env) if env is not None else dict(os.environ)
        child_env[TEMPLATE_FD_ENV] = str(theirs.fileno())
        # numpy's OpenBLAS (imported with torch) starts a thread pool at import unless told
        # not to, and a template with a second thread does not fork. torch's CPU kernels do
        # not use it; the forked workers keep numpy's BLAS on one thread.
        child_env.setdefault("OPENBLAS_NUM_THREADS", "1")
        try:
            with log_path.open("ab") as out:
                self.proc = subprocess.Popen(
                    [python, "-m", "elasticpp.train.worker.forkserver"],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    env=child_env,
                    start_new_session=True,
                    pass_fds=(theirs.fileno(),),
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self._sock = ours
        threading.Thread(target=self._read, name=f"template-{self.pid}", daemon=True).start()

    def usable(self) -> bool:
        return self._ready and self.why_not is None

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until it is ready or has failed; False if it still loads after `timeout_s`."""
        return self._settled.wait(timeout_s)

    def loading(self) -> bool:
        """Still importing: neither ready nor failed."""
        return not self._ready and self.why_not is None

    def lost(self) -> bool:
        """It served forks, and no longer does: it died, or was given up as hung."""
        return self._served and self.why_not is not None

    def give_up(self, why: str, *, quiet: bool = False) -> None:
        """Not used from now on (it did not become ready in time, or does not answer): it
        is killed, and the workers it forked with it."""
        self._fail(why, quiet=quiet)
        self.close()

    def forked_pids(self) -> frozenset[int]:
        """The workers it forked whose exit it has not reported."""
        with self._lock:
            return frozenset(self._children)

    def ping(self) -> None:
        """Ask it to answer, unless a ping already waits for its answer (`unanswered_s`)."""
        if not self.usable():
            return
        with self._lock:
            if self._ping is not None:
                return
            self._next_id += 1
            self._ping = (self._next_id, time.monotonic())
            self._pinged_s = self._ping[1]
            self._answered.clear()
            request = json.dumps({"op": "ping", "id": self._next_id}).encode()
        try:
            self._sock.send(request)
        except OSError as exc:
            self._fail(f"cannot send it a ping: {exc}")

    def unanswered_s(self) -> float | None:
        """How long its ping has waited for an answer; None when none waits."""
        ping = self._ping
        return None if ping is None else time.monotonic() - ping[1]

    def since_ping_s(self) -> float | None:
        """How long ago the last ping was sent; None before the first."""
        return None if self._pinged_s is None else time.monotonic() - self._pinged_s

    def _answers_ping(self) -> bool:
        """Whether it answers a ping (a new one, or the one waiting) within PING_LATE_S."""
        self.ping()
        return self.usable() and self._answered.wait(PING_LATE_S)

    def _read(self) -> None:
        try:
            while True:
                msg = self._sock.recv(MAX_TEMPLATE_MESSAGE)
                if not msg:
                    break
                try:
                    obj = json.loads(msg)
                except ValueError:
                    continue
                self._on_message(obj)
        except OSError:
            pass
        self._gone("its process exited")

    def _on_message(self, obj: dict[str, Any]) -> None:
        if obj.get("event") == "ready":
            if not obj.get("forkable"):
                self._fail(f"the template cannot fork: {obj.get('why')}")
            else:
                self._served = True
            self._ready = True
            self._settled.set()
            if self._on_ready is not None:
                self._on_ready()
            return
        op = obj.get("op")
        if op == "pong":
            with self._lock:
                if self._ping is not None and self._ping[0] == obj.get("id"):
                    self._ping = None
                    self._answered.set()
        elif op == "exited":
            with self._lock:
                child = self._children.pop(int(obj["pid"]), None)
            if child is not None:
                child._exited(int(obj["returncode"]))
        elif op in ("forked", "refused"):
            with self._lock:
                answer = self._answers.get(obj.get("id"))  # type: ignore[arg-type]
                if op == "forked":
                    # Registered here, before the next message is read: its "exited" may be it.
                    child = _ForkedChild(int(obj["pid"]), self.pid)
                    self._children[child.pid] = child
                    obj = {**obj, "child": child}
            if answer is not None:
                answer.put(obj)

    def _fail(self, why: str, *, quiet: bool = False) -> None:
        if self.why_not is None:
            self.why_not = why
            self._settled.set()
            if not quiet:
                log.warning(
                    "worker template %d not used: %s; workers start with exec", self.pid, why
                )

    def _gone(self, why: str) -> None:
        """The template is gone: its workers were killed with it (their parent-death
        signal); each is reported exited, as SIGKILL, once its process is."""
        self._fail(why)
        with self._lock:
            children, self._children = list(self._children.values()), {}
            answers = list(self._answers.values())
        for answer in answers:
            answer.put({"op": "refused", "why": why})
        for child in children:
            child._check_zombie()  # one that exited before has its own status
            child._exited(-signal.SIGKILL)

    def fork(
        self, env: Mapping[str, str], stdin_fd: int, event_fd: int, log_fd: int
    ) -> _ForkedChild:
        """A worker forked from the template, with these descriptors as its stdin, event
        pipe and stdout/stderr. Raises WorkerError when the template cannot (the caller
        spawns with exec); a template that does not answer in time is not used again."""
        if not self.usable():
            raise WorkerError(f"worker template {self.pid}: {self.why_not or 'not ready'}")
        if not self._answers_ping():
            # Stopped or hung, it would never answer the fork either: the caller must not
            # wait for it (a spare started with exec costs an import, not a stalled loop).
            raise WorkerError(f"worker template {self.pid}: no answer to a ping")
        answer: queue.Queue[dict[str, Any]] = queue.Queue()
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            self._answers[rid] = answer
        try:
            request = json.dumps({"op": "fork", "id": rid, "env": dict(env)}).encode()
            try:
                socket.send_fds(self._sock, [request], [stdin_fd, event_fd, log_fd])
            except OSError as exc:
                self._fail(f"cannot send it a request: {exc}")
                raise WorkerError(f"worker template {self.pid}: {exc}") from exc
            try:
                reply = answer.get(timeout=self.answer_timeout_s)
            except queue.Empty:
                self._fail(f"no answer to a fork request in {self.answer_timeout_s:.0f} s")
                self.close()
                raise WorkerError(f"worker template {self.pid}: no answer") from None
        finally:
            with self._lock:
                self._answers.pop(rid, None)
        if reply.get("op") != "forked":
            self._fail(str(reply.get("why")))
            raise WorkerError(f"worker template {self.pid}: {reply.get('why')}")
        child: _ForkedChild = reply["child"]
        return child

    def close(self) -> None:
        """Kill the template (its workers die with it) and reap it."""
        self._fail("closed", quiet=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            self._sock.close()


class _ForkedChild:
    """The part of `subprocess.Popen` that `WorkerProcess` uses, for a worker forked by
    the template: its exit status comes from the template, its parent, or from /proc while
    the template cannot reap it (it is stopped or hung): a worker that exited is then a
    zombie, and a zombie is gone (it holds no memory, no GPU; elasticpp.proctree)."""

    def __init__(self, pid: int, template_pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin: IO[str] | None = None
        self._done = threading.Event()
        # Its start time names it (a pid is reused once it is reaped); None: it was gone
        # before it could be read, and only the template's report tells its exit.
        stat = read_stat(pid)
        self._start_ticks = stat.start_ticks if stat and stat.ppid == template_pid else None

    def _exited(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
        self._done.set()

    def _check_zombie(self) -> None:
        if self._start_ticks is None or self.returncode is not None:
            return
        stat = read_stat(self.pid)
        if stat is None or stat.start_ticks != self._start_ticks or not counts_as_gone(stat):
            return  # running, stopped, in D state, or reaped (the template reports it)
        try:
            code = os.waitstatus_to_exitcode(stat.wait_status or 0)
        except ValueError:
            code = -signal.SIGKILL
        self._exited(code)

    def poll(self) -> int | None:
        self._check_zombie()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = ZOMBIE_CHECK_S if deadline is None else deadline - time.monotonic()
            if self._done.wait(max(0.0, min(left, ZOMBIE_CHECK_S))):
                break
            self._check_zombie()
            if self._done.is_set():
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["worker", str(self.pid)], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode
