"""The worker template: one process that imports torch once and forks warm workers.

A warm worker spends seconds of CPU importing torch before it can say "ready" (4 s on a
2-core machine, far more while that machine trains); a node refills its warm pool after
every generation, so every recovery paid those imports again, on the CPUs its training
needs. The template pays them once: it is started with exec like any worker (a
supervisor that holds gRPC or etcd connections never forks), imports what a worker needs
without running anything (no thread pool, no CUDA), and then forks a worker per request
(elasticpp.train.worker.procs.WorkerTemplate, the client). A forked worker is the same program as
an exec'd one from `worker.main()` on: it gets its own session, its stdin, event pipe and
log from the request (passed as descriptors over a Unix socket), and its environment.

Invariants:
- the template forks only while it is single-threaded (a fork copies one thread; a lock or
  a pool that another thread held would be broken in the child): it says whether it is
  when it reports ready, checks again before every fork, and refuses otherwise, and the
  client then spawns workers with exec as before;
- its workers die with it (each worker's parent-death signal), and it dies with its
  supervisor (its own): a killed agent leaves no template and no worker behind;
- it reaps its children and reports each exit status, which only a parent can read.

Protocol (SOCK_SEQPACKET, one JSON object per message): the template sends
`{"event": "ready", "forkable": bool, "why": str}` once; then for each request
`{"op": "fork", "id": n, "env": {...}}` with three descriptors (stdin, event pipe, log) it
answers `{"op": "forked", "id": n, "pid": p}` or `{"op": "refused", "id": n, "why": s}`;
for each `{"op": "ping", "id": n}` (no descriptors) `{"op": "pong", "id": n}`, so that a
template that is stopped or hung is found out between forks; and for each child that exits,
`{"op": "exited", "pid": p, "returncode": rc}` (negative: killed by that signal, as
subprocess reports it).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
from typing import Any, NoReturn

TEMPLATE_FD_ENV = "ELASTICPP_TEMPLATE_FD"  # the template's end of the request socket
EVENT_FD_ENV = "ELASTICPP_EVENT_FD"  # as elasticpp.train.worker.procs.EVENT_FD_ENV
MAX_MESSAGE = 1 << 20


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # unknown: not forkable


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.send(json.dumps(obj, sort_keys=True).encode())


def _die_with_parent() -> int:
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
    return parent


def _become_worker(
    sock: socket.socket, wake: tuple[int, int], fds: list[int], env: dict[str, str]
) -> NoReturn:
    """In the forked child: take the request's descriptors and environment, then run the
    worker's main (which ends the process)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        os.setsid()
        stdin_fd, event_fd, log_fd = fds
        os.dup2(stdin_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        for fd in (stdin_fd, log_fd):
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.environ[EVENT_FD_ENV] = str(event_fd)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        from elasticpp.train.worker import main as worker

        code = worker.main()
    finally:
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"op": "exited", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket, parent: int) -> int:
    """Answer fork requests until the client closes its end or the parent dies."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up descriptor does the work
    signal.set_wakeup_fd(wake_w)
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [], 1.0)
        if os.getppid() != parent:
            return 1
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 4096):
                    pass
        _reap(sock)
        if sock.fileno() not in ready:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 8)
        except ConnectionResetError:
            return 0
        if not msg:
            return 0  # the client closed its end
        try:
            request = json.loads(msg)
            if isinstance(request, dict) and request.get("op") == "ping":
                for fd in fds:
                    os.close(fd)
                _send(sock, {"op": "pong", "id": request.get("id")})
                continue
            rid = request["id"]
            env = {str(k): str(v) for k, v in request["env"].items()}
            if request.get("op") != "fork" or len(fds) != 3:
                raise ValueError(f"not a fork request with 3 descriptors: {request.get('op')!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            for fd in fds:
                os.close(fd)
            _send(sock, {"op": "refused", "id": None, "why": f"bad request: {exc}"})
            continue
        threads = _threads()
        if threads != 1:
            for fd in fds:
                os.close(fd)
            _send(sock, {"op": "refused", "id": rid, "why": f"{threads} threads, not 1"})
            continue
        pid = os.fork()
        if pid == 0:
            _become_worker(sock, (wake_r, wake_w), fds, env)
        for fd in fds:
            os.close(fd)
        _send(sock, {"op": "forked", "id": rid, "pid": pid})


def main() -> int:
    fd = int(os.environ.pop(TEMPLATE_FD_ENV))
    sock = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    parent = _die_with_parent()
    from elasticpp.train.worker import main as worker

    worker.preload()
    threads = _threads()
    forkable = threads == 1
    why = "" if forkable else f"{threads} threads after the imports (a fork copies one)"
    _send(sock, {"event": "ready", "forkable": forkable, "why": why})
    if not forkable:
        return 0
    return serve(sock, parent)


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
