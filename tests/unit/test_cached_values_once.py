"""`JobReads.values_once`: what the leader derives from N cached records (arrivals)
is derived again only for the keys whose KeyValue changed. The cache keeps the KeyValue
object of an unchanged key, so one arrival of N costs one derivation and N lookups (each
rebuild parsed-once-looked-up, key-split and checked all N: ~3 ms at 2,048 nodes, at every
leader turn of a transition). No etcd: the client is never asked to connect."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.records import KeyValue, dumps


def _kv(node: str, value: Any, rev: int) -> KeyValue:
    record = dumps({"node_id": node, "value": value, "at": 1.0})
    return KeyValue(f"/elasticpp/j/barriers/stopped-2/{node}", record, rev, rev, 0)


@pytest.fixture
def client() -> Iterator[ClusterClient]:
    c = ClusterClient(["127.0.0.1:1"], "j")
    try:
        yield c
    finally:
        c.close()


def test_only_changed_keys_are_derived_again(client: ClusterClient) -> None:
    derived: list[str] = []

    def derive(name: str, record: dict[str, Any]) -> Any:
        derived.append(name)
        if not isinstance(record["value"], dict):
            raise ClusterDataError(f"{name}: not an object")
        return record["value"]

    kvs = [_kv(f"n{i}", {"step": i}, 10 + i) for i in range(4)] + [_kv("bad", "x", 20)]
    first = client.reads.values_once(kvs, "stopped-2 arrival", derive)
    assert first == {f"n{i}": {"step": i} for i in range(4)}
    assert sorted(derived) == ["bad", "n0", "n1", "n2", "n3"]
    skipped = client.skipped_values
    derived.clear()
    # n1 changed (a new KeyValue, as the cache makes for an event); n3 is gone.
    kvs = [kvs[0], _kv("n1", {"step": 7}, 30), kvs[2], kvs[4]]
    again = client.reads.values_once(kvs, "stopped-2 arrival", derive)
    assert again == {"n0": {"step": 0}, "n1": {"step": 7}, "n2": {"step": 2}}
    assert again["n0"] is first["n0"]  # what was derived before, not a copy
    # The changed key once; the bad value again (skipped and counted at every call).
    assert sorted(derived) == ["bad", "n1"] and client.skipped_values == skipped + 1
    # Another derivation of the same records is its own: nothing is taken from the first.
    derived.clear()
    client.reads.values_once(kvs, "stopped-2 other", derive)
    assert sorted(derived) == ["bad", "n0", "n1", "n2"]


def test_what_is_kept_is_what_the_last_answer_held(client: ClusterClient) -> None:
    kvs = [_kv(f"n{i}", {"step": i}, 10 + i) for i in range(100)]
    client.reads.values_once(kvs, "stopped-2 arrival", lambda name, r: r["value"])
    client.reads.values_once(kvs[:3], "stopped-2 arrival", lambda name, r: r["value"])
    assert sorted(client.reads._seen["stopped-2 arrival"]) == [kv.key for kv in kvs[:3]]


def test_a_bounded_number_of_derivations_is_kept(client: ClusterClient) -> None:
    from elasticpp.cluster.reads import MAX_SEEN

    kvs = [_kv(f"n{i}", {"step": i}, 10 + i) for i in range(8)]
    for g in range(3 * MAX_SEEN):  # arrivals of many generations
        client.reads.values_once(kvs, f"stopped-{g} arrival", lambda name, r: r["value"])
        assert len(client.reads._seen) <= MAX_SEEN
    assert f"stopped-{3 * MAX_SEEN - 1} arrival" in client.reads._seen
