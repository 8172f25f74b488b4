"""Is a peer agent alive? One gRPC health check, retried within a budget.

A dead agent's port refuses the connection at once (UNAVAILABLE): that answer is final. A
check that times out comes from a live but slow or briefly stopped process (a long GIL hold,
a page-in, a SIGSTOP): it is retried until `budget_s` is spent, so one slow reply never
gets a live node evicted. Any reply, SERVING or not, means the process is alive.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PROBE_TIMEOUT_S = 0.5  # one attempt
PROBE_BUDGET_S = 1.0  # all attempts of one probe


def answers(
    address: str, *, timeout_s: float = PROBE_TIMEOUT_S, budget_s: float = PROBE_BUDGET_S
) -> bool:
    """True if the agent at `address` answers a health check within the budget."""
    deadline = time.monotonic() + budget_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left_s = deadline - time.monotonic()
            try:
                stub.Check(
                    health_pb2.HealthCheckRequest(), timeout=max(0.05, min(timeout_s, left_s))
                )
                return True
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    return False  # refused or reset: the process is gone
                if time.monotonic() >= deadline:
                    return False
