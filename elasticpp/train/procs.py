"""Supervisor side of the worker protocol: spawn, talk to and kill worker processes.

A `WorkerProcess` runs `python -m elasticpp.train.worker` in its own session (its own
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
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from elasticpp.errors import ElasticppError

log = logging.getLogger(__name__)

EXITED = "exited"  # the synthesized last event of every worker
EVENT_FD_ENV = "ELASTICPP_EVENT_FD"  # the worker's descriptor of the event pipe
# "cuda": the warm worker initialises CUDA (driver, libraries) before it says "ready", so a
# spare's readiness includes it and a recovery does not pay it. No device context is made
# until the assignment names the GPU.
WORKER_DEVICE_ENV = "ELASTICPP_WORKER_DEVICE"


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
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._on_event = on_event
        self._listen_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.returncode: int | None = None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        read_fd, write_fd = os.pipe()
        child_env = dict(env) if env is not None else dict(os.environ)
        child_env[EVENT_FD_ENV] = str(write_fd)
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "elasticpp.train.worker"],
                stdin=subprocess.PIPE,
                stdout=self._log,
                stderr=self._log,
                env=child_env,
                start_new_session=True,
                text=True,
                bufsize=1,
                pass_fds=(write_fd,),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            self._log.close()  # the child holds its own descriptors
            os.close(write_fd)
        self._event_pipe: IO[str] = os.fdopen(read_fd, "r", encoding="utf-8")
        self.pid = self.proc.pid
        self._reader = threading.Thread(
            target=self._read, name=f"worker-{self.pid}-events", daemon=True
        )
        self._reader.start()

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

    def kill(self, *, wait: bool = True) -> None:
        """SIGKILL the worker's whole process group; with `wait`, reap it (up to 10 s).

        A supervisor's loop passes `wait=False`: a process in uninterruptible sleep (a
        driver or NFS hang) outlives SIGKILL for as long as it likes, and the loop must not
        wait with it. The reader thread reaps it when it goes and reports `exited`."""
        self._signal_group(signal.SIGKILL)
        if wait:
            self._reap(10.0)

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
