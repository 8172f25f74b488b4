"""Is a peer agent alive, and is it healthy? One gRPC health check, retried within a budget.

`check` tells four answers apart:
- DEAD: the connection is refused or reset (a dead agent's port refuses at once: final);
- SILENT: no reply came within `budget_s`: a process gone without a word (power lost, a
  partition) or a live one too slow to answer (a long GIL hold, a page-in, a SIGSTOP, a
  saturated machine). Not final on its own: a caller that evicts for it looks again first
  (elasticpp.agent.liveness); `answers` counts it as no answer;
- NOT_SERVING: the process answers but says it is not healthy (its decision loop stalled,
  or it has not joined the job yet). It is alive: it must not be declared dead, since it may
  recover on its own; a caller may still leave it out of the next plan;
- SERVING: alive and healthy.
A probe that names the node it looks for (`service=node_service(node, incarnation)`) asks
the agent's health service for that node's entry: a process at the address that is not that
incarnation (the address reused by another agent, e.g. a pod IP given to a new pod, or the
same node restarted) answers NOT_FOUND, and the node looked for is DEAD, not alive.
A check that times out is retried until `budget_s` is spent, so one slow reply is not yet
silence. The budget is measured on `clock` (monotonic by default).

With `channels` (`ProbeChannels`, one per agent) a probe goes over a channel kept for its
address from earlier probes instead of a new one: a leader probing a thousand suspects pays
a connection and an HTTP/2 handshake per peer once, not per probe. A kept channel that
answers UNAVAILABLE may be in its reconnect backoff from an earlier failure while the peer is
back: the probe tries once more on a new channel before it says DEAD.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticpp.agent.liveness.step import ProbeResult
from elasticpp.transport import Dialer

__all__ = ["ProbeChannels", "ProbeResult", "answers", "check", "node_service"]

PROBE_TIMEOUT_S = 0.5  # one attempt
PROBE_BUDGET_S = 1.0  # all attempts of one probe
KEPT_CHANNELS = 2048  # peers whose channels an agent keeps (the least recently probed go)
# A kept channel's connection closes after this long unused (it reconnects on the next probe).
CHANNEL_IDLE_MS = 60_000

# Each kept channel its own connection (gRPC shares one per address between a process's
# channels by default): a new channel must try anew, not wait out a kept one's backoff.
_KEPT_OPTIONS = [
    ("grpc.client_idle_timeout_ms", CHANNEL_IDLE_MS),
    ("grpc.use_local_subchannel_pool", 1),
]

# Answers from a process that is there but does not offer a healthy service.
_ALIVE_CODES = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED}


def node_service(node_id: str, incarnation: str) -> str:
    """The health service name under which an agent answers for itself: its node id and
    incarnation (a restarted agent is a new incarnation)."""
    return f"elasticpp.node/{node_id}/{incarnation}"


class ProbeChannels:
    """Channels to peers' agents kept between probes, at most `size` (least recently used
    go first). Thread-safe. A channel that goes is only forgotten, not closed: a probe may
    still be on it, and it closes once that probe lets it go."""

    def __init__(self, size: int = KEPT_CHANNELS, *, dialer: Dialer | None = None) -> None:
        self._dialer = dialer or Dialer()
        self._lock = threading.Lock()
        self._channels: collections.OrderedDict[str, grpc.Channel] = collections.OrderedDict()
        self._size = size

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.pop(address, None)
            if channel is None:
                channel = self._dialer.channel(address, options=_KEPT_OPTIONS)
            self._channels[address] = channel
            while len(self._channels) > self._size:
                self._channels.popitem(last=False)
            return channel

    def forget(self, address: str, channel: grpc.Channel) -> None:
        """Forget `channel` (the next probe of `address` opens a new one)."""
        with self._lock:
            if self._channels.get(address) is channel:
                del self._channels[address]

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), collections.OrderedDict()
        for channel in channels:
            channel.close()


def check(
    address: str,
    *,
    service: str = "",
    timeout_s: float = PROBE_TIMEOUT_S,
    budget_s: float = PROBE_BUDGET_S,
    clock: Callable[[], float] = time.monotonic,
    channels: ProbeChannels | None = None,
) -> ProbeResult:
    """The health of the agent at `address`, within the budget; with `service`, of the one
    agent that answers for it there; with `channels`, over a kept channel (see the module)."""
    deadline = clock() + budget_s
    if channels is None:
        with grpc.insecure_channel(address) as channel:
            return _answer(_check(channel, service, timeout_s, deadline, clock))
    channel = channels.get(address)
    result = _check(channel, service, timeout_s, deadline, clock, kept=True)
    if result is not None:
        return result
    channels.forget(address, channel)  # UNAVAILABLE: tried again on a new channel
    return _answer(_check(channels.get(address), service, timeout_s, deadline, clock))


def _answer(result: ProbeResult | None) -> ProbeResult:
    """What a check on a new channel found (never None: only a kept channel gives way)."""
    return ProbeResult.DEAD if result is None else result


def _check(
    channel: grpc.Channel,
    service: str,
    timeout_s: float,
    deadline: float,
    clock: Callable[[], float],
    *,
    kept: bool = False,
) -> ProbeResult | None:
    """`check` on `channel`; None if `kept` and the channel answered UNAVAILABLE."""
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
            if kept and code == grpc.StatusCode.UNAVAILABLE:
                return None
            if code != grpc.StatusCode.DEADLINE_EXCEEDED:
                return ProbeResult.DEAD  # refused or reset: the process is gone
            if clock() >= deadline:
                return ProbeResult.SILENT
            continue
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return ProbeResult.SERVING
        return ProbeResult.NOT_SERVING


def answers(
    address: str, *, timeout_s: float = PROBE_TIMEOUT_S, budget_s: float = PROBE_BUDGET_S
) -> bool:
    """True if the agent at `address` answers a health check within the budget (healthy or
    not): the process is alive."""
    result = check(address, timeout_s=timeout_s, budget_s=budget_s)
    return result is ProbeResult.SERVING or result is ProbeResult.NOT_SERVING
