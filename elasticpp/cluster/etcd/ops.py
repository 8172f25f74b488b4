"""The messages of etcd's KV API as this project writes and reads them: the typed
operations of a transaction (`Compare`, `Put`, `Delete`), their encoding into etcd's
protobuf messages, a read key-value decoded, the end of a prefix's range, and the one
refusal a caller can act on by reading again (a revision compacted away). Pure: no I/O;
`kv.EtcdKV` sends what this builds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elasticpp.cluster.records import KeyValue
from elasticpp.errors import ConfigError
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb

# etcd's message when a read or a compaction names a revision already compacted away.
COMPACTED = "required revision has been compacted"


def is_compacted(exc: BaseException) -> bool:
    """True when `exc` is etcd's refusal of a revision compacted away."""
    return COMPACTED in str(exc)


@dataclass(frozen=True)
class Compare:
    """An equality test of a transaction: `target` is "value", "mod", "create" or "lease"
    (the id of the lease the key is on, 0 for none)."""

    key: str
    target: str
    value: str | int


@dataclass(frozen=True)
class Put:
    key: str
    value: str
    lease_id: int | None = None


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False  # every key that starts with `key`


def kv_of(kv: Any) -> KeyValue:
    """A key-value of etcd's reply, decoded."""
    return KeyValue(
        kv.key.decode(),
        kv.value.decode(),
        int(kv.mod_revision),
        int(kv.create_revision),
        int(kv.lease),
    )


def byte_prefix_end(prefix: bytes) -> bytes:
    """The end of the range of keys that start with `prefix` (etcd's convention)."""
    raw = bytearray(prefix)
    for i in reversed(range(len(raw))):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"  # every key from `prefix` on


def compare_msg(c: Compare) -> Any:
    msg = pb.Compare(key=c.key.encode(), result=pb.Compare.EQUAL)
    if c.target == "value":
        msg.target = pb.Compare.VALUE
        msg.value = str(c.value).encode()
    elif c.target == "mod":
        msg.target = pb.Compare.MOD
        msg.mod_revision = int(c.value)
    elif c.target == "create":
        msg.target = pb.Compare.CREATE
        msg.create_revision = int(c.value)
    elif c.target == "lease":
        # "Is the key still on my lease": how a registration tells its own key from another's.
        msg.target = pb.Compare.LEASE
        msg.lease = int(c.value)
    else:
        raise ConfigError(f"compare target {c.target!r}: allowed value, mod, create, lease")
    return msg


def op_msg(p: Put | Delete) -> Any:
    if isinstance(p, Delete):
        raw = p.key.encode()
        end = byte_prefix_end(raw) if p.prefix else b""
        return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=raw, range_end=end))
    return pb.RequestOp(
        request_put=pb.PutRequest(key=p.key.encode(), value=p.value.encode(), lease=p.lease_id or 0)
    )
