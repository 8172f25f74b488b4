"""The watches of one etcd client share one thread (elasticpp.cluster.watch), against a real
etcd: every callback runs there, in order per watch; a callback that raises does not stop
the others; `cancel()` waits for a running callback; the thread ends with the last watch and
a broken stream's watches are re-created without one holding the others back."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.records import WatchEvent
from elasticpp.cluster.watch import Watch
from elasticpp.waiting import wait_until


@pytest.fixture
def kv(no_orphans: None, etcd: EtcdServer) -> Iterator[EtcdKV]:
    client = EtcdKV([etcd.endpoint])
    try:
        yield client
    finally:
        client.close()


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("etcd-watches-")]


class Seen:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, list[str]] = {}
        self.threads: set[int] = set()

    def callback(self, name: str, raises: bool = False):  # type: ignore[no-untyped-def]
        def on_event(event: WatchEvent) -> None:
            with self.lock:
                self.values.setdefault(name, []).append(event.value or "")
                self.threads.add(threading.get_ident())
            if raises:
                raise RuntimeError("a callback's bug")

        return on_event

    def count(self, name: str) -> int:
        with self.lock:
            return len(self.values.get(name, []))


@pytest.mark.timeout(60)
def test_the_watches_of_a_client_run_on_one_thread_in_order_and_end_with_the_last(
    kv: EtcdKV,
) -> None:
    before = len(_watch_threads())
    seen = Seen()
    names = [f"k{i}" for i in range(6)]
    watches = [
        Watch(
            kv,
            f"/w/{name}",
            seen.callback(name, raises=(name == "k0")),
            prefix=False,
            start_revision=None,
        )
        for name in names
    ]
    assert len(_watch_threads()) == before + 1  # one thread for six watches
    for i in range(5):
        for name in names:
            kv.put(f"/w/{name}", f"{name}-{i}")
    assert wait_until(lambda: all(seen.count(n) == 5 for n in names), 20.0, interval_s=0.02)
    with seen.lock:
        assert seen.values == {n: [f"{n}-{i}" for i in range(5)] for n in names}
        assert len(seen.threads) == 1  # k0's raising did not stop the others, nor itself
    for watch in watches:
        watch.cancel()
    assert wait_until(lambda: len(_watch_threads()) == before, 10.0, interval_s=0.02)
    # A new watch after the last one left starts a thread again and is served.
    again = Watch(kv, "/w/again", seen.callback("again"), prefix=False, start_revision=None)
    kv.put("/w/again", "x")
    assert wait_until(lambda: seen.count("again") == 1, 10.0, interval_s=0.02)
    again.cancel()


@pytest.mark.timeout(60)
def test_cancel_returns_after_the_running_callback_and_no_callback_follows(kv: EtcdKV) -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow(event: WatchEvent) -> None:
        calls.append(event.value or "")
        entered.set()
        release.wait(10.0)

    watch = Watch(kv, "/c/k", slow, prefix=False, start_revision=None)
    kv.put("/c/k", "first")
    assert entered.wait(10.0)
    kv.put("/c/k", "second")  # queued behind the running callback
    cancelled = threading.Event()

    def cancel() -> None:
        watch.cancel()
        cancelled.set()

    canceller = threading.Thread(target=cancel)
    canceller.start()
    assert not cancelled.wait(0.3)  # the callback still runs: cancel waits for it
    release.set()
    canceller.join(10.0)
    assert cancelled.is_set()
    assert calls == ["first"]  # the queued event is not delivered after the cancel


@pytest.mark.timeout(60)
def test_a_callback_may_cancel_its_own_watch_and_create_another(kv: EtcdKV) -> None:
    got: list[str] = []
    made: list[Watch] = []

    def second(event: WatchEvent) -> None:
        got.append(f"second:{event.value}")

    def first(event: WatchEvent) -> None:
        got.append(f"first:{event.value}")
        own.cancel()  # on the dispatcher's own thread: must not wait for itself
        made.append(Watch(kv, "/s/k", second, prefix=False, start_revision=None))

    own = Watch(kv, "/s/k", first, prefix=False, start_revision=None)
    kv.put("/s/k", "a")
    assert wait_until(lambda: bool(made), 10.0, interval_s=0.02)
    kv.put("/s/k", "b")
    assert wait_until(lambda: "second:b" in got, 10.0, interval_s=0.02)
    assert got == ["first:a", "second:b"]
    made[0].cancel()


@pytest.mark.timeout(90)
def test_watches_on_one_thread_all_resume_after_an_etcd_restart(
    kv: EtcdKV, etcd: EtcdServer
) -> None:
    seen = Seen()
    watches = [
        Watch(kv, f"/r/{i}", seen.callback(str(i)), prefix=False, start_revision=None)
        for i in range(4)
    ]
    for i in range(4):
        kv.put(f"/r/{i}", "before")
    assert wait_until(lambda: all(seen.count(str(i)) == 1 for i in range(4)), 10.0)
    etcd.kill()
    etcd.start()

    def put_all() -> bool:
        try:
            for i in range(4):
                kv.put(f"/r/{i}", "after")
        except ClusterUnavailableError:
            return False
        return True

    assert wait_until(put_all, 30.0, interval_s=0.2)
    assert wait_until(lambda: all(seen.count(str(i)) >= 2 for i in range(4)), 30.0)
    with seen.lock:
        assert all(v[-1] == "after" for v in seen.values.values())
    assert all(w.is_open for w in watches)
    for w in watches:
        w.cancel()
