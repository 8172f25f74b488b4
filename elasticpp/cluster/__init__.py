"""Cluster state on etcd v3: membership leases, leader election, plan generations, barriers,
commit records and suspicion. The only package that talks to etcd (through `etcd_client`).

Modules: `client` (the `ClusterClient` calls), `leases` (membership and leadership keys
under leases), `watch` (watches that survive etcd restarts), `arrivals` (barriers, the
resume instruction, suspicion), `commits` (commit records, the safe step, housekeeping),
`records` (the versioned values), `keys` (the key layout).
Import `EtcdServer` from `elasticpp.cluster.etcd_server` (it starts a local etcd for tests
and the demo).
"""

from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import (
    BarrierTimeoutError,
    ClusterAuthError,
    ClusterDataError,
    ClusterError,
    ClusterLimitError,
    ClusterUnavailableError,
    GenerationConflictError,
    LeaseNotFoundError,
    MembershipLapsedError,
    NodeIdConflictError,
)
from elasticpp.cluster.leases import Leadership, ProgressGate, Registration
from elasticpp.cluster.records import (
    EventType,
    GenerationRecord,
    GenerationSummary,
    JobEpoch,
    Members,
    WatchEvent,
)
from elasticpp.cluster.watch import Watch

__all__ = [
    "BarrierTimeoutError",
    "ClusterAuthError",
    "ClusterClient",
    "ClusterDataError",
    "ClusterError",
    "ClusterLimitError",
    "ClusterUnavailableError",
    "EventType",
    "GenerationConflictError",
    "GenerationRecord",
    "GenerationSummary",
    "JobEpoch",
    "Leadership",
    "LeaseNotFoundError",
    "Members",
    "MembershipLapsedError",
    "NodeIdConflictError",
    "ProgressGate",
    "Registration",
    "Watch",
    "WatchEvent",
]
