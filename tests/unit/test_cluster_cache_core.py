"""The watch-fed cache's pure core: a read, then events in revision order, never a gap."""

from __future__ import annotations

from elasticpp.cluster.cache import CacheCore
from elasticpp.cluster.records import EventType, KeyValue, WatchEvent


def put(key: str, value: str, rev: int) -> WatchEvent:
    return WatchEvent(EventType.PUT, key, value, rev, rev, 0)


def delete(key: str, rev: int) -> WatchEvent:
    return WatchEvent(EventType.DELETE, key, None, rev)


def loaded(*kvs: tuple[str, str, int], revision: int = 10) -> CacheCore:
    core = CacheCore()
    core.load([KeyValue(k, v, r, r, 0) for k, v, r in kvs], revision)
    return core


def values(core: CacheCore, prefix: str = "/") -> dict[str, str]:
    return {kv.key: kv.value for kv in core.prefix(prefix)}


def test_puts_and_deletes_after_the_read_are_applied_in_order() -> None:
    core = loaded(("/a", "1", 3), ("/b", "2", 4))
    assert core.apply(put("/a", "one", 11))
    assert core.apply(delete("/b", 12))
    assert core.apply(put("/c", "3", 13))
    assert values(core) == {"/a": "one", "/c": "3"}
    assert core.revision == 13
    kv = core.get("/a")
    assert kv is not None and kv.mod_revision == 11


def test_events_the_read_holds_already_are_dropped() -> None:
    core = loaded(("/a", "new", 9), revision=10)
    assert not core.apply(put("/a", "old", 9))
    assert not core.apply(delete("/a", 10))
    assert values(core) == {"/a": "new"}
    assert core.revision == 10


def test_the_puts_of_one_transaction_share_a_revision_and_all_apply() -> None:
    core = loaded()
    core.apply(put("/g", "2", 11))
    core.apply(put("/h/2", "s", 11))
    assert values(core) == {"/g": "2", "/h/2": "s"}


def test_an_event_older_than_one_applied_invalidates_instead_of_serving_a_gap() -> None:
    core = loaded()
    core.apply(put("/a", "1", 14))
    assert core.apply(put("/b", "2", 12))
    assert not core.loaded
    assert "came after revision 14" in (core.stale_reason or "")


def test_a_resync_invalidates_and_events_after_it_apply_over_the_next_read() -> None:
    core = loaded(("/a", "1", 3))
    core.apply(WatchEvent(EventType.RESYNC, "/", None, 20))
    assert not core.loaded and "before revision 20" in (core.stale_reason or "")
    # Events after the compaction point come while stale: kept, applied if newer than the read.
    core.apply(put("/b", "in-read", 21))
    core.apply(put("/c", "after-read", 23))
    core.apply(delete("/a", 24))
    core.load([KeyValue("/a", "1", 3, 3, 0), KeyValue("/b", "in-read", 21, 21, 0)], 22)
    assert core.loaded and core.stale_reason is None
    assert values(core) == {"/b": "in-read", "/c": "after-read"}
    assert core.revision == 24


def test_nothing_is_loaded_before_the_first_read() -> None:
    core = CacheCore()
    assert not core.loaded and core.stale_reason == "not read yet"
    core.apply(put("/a", "1", 5))
    core.load([], 4)
    assert values(core) == {"/a": "1"}


def test_a_prefix_answer_is_sorted_by_key_and_stays_inside_the_prefix() -> None:
    core = loaded(("/n/b", "2", 1), ("/n/a", "1", 2), ("/nx", "3", 3), ("/m", "0", 4))
    assert [kv.key for kv in core.prefix("/n/")] == ["/n/a", "/n/b"]


def test_prefix_answers_follow_inserts_and_deletes_of_keys() -> None:
    core = loaded(("/n/b", "2", 1), revision=1)
    core.apply(put("/n/a", "1", 2))
    core.apply(put("/n/c", "3", 3))
    core.apply(put("/n/a", "one", 4))  # a key written again is not listed twice
    core.apply(delete("/n/b", 5))
    core.apply(delete("/n/x", 6))  # a key it does not hold: nothing changes
    assert [(kv.key, kv.value) for kv in core.prefix("/n/")] == [("/n/a", "one"), ("/n/c", "3")]


def test_an_unchanged_prefix_is_the_same_answer_until_an_event_under_it() -> None:
    """Readers keep what they derived from an answer while it is the same list (every
    agent parsed every member's record on every read of its view: O(N) a read)."""
    core = loaded(("/n/a", "1", 3), ("/n/b", "2", 4), ("/g", "x", 5))
    members = core.prefix("/n/")
    assert core.prefix("/n/") is members
    core.apply(put("/g", "y", 11))  # elsewhere: the members' answer stands
    assert core.prefix("/n/") is members
    core.apply(put("/n/c", "3", 12))
    changed = core.prefix("/n/")
    assert changed is not members and [kv.value for kv in changed] == ["1", "2", "3"]
    core.apply(delete("/n/a", 13))
    assert [kv.key for kv in core.prefix("/n/")] == ["/n/b", "/n/c"]
    core.invalidate("lost")
    core.load([KeyValue("/n/z", "9", 20, 20, 0)], 20)
    assert [kv.key for kv in core.prefix("/n/")] == ["/n/z"]  # a new read, a new answer
