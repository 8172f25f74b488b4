"""The watch-fed cache against a real etcd: it follows puts and deletes without reading
again, re-reads after a compaction it missed or a store that went back in revision, and
follows again after an etcd restart without a read."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator

import pytest

from elasticpp.cluster.cache import JobCache, RangeCache
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.kv import EtcdKV, Put
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.keys import JobKeys
from elasticpp.cluster.records import WatchEvent
from elasticpp.waiting import wait_until

P = "/cache/"
END = "/cache0"


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    if not wait_until(cond, timeout_s, interval_s=0.02):
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
def kv(no_orphans: None, etcd: EtcdServer) -> Iterator[EtcdKV]:
    client = EtcdKV([etcd.endpoint], request_timeout_s=1.0)
    yield client
    client.close()


def etcd_state(kv: EtcdKV, prefix: str = P) -> dict[str, str]:
    kvs, _ = kv.get_prefix(prefix)
    return {x.key: x.value for x in kvs}


def cached_state(cache: RangeCache, prefix: str = P) -> dict[str, str]:
    kvs, _ = cache.prefix(prefix)
    return {x.key: x.value for x in kvs}


def same(cache: RangeCache, kv: EtcdKV) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return cached_state(cache) == etcd_state(kv)
        except ClusterUnavailableError:
            return False

    return check


@pytest.mark.timeout(60)
def test_the_cache_follows_puts_and_deletes_with_one_read(kv: EtcdKV) -> None:
    kv.put(P + "a", "1")
    kv.put("/elsewhere", "x")
    cache = RangeCache(kv, P, END)
    try:
        assert cached_state(cache) == {P + "a": "1"}
        ranges = kv.requests().get("Range", 0)
        kv.put(P + "b", "2")
        kv.delete(P + "a")
        kv.txn([], [Put(P + "c", "3"), Put(P + "d", "4")])  # one revision, two events
        revision = kv.put(P + "b", "two")
        wait_for(lambda: cache.get(P + "b")[1] == revision, "the cache at the last put")
        assert cached_state(cache) == {P + "b": "two", P + "c": "3", P + "d": "4"}
        found, at = cache.get(P + "b")
        assert found is not None and found.mod_revision == revision and at == revision
        # Followed by the watch alone: the checks above read etcd only through the cache.
        assert kv.requests().get("Range", 0) == ranges
        assert cache.reads == 1
        assert cached_state(cache) == etcd_state(kv)
    finally:
        cache.cancel()


@pytest.mark.timeout(60)
def test_a_reader_never_sees_part_of_a_transaction(kv: EtcdKV) -> None:
    """A resume instruction and its parts are one transaction: a view that saw the
    instruction without its parts would skip it as unreadable."""
    cache = RangeCache(kv, P, END)
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            kvs, _ = cache.prefix(P)
            revisions = [x.mod_revision for x in kvs]
            seen.append((len(kvs), max(revisions, default=0)))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        for i in range(150):
            kv.txn([], [Put(f"{P}{i}/{m}", "v") for m in "abcdefgh"])
        wait_for(lambda: cache.get(f"{P}149/h")[0] is not None, "the last transaction")
    finally:
        stop.set()
        thread.join(10)
        cache.cancel()
    # Every state a reader saw held whole transactions: eight keys per revision.
    assert all(n % 8 == 0 for n, _ in seen), [s for s in seen if s[0] % 8][:5]


@pytest.mark.timeout(90)
def test_a_compaction_under_a_stopped_watch_makes_the_cache_read_again(
    kv: EtcdKV, etcd: EtcdServer
) -> None:
    """The watch thread is held (its callback blocks) while etcd restarts and the history
    the watch would resume from is compacted: the cache must not serve the gap."""
    held, release = threading.Event(), threading.Event()

    def on_event(_event: WatchEvent) -> None:
        if not held.is_set():
            held.set()
            release.wait(30)

    cache = RangeCache(kv, P, END, on_event=on_event)
    try:
        kv.put(P + "a", "1")
        assert held.wait(10)
        etcd.kill()
        etcd.start()
        wait_for(lambda: _reachable(lambda: kv.put(P + "b", "2")), "etcd back")
        kv.delete(P + "a")
        kv.compact(kv.put(P + "c", "3"))
        release.set()
        # Stale (not served) until read again: the loop's next ensure() does that.
        wait_for(lambda: _reachable(cache.ensure) and cache.reads == 2, "a read again")
        wait_for(lambda: _reachable(lambda: cache.prefix(P)), "its watch open again")
        kv.put(P + "d", "4")
        wait_for(same(cache, kv), "the cache to follow again")
        assert cached_state(cache) == {P + "b": "2", P + "c": "3", P + "d": "4"}
    finally:
        release.set()
        cache.cancel()


@pytest.mark.timeout(90)
def test_the_cache_follows_across_an_etcd_restart_without_reading_again(
    kv: EtcdKV, etcd: EtcdServer
) -> None:
    cache = RangeCache(kv, P, END)
    try:
        kv.put(P + "a", "1")
        etcd.kill()
        wait_for(lambda: _unavailable(lambda: cache.prefix(P)), "the watch to be down")
        etcd.start()
        wait_for(lambda: _reachable(lambda: kv.put(P + "b", "2")), "etcd back")
        kv.delete(P + "a")
        wait_for(same(cache, kv), "the cache to catch up")
        assert cached_state(cache) == {P + "b": "2"}
        assert cache.reads == 1
    finally:
        cache.cancel()


@pytest.mark.timeout(90)
def test_a_new_etcd_behind_the_cache_revision_makes_it_read_again(
    kv: EtcdKV, etcd: EtcdServer
) -> None:
    """etcd replaced by a fresh one (revision 1) on the same address: a watch resumed from
    the old revision would wait for it silently; the cache reads the new store instead."""
    for i in range(20):
        kv.put(P + "old", str(i))
    cache = RangeCache(kv, P, END)
    try:
        etcd.kill()
        shutil.rmtree(etcd.data_dir)
        etcd.start()
        wait_for(lambda: _reachable(cache.ensure) and cache.reads == 2, "a read of the new etcd")
        assert cached_state(cache) == {}
        kv.put(P + "new", "1")
        wait_for(same(cache, kv), "the cache to follow the new etcd")
    finally:
        cache.cancel()


@pytest.mark.timeout(60)
def test_the_job_cache_leaves_every_nodes_frequent_records_to_the_leader(
    kv: EtcdKV,
) -> None:
    """Commit records, the stopped-G, started-G and failed-G arrivals (one per node per
    transition) and the member keys (one per node, all written when a job starts) reach
    only the leader; a follower still sees the rest of the job, and its own member key."""
    keys = JobKeys("j")
    kv.put(keys.barrier("stopped-3", "n1"), "digest")
    kv.put(keys.barrier("started-3", "n1"), "s")
    kv.put(keys.barrier("timelines", "gen-3"), "t")
    kv.put(keys.barrier("resume-3", "resume"), "r")
    kv.put(keys.barrier("done", "n1"), "d")
    kv.put(keys.generation, "g")
    events: list[str] = []
    kv.put(keys.node("n0"), "m0")
    cache = JobCache(kv, keys, lambda e: events.append(e.key), own_node="n1")
    try:
        kv.put(keys.commit(3, "n1"), "c")
        kv.put(keys.node("n2"), "m2")  # another node registers
        kv.put(keys.barrier("stopped-3", "n2"), "digest")
        kv.put(keys.barrier("started-3", "n2"), "s")
        kv.put(keys.barrier("failed-3", "n2"), "f")
        kv.put(keys.barrier("resume-3", "resume-part-0001"), "p")
        last = kv.put(keys.node("n1"), "m")
        wait_for(lambda: keys.node("n1") in events, "the member's event")
        for key in (
            keys.commit(3, "n1"),
            keys.node("n2"),
            keys.barrier("stopped-3", "n2"),
            keys.barrier("started-3", "n2"),
            keys.barrier("failed-3", "n2"),
        ):
            assert key not in events
        assert keys.barrier("resume-3", "resume-part-0001") in events
        assert cache.get(keys.generation)[0] is not None
        assert cache.prefix(keys.barrier_prefix("timelines"))[0][0].value == "t"
        assert cache.prefix(keys.barrier_prefix("done"))[0][0].value == "d"
        assert len(cache.prefix(keys.barrier_prefix("resume-3"))[0]) == 2
        for barrier in ("stopped-3", "started-3", "failed-3"):
            with pytest.raises(ClusterUnavailableError, match="not cached"):
                cache.prefix(keys.barrier_prefix(barrier))
        with pytest.raises(ClusterUnavailableError, match="not cached"):
            cache.prefix(keys.commits_of(3))
        assert cache.get(keys.node("n1"))[0].value == "m"  # its own member key
        assert cache.covers(keys.node("n1")) and not cache.covers(keys.node("n2"))
        for other in ("n0", "n2"):
            with pytest.raises(ClusterUnavailableError, match="not cached"):
                cache.get(keys.node(other))
        with pytest.raises(ClusterUnavailableError, match="not cached"):
            cache.prefix(keys.nodes_prefix)
        cache.serve_leader(True)
        members, _ = cache.prefix(keys.nodes_prefix)
        assert [x.value for x in members] == ["m0", "m", "m2"]
        assert cache.covers(keys.node("n2"))
        assert [x.value for x in cache.prefix(keys.commits_of(3))[0]] == ["c"]
        stopped, _ = cache.prefix(keys.barrier_prefix("stopped-3"))
        assert [x.key for x in stopped] == [
            keys.barrier("stopped-3", "n1"),
            keys.barrier("stopped-3", "n2"),
        ]
        started, _ = cache.prefix(keys.barrier_prefix("started-3"))
        assert [x.value for x in started] == ["s", "s"]
        assert [x.value for x in cache.prefix(keys.barrier_prefix("failed-3"))[0]] == ["f"]
        assert cache.get(keys.node("n1"))[0] is not None
        assert last > 0
    finally:
        cache.close()


def _reachable(fn: Callable[[], object]) -> bool:
    try:
        fn()
        return True
    except ClusterUnavailableError:
        return False


def _unavailable(fn: Callable[[], object]) -> bool:
    return not _reachable(fn)
