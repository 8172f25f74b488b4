"""Errors of the cluster layer, all under `elasticpp.errors.ElasticppError`."""

from __future__ import annotations

from elasticpp.errors import ElasticppError


class ClusterError(ElasticppError):
    """Root of the errors raised by `elasticpp.cluster`."""


class ClusterUnavailableError(ClusterError):
    """etcd could not be reached (or did not answer) within the request timeout.

    Raised quickly and by every call, so a caller can keep training and retry later.
    `fast` says whether etcd refused at once (connection refused) rather than timing out.
    """

    def __init__(self, message: str, *, fast: bool = False) -> None:
        super().__init__(message)
        self.fast = fast


class MembershipLapsedError(ClusterUnavailableError):
    """A write as a node was refused by etcd: the node's member key is not on the lease the
    writer holds (the lease lapsed, and the key is gone or not put again yet). Retried as an
    outage is, once the registration is whole again."""

    def __init__(self, node_id: str, lease_id: int) -> None:
        super().__init__(
            f"node {node_id}: its member key is not on its lease {lease_id:x} (lapsed): "
            "the write waits until it is registered again",
            fast=True,
        )
        self.node_id = node_id
        self.lease_id = lease_id


class BarrierTimeoutError(ClusterError):
    """A barrier's deadline passed before every expected node arrived."""

    def __init__(self, barrier: str, missing: list[str]) -> None:
        super().__init__(f"barrier {barrier!r}: timed out waiting for {', '.join(missing)}")
        self.barrier = barrier
        self.missing = missing


class GenerationConflictError(ClusterError):
    """A new generation does not follow the stored one by exactly one."""


class EtcdServerError(ClusterError):
    """A local etcd server could not be found, started or made healthy."""


class ClusterDataError(ClusterError):
    """A value stored in etcd is not what this build can read (bad JSON, newer format)."""


class LeaseNotFoundError(ClusterError):
    """The lease a call used has expired or was revoked."""


class NodeIdConflictError(ClusterError):
    """Another agent (another incarnation) is registered under this agent's node id."""


class ClusterLimitError(ClusterError):
    """A request to etcd or its reply is over a message-size limit. Not an outage: sending
    the same request again fails the same way."""


class ClusterAuthError(ClusterError):
    """etcd refused this client's credentials (user, password, certificate, permission)."""
