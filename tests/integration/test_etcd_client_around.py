"""`EtcdKV(around_request=...)` on a real etcd: the context is entered on the calling thread
around each request and left once its answer (or its error) is in, retries inside it; a
keep-alive is a request too. bench/scalesim.py hands a waiting agent's thread to another
agent's turn this way (it overrode a private method of the client before)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.server import EtcdServer


class _Around:
    def __init__(self) -> None:
        self.entered: list[int] = []  # the thread of each entry
        self.inside = 0
        self.exits = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.entered.append(threading.get_ident())
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1
            self.exits += 1


def test_each_request_runs_inside_the_context_on_the_calling_thread(etcd: EtcdServer) -> None:
    around = _Around()
    kv = EtcdKV([etcd.endpoint], around_request=around)
    try:
        kv.put("a/1", "x")
        got = kv.get("a/1")
        assert got is not None and got.value == "x"
        lease = kv.grant(5)
        assert kv.refresh(lease) > 0
        assert around.entered == [threading.get_ident()] * 4
        assert around.inside == 0 and around.exits == 4
    finally:
        kv.close()


def test_a_request_that_fails_leaves_the_context_once() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    around = _Around()
    kv = EtcdKV([f"127.0.0.1:{port}"], around_request=around, request_timeout_s=0.5)
    try:
        with pytest.raises(ClusterUnavailableError):
            kv.get("a/1")  # retried for retry_window_s, all inside one entry
        assert len(around.entered) == 1 and around.exits == 1 and around.inside == 0
    finally:
        kv.close()
