"""Keys read into their typed records, and records written once: what the job's health
(`elasticpp.cluster.health`) and the operator's requests (`elasticpp.cluster.requests`)
share. A value that cannot be read is skipped (counted, logged once), never handed on."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.etcd.kv import Compare, EtcdKV, Put
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import dumps, loads

R = TypeVar("R")


class _PerNode(Protocol):
    @property
    def node_id(self) -> str: ...


N = TypeVar("N", bound=_PerNode)


def read_record(
    reads: JobReads, key: str, what: str, parse: Callable[[Mapping[str, Any]], R], cached: bool
) -> R | None:
    """The record at `key`, parsed; None if absent or unreadable (skipped, counted)."""
    kv = reads.get(key, cached)
    if kv is None:
        return None
    try:
        return parse(loads(kv.value, what))
    except ClusterDataError as exc:
        reads.skip(kv.key, exc)
        return None


def read_per_node(
    reads: JobReads, prefix: str, what: str, parse: Callable[[Mapping[str, Any]], N], cached: bool
) -> dict[str, N]:
    """The records under `prefix`, one per node, by node id; one that cannot be read, or is
    filed under another node's id, is skipped (counted)."""
    kvs, _ = reads.get_prefix(prefix, cached)
    out: dict[str, N] = {}
    for kv in kvs:
        node = keymod.last_segment(kv.key)
        try:
            record = parse(loads(kv.value, what))
            if record.node_id != node:
                raise ClusterDataError(f"{what} of {record.node_id!r} filed under {node!r}")
        except ClusterDataError as exc:
            reads.skip(kv.key, exc)
            continue
        out[node] = record
    return out


def put_if_absent(kv: EtcdKV, key: str, value: dict[str, Any]) -> bool:
    """Create `key` with `value` if it is absent; False if a value was there first."""
    ok, _, _ = kv.txn([Compare(key, "create", 0)], [Put(key, dumps(value))])
    return ok
