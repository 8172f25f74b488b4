"""Range reads in pages (EtcdKV.get_range) on a real etcd: every key, in key order, from one
revision however many pages it takes; no reply larger than a page; a page whose revision was
compacted away starts the read again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.cluster.etcd.server import EtcdServer

KEYS = [f"p/{i:04d}" for i in range(1100)]
VALUE = "v" * 300  # a node's record is a few hundred bytes


@pytest.fixture
def meter() -> EtcdMeter:
    return EtcdMeter()


@pytest.fixture
def kv(etcd: EtcdServer, meter: EtcdMeter) -> Iterator[EtcdKV]:
    client = EtcdKV([etcd.endpoint], meter=meter)
    try:
        for key in KEYS:
            client.put(key, VALUE)
        yield client
    finally:
        client.close()


def _after_first_page(kv: EtcdKV, then: Any) -> None:
    """Run `then()` once, right after the first range reply (between two pages)."""
    unary = kv._unary
    done = [False]

    def wrapped(op: str, method: str, request: Any, **kw: Any) -> Any:
        reply = unary(op, method, request, **kw)
        if method.endswith("/Range") and request.limit and not done[0]:
            done[0] = True
            then()
        return reply

    kv._unary = wrapped  # type: ignore[method-assign]


def test_a_range_larger_than_a_page_is_read_whole_in_bounded_replies(
    kv: EtcdKV, meter: EtcdMeter
) -> None:
    before = meter.reading()
    kvs, revision = kv.get_range("p/", "p0", page_keys=128)
    assert [x.key for x in kvs] == KEYS
    assert all(x.value == VALUE for x in kvs)
    r = meter.reading().minus(before)
    assert r.range_reads == 9  # ceil(1100 / 128)
    assert r.largest_read < 128 * 400  # one page, not 1,100 records (~340 KB)
    assert revision == kv.revision()
    assert kv.get_prefix("p/")[0] == kvs  # the default page: the same answer


def test_a_write_between_pages_is_not_in_the_read(kv: EtcdKV) -> None:
    start = kv.revision()

    def write() -> None:
        kv.put("p/0900", "changed")
        kv.put("p/9999", "new")

    _after_first_page(kv, write)
    kvs, revision = kv.get_range("p/", "p0", page_keys=100)
    assert revision == start
    assert [x.key for x in kvs] == KEYS
    assert {x.key: x.value for x in kvs}["p/0900"] == VALUE


def test_a_read_whose_revision_is_compacted_between_pages_starts_again(kv: EtcdKV) -> None:
    def write_and_compact() -> None:
        kv.put("p/9999", "new")
        kv.compact(kv.revision())

    _after_first_page(kv, write_and_compact)
    kvs, revision = kv.get_range("p/", "p0", page_keys=100)
    assert [x.key for x in kvs] == [*KEYS, "p/9999"]
    assert revision == kv.revision()


def test_a_page_of_no_keys_is_refused(kv: EtcdKV) -> None:
    with pytest.raises(ValueError, match="page_keys"):
        kv.get_range("p/", "p0", page_keys=0)
