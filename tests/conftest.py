"""Shared pytest fixtures: a real etcd server, and a check that a test leaves no processes.

Kept small and general; fixtures of one part live in that part's test files.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.proctree import process_tree


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A running single-member etcd on free loopback ports with its own data dir (~0.2 s).

    Function scope: tests may kill or restart it. It is killed after the test, pass or fail."""
    server = EtcdServer(tmp_path / "etcd-data")
    try:
        server.start()
        yield server
    finally:
        server.close()


def _descendants(root_pid: int) -> dict[int, str]:
    return process_tree(root_pid)


@pytest.fixture
def no_orphans() -> Iterator[None]:
    """Fail a test that leaves child processes behind (and kill them, group and all).

    Catches descendants of the test process that are still running at teardown; a
    process that was re-parented away (double fork) escapes this check."""
    before = set(_descendants(os.getpid()))
    yield
    left = {pid: name for pid, name in _descendants(os.getpid()).items() if pid not in before}
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pgid = os.getpgid(pid)
            if pgid != os.getpgrp():  # never the test runner's own group
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        pytest.fail(f"test left processes running: {sorted(left.items())}")


@pytest.fixture
def live_descendants() -> Callable[[], dict[int, str]]:
    """A callable listing the test process's live descendants (pid -> command name)."""
    return lambda: _descendants(os.getpid())
