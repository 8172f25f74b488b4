"""Cluster state on etcd v3: membership leases, leader election, plan generations, barriers,
commit records and suspicion. The only package that talks to etcd (through `etcd_client`).

The key layout is documented in `elasticpp.cluster.keys`. Import `EtcdServer` from
`elasticpp.cluster.etcd_server` (it starts a local etcd for tests and the demo).
"""

from elasticpp.cluster.client import ClusterClient, Leadership, Registration, Watch
from elasticpp.cluster.errors import (
    BarrierTimeoutError,
    ClusterDataError,
    ClusterError,
    ClusterUnavailableError,
    GenerationConflictError,
    LeaseNotFoundError,
)
from elasticpp.cluster.records import EventType, GenerationRecord, Members, WatchEvent

__all__ = [
    "BarrierTimeoutError",
    "ClusterClient",
    "ClusterDataError",
    "ClusterError",
    "ClusterUnavailableError",
    "EventType",
    "GenerationConflictError",
    "GenerationRecord",
    "Leadership",
    "LeaseNotFoundError",
    "Members",
    "Registration",
    "Watch",
    "WatchEvent",
]
