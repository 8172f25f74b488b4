"""Process trees from /proc (Linux), for killing and checking everything a process started.

Workers run in sessions of their own, so a process-group kill of their supervisor misses
them; walking parent links finds them. A leaf module: standard library only.

Invariants:
- a process that exited is gone, reaped or not: a zombie (state Z) holds no memory, no GPU
  and no descriptor, only its exit status for its parent; a process in uninterruptible
  sleep (D) or stopped (T) holds all of them and is not gone (`counts_as_gone`);
- a process is named by its pid and its start time together (`ProcStat.start_ticks`): a pid
  is reused once its process is reaped, the pair never is;
- `OrphanReaper` reaps only children its process adopted (once seen as another process's
  child, same start time): a child the process started itself is waited for by the code that
  started it, and a status taken from under that code would be lost to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# States of /proc/<pid>/stat of a process that has exited: a zombie (its exit status not yet
# read by its parent) and, for an instant while it is reaped, dead.
EXITED_STATES = frozenset({"Z", "X"})


@dataclass(frozen=True)
class ProcStat:
    """What /proc/<pid>/stat says of a process, the fields read here."""

    state: str  # R, S, D (uninterruptible sleep), T or t (stopped), Z (zombie), ...
    ppid: int
    start_ticks: int  # when it started, in clock ticks after boot
    wait_status: int | None  # its exit status as waitpid reports it (a zombie's; else 0)


def parse_stat(text: str) -> ProcStat:
    """Parse one /proc/<pid>/stat line. Raises ValueError on a line that is not one."""
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
    # the last ')'. Fields are numbered from 1 (proc(5)); fields[0] is field 3.
    fields = text[text.rindex(")") + 2 :].split()
    if len(fields) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    # Field 52, exit_code, since Linux 3.5; shown as 0 to a reader without ptrace access.
    wait_status = int(fields[49]) if len(fields) > 49 else None
    return ProcStat(fields[0], int(fields[1]), int(fields[19]), wait_status)


def read_stat(pid: int) -> ProcStat | None:
    """The process `pid` as /proc shows it now; None if there is none."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError):
        return None


def counts_as_gone(stat: ProcStat | None) -> bool:
    """Whether a process no longer holds anything: it is not there, or it exited and is a
    zombie. A process in uninterruptible sleep (a driver or file system hang) outlives
    SIGKILL with everything it holds, and is not gone; nor is a stopped one."""
    return stat is None or stat.state in EXITED_STATES


def process_tree(root_pid: int) -> dict[int, str]:
    """Live (non-zombie) descendants of `root_pid`: pid -> command name."""
    parent_of: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        parent_of[int(entry.name)] = int(fields[1])
        names[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
    found: dict[int, str] = {}
    frontier = {root_pid}
    while frontier:
        children = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found.keys()
        for pid in sorted(children):
            found[pid] = names[pid]
        frontier = children
    return found


def descendants(root_pid: int) -> list[int]:
    return list(process_tree(root_pid))


def children(pid: int) -> list[int]:
    """Live direct children of `pid`."""
    out = []
    for child in descendants(pid):
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(child)
        except (OSError, ValueError):
            continue
    return out


TEMPLATE_MODULE = b"elasticpp.train.worker.forkserver"


def worker_processes(agent_pid: int) -> list[int]:
    """The worker processes under an agent, warm or training: its descendants but its worker
    template (elasticpp.train.worker.forkserver). An exec'd worker is the agent's child, a forked
    one the template's, and a forked worker keeps the template's command line: the template
    is the agent's child that runs that module."""
    out = []
    for pid in descendants(agent_pid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if parent == agent_pid and TEMPLATE_MODULE in cmdline.split(b"\0"):
            continue
        out.append(pid)
    return out


def blocked_reading_stdin(pid: int) -> bool:
    """Whether `pid` waits in read(0, ...): a warm worker that imported torch and waits for
    its assignment does (x86-64 and arm64 number read 0 and 63)."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] in ("0", "63") and int(fields[1], 16) == 0


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every `finally` kills what it started (the
    benchmarks' runs, stopped by a service manager or `timeout`, leave no process)."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- orphans

PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux 3.4


def become_subreaper() -> bool:
    """Make this process the reaper of the orphans of its tree (Linux): a process whose
    parent dies is re-parented to it rather than to init, so it stays in this process's
    tree (and its stop) and its exit status comes here. Whoever calls this must reap what
    it adopts (`OrphanReaper`). False where it cannot be done."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def child_stats(pid: int) -> dict[int, ProcStat]:
    """The direct children of `pid`, zombies included, with their /proc stat."""
    found: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:  # a child is listed under the thread that forked it (or adopted it)
        with contextlib.suppress(OSError, ValueError):
            found.update(int(c) for c in (task / "children").read_text().split())
    stats = {c: read_stat(c) for c in found}
    return {c: s for c, s in stats.items() if s is not None and s.ppid == pid}


def adopted_zombies(
    children: Mapping[int, ProcStat], seen_elsewhere: Mapping[int, int]
) -> list[int]:
    """The zombie children a subreaper may reap: those it adopted, that is, seen before as
    the child of another process of its tree with the same start time (`seen_elsewhere`:
    pid -> start ticks). A child it started itself never had another parent: its exit
    status is left to the code that waits for it."""
    return sorted(
        pid
        for pid, stat in children.items()
        if stat.state in EXITED_STATES and seen_elsewhere.get(pid) == stat.start_ticks
    )


class OrphanReaper:
    """Reaps the orphans a subreaper (`become_subreaper`) adopts: each scan walks the
    process's tree (its children's /proc entries, not all of /proc), notes the processes
    whose parent is another process of the tree, and reaps the zombie children that were
    such processes (`adopted_zombies`). An orphan that is born and exits between two scans
    is never seen elsewhere and waits for `reap_all_children` at the process's end."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self._seen_elsewhere: dict[int, int] = {}  # pid -> start ticks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scan(self) -> list[tuple[int, int]]:
        """One scan: the adopted orphans reaped now, as (pid, exit code) pairs."""
        with self._lock:
            mine = child_stats(self.pid)
            seen: dict[int, int] = {}
            frontier = list(mine)
            while frontier:
                parent = frontier.pop()
                for pid, stat in child_stats(parent).items():
                    seen[pid] = stat.start_ticks
                    frontier.append(pid)
            reaped: list[tuple[int, int]] = []
            for pid in adopted_zombies(mine, self._seen_elsewhere):
                with contextlib.suppress(ChildProcessError):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done == pid:
                        reaped.append((pid, os.waitstatus_to_exitcode(status)))
            # Keep what is still another's child, and adopted children not yet reaped.
            self._seen_elsewhere = {
                **{p: t for p, t in self._seen_elsewhere.items() if p in mine},
                **seen,
            }
        for pid, code in reaped:
            log.info("reaped orphan %d (exit %d), adopted by this process", pid, code)
        return reaped

    def start(self, every_s: float) -> None:
        def run() -> None:
            while not self._stop.wait(every_s):
                try:
                    self.scan()
                except Exception:  # a scan's error must not end the reaping
                    log.exception("orphan scan failed")

        self._thread = threading.Thread(target=run, name="orphan-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def reap_all_children() -> list[int]:
    """Reap every exited child of this process, adopted or not. Only for the end of a
    process whose own code no longer waits for any child."""
    reaped: list[int] = []
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append(pid)


def _signal_all(pids: Iterator[int] | list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_tree(
    root_pid: int,
    *,
    grace_s: float,
    kill_wait_s: float,
    reap: Callable[[], object] = lambda: None,
) -> list[int]:
    """Stop every process of `root_pid`'s tree (not `root_pid` itself): SIGTERM, then
    SIGCONT (a stopped process handles its SIGTERM only once it runs again), and after
    `grace_s` SIGKILL of what is left (SIGKILL ends a stopped process too); `grace_s` 0:
    SIGKILL at once. `reap` runs before each look at the tree (the root reaps its own
    children and the orphans it adopted). Returns the pids still there after `kill_wait_s`:
    processes in uninterruptible sleep, which outlive any signal."""

    def left() -> list[int]:
        reap()
        return list(process_tree(root_pid))

    if grace_s > 0 and left():
        _signal_all(left(), signal.SIGTERM)
        _signal_all(left(), signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while left() and time.monotonic() < deadline:
            time.sleep(0.05)
    deadline = time.monotonic() + kill_wait_s
    while True:
        pids = left()
        if not pids:
            reap()  # one that exited after the last reap and before the look
            return pids
        if time.monotonic() >= deadline:
            return pids
        _signal_all(pids, signal.SIGKILL)  # again each round: a child forked meanwhile
        time.sleep(0.05)
