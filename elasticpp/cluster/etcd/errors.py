"""etcd's gRPC failures, mapped to the cluster layer's errors: an outage (`fast` when etcd
refused at once, so that a retry is worth it), a lapsed lease, a message over a size limit (not
an outage: the same request fails the same way), refused credentials."""

from __future__ import annotations

from typing import NoReturn

import grpc

from elasticpp.cluster.errors import (
    ClusterAuthError,
    ClusterLimitError,
    ClusterUnavailableError,
    LeaseNotFoundError,
)


def rpc_details(exc: grpc.RpcError) -> str:
    return str(exc.details() if hasattr(exc, "details") else exc)


def is_token_error(exc: grpc.RpcError) -> bool:
    """etcd's answer to a token it no longer accepts (expired, or issued before a restart)."""
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in rpc_details(exc)


def raise_mapped(op: str, exc: grpc.RpcError, limits: tuple[int, int]) -> NoReturn:
    code, details = exc.code(), rpc_details(exc)
    if code == grpc.StatusCode.NOT_FOUND and "lease" in details:
        raise LeaseNotFoundError(f"etcd {op}: {details}") from None
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED or "request is too large" in details:
        send, receive = limits
        raise ClusterLimitError(
            f"etcd {op}: {code.name} {details} (this client sends at most {send} bytes and "
            f"reads at most {receive}; etcd's own limit is its --max-request-bytes)"
        ) from None
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or (
        "authentication failed" in details or "user name is empty" in details
    ):
        raise ClusterAuthError(f"etcd {op}: {code.name} {details}") from None
    # Refused at once (no connection, etcd restarting) is worth another try; a timeout is not.
    fast = code == grpc.StatusCode.UNAVAILABLE
    raise ClusterUnavailableError(f"etcd {op}: {code.name} {details}", fast=fast) from None


def is_watch_token_refusal(reason: str) -> bool:
    """etcd's refusal of a watch for its stream's token: a stale token reads as "permission
    denied" (etcd 3.5 says "invalid auth token" elsewhere)."""
    return "permission denied" in reason or "invalid auth token" in reason
