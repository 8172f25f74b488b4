"""The etcd client's meter (elasticpp.cluster.etcd.meter) on a real etcd: every request,
its bytes, the largest value written and range read, and watch events are counted; a client
without a meter counts nothing and behaves the same."""

from __future__ import annotations

from elasticpp.cluster.etcd.kv import Compare, EtcdKV, Put, WatchBatch, WatchItem
from elasticpp.cluster.etcd.meter import EtcdMeter, kind_of
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.waiting import wait_until


def test_requests_bytes_sizes_and_watch_events_are_counted(etcd: EtcdServer) -> None:
    meter = EtcdMeter()
    kv = EtcdKV([etcd.endpoint], meter=meter)
    seen: list[WatchItem] = []
    try:
        kv.add_watch("p/", "p0", None, seen.append)
        kv.put("p/a", "x" * 100)
        ok, _, _ = kv.txn([Compare("p/b", "create", 0)], [Put("p/b", "y" * 300)])
        assert ok
        kvs, _ = kv.get_prefix("p/")
        assert [k.key for k in kvs] == ["p/a", "p/b"]
        assert kv.get("p/none") is None
        assert wait_until(lambda: meter.reading().watch_events == 2, 10.0)
    finally:
        kv.close()
    r = meter.reading()
    assert (r.requests, r.writes, r.range_reads, r.prefix_reads) == (4, 2, 2, 1)
    assert r.largest_value == 300
    assert 400 < r.largest_read < 1000  # both keys and values, in one reply
    assert r.bytes_sent > 400 and r.bytes_received > r.largest_read
    assert r.watch_bytes == len("p/a") + 100 + len("p/b") + 300
    assert sum(len(i.events) for i in seen if isinstance(i, WatchBatch)) == 2
    assert r.minus(r).requests == 0 and r.plus(r).requests == 8
    assert meter.by_kind() == {"put p/a": 1, "txn p/b": 1, "range p/": 1, "range p/none": 1}


def test_a_request_kind_names_the_key_class_without_node_ids() -> None:
    assert kind_of("range", b"/elasticpp/j/nodes/", prefix=True) == "range nodes/"
    assert kind_of("put", b"/elasticpp/j/commits/000000000003/n1", prefix=False) == "put commits/"
    assert kind_of("range", b"/elasticpp/j/leader", prefix=False) == "range leader"
