"""EtcdServer: ports and data survive restart, the process never outlives its owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.server import EtcdServer


def test_restart_keeps_ports_and_data(no_orphans: None, tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "d") as server:
        endpoint, first_pid = server.endpoint, server.pid
        kv = EtcdKV([endpoint])
        try:
            revision = kv.put("/k", "v")
            server.restart()
            assert server.endpoint == endpoint and server.pid != first_pid
            found = kv.get("/k")
            assert found is not None and found.value == "v" and found.mod_revision == revision
            server.kill()
            server.start()
            assert kv.get("/k") is not None
        finally:
            kv.close()


def test_context_manager_kills_etcd_when_the_body_raises(
    tmp_path: Path, live_descendants: Callable[[], dict[int, str]]
) -> None:
    pid = None
    with pytest.raises(RuntimeError), EtcdServer(tmp_path / "d") as server:
        pid = server.pid
        assert pid is not None and pid in live_descendants()
        raise RuntimeError("test body failed")
    assert pid not in live_descendants()


def test_descendant_scan_sees_a_child_in_its_own_session(
    live_descendants: Callable[[], dict[int, str]],
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal; signal.pause()"], start_new_session=True
    )
    try:
        assert child.pid in live_descendants()
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert child.pid not in live_descendants()
