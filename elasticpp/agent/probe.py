"""Is a peer agent alive, and is it healthy? One gRPC health check, retried within a budget.

`check` tells three answers apart:
- DEAD: the connection is refused or reset (a dead agent's port refuses at once: final), or
  no reply came within `budget_s`;
- NOT_SERVING: the process answers but says it is not healthy (its decision loop stalled,
  or it has not joined the job yet). It is alive: it must not be declared dead, since it may
  recover on its own; a caller may still leave it out of the next plan;
- SERVING: alive and healthy.
A probe that names the node it looks for (`service=node_service(node, incarnation)`) asks
the agent's health service for that node's entry: a process at the address that is not that
incarnation (the address reused by another agent, e.g. a pod IP given to a new pod, or the
same node restarted) answers NOT_FOUND, and the node looked for is DEAD, not alive.
A check that times out comes from a live but slow or briefly stopped process (a long GIL hold,
a page-in, a SIGSTOP): it is retried until `budget_s` is spent, so one slow reply never gets a
live node evicted. The budget is measured on `clock` (monotonic by default).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PROBE_TIMEOUT_S = 0.5  # one attempt
PROBE_BUDGET_S = 1.0  # all attempts of one probe

# Answers from a process that is there but does not offer a healthy service.
_ALIVE_CODES = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED}


class ProbeResult(enum.Enum):
    SERVING = "serving"
    NOT_SERVING = "not_serving"
    DEAD = "dead"


def node_service(node_id: str, incarnation: str) -> str:
    """The health service name under which an agent answers for itself: its node id and
    incarnation (a restarted agent is a new incarnation)."""
    return f"elasticpp.node/{node_id}/{incarnation}"


def check(
    address: str,
    *,
    service: str = "",
    timeout_s: float = PROBE_TIMEOUT_S,
    budget_s: float = PROBE_BUDGET_S,
    clock: Callable[[], float] = time.monotonic,
) -> ProbeResult:
    """The health of the agent at `address`, within the budget; with `service`, of the one
    agent that answers for it there (see the module)."""
    deadline = clock() + budget_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left_s = deadline - clock()
            try:
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service=service),
                    timeout=max(0.05, min(timeout_s, left_s)),
                )
            except grpc.RpcError as exc:
                code = exc.code()
                if service and code == grpc.StatusCode.NOT_FOUND:
                    return ProbeResult.DEAD  # another process holds the address now
                if code in _ALIVE_CODES:
                    return ProbeResult.NOT_SERVING
                if code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    return ProbeResult.DEAD  # refused or reset: the process is gone
                if clock() >= deadline:
                    return ProbeResult.DEAD
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return ProbeResult.SERVING
            return ProbeResult.NOT_SERVING


def answers(
    address: str, *, timeout_s: float = PROBE_TIMEOUT_S, budget_s: float = PROBE_BUDGET_S
) -> bool:
    """True if the agent at `address` answers a health check within the budget (healthy or
    not): the process is alive."""
    return check(address, timeout_s=timeout_s, budget_s=budget_s) is not ProbeResult.DEAD
