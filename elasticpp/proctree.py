"""Process trees from /proc (Linux), for killing and checking everything a process started.

Workers run in sessions of their own, so a process-group kill of their supervisor misses
them; walking parent links finds them. A leaf module: standard library only.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path


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


TEMPLATE_MODULE = b"elasticpp.train.forkserver"


def worker_processes(agent_pid: int) -> list[int]:
    """The worker processes under an agent, warm or training: its descendants but its worker
    template (elasticpp.train.forkserver). An exec'd worker is the agent's child, a forked
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
