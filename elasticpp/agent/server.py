"""The agent's gRPC servers: state transfers, the control service and health on `--listen`
(TLS and the bearer token when the job has them, one interceptor deciding who may call what),
the local control socket, and the plaintext health-only server for kubelet's probes.

`Doors` says which peer may do what (pure reads of the view and the follower's plan); the
`AgentServer` serves. The agent is built with a `ServerFactory` (default `serve`); a
simulation of many agents in one process gives one that answers on a shared server
(bench/scalesim.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc

from elasticpp.agent.auth import AuthInterceptor, Policy
from elasticpp.agent.config import AgentConfig
from elasticpp.agent.kernel.journal import Journal
from elasticpp.agent.kernel.limits import EVENT_STREAMS, FETCH_STREAMS, UNARY_THREADS
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.ports import HealthPort
from elasticpp.agent.kernel.summaries import FollowerSummary
from elasticpp.agent.service import AgentServicer, StatusPort
from elasticpp.agent.view.step import ViewSnapshot
from elasticpp.errors import ConfigError
from elasticpp.store.grants import fetch_refusal
from elasticpp.store.local import LocalStore
from elasticpp.store.service import GRPC_OPTIONS, PieceAsk, StateServicer, add_to_server
from elasticpp.transport import TokenFile, is_loopback

log = logging.getLogger("elasticpp.agent")

Refusal = tuple[grpc.StatusCode, str]


@dataclass(frozen=True)
class Doors:
    """Who may call this node (called on gRPC threads; reads the view's snapshot and the
    follower's summary, writes nothing)."""

    node_id: str
    shared_identity: str | None  # the job's shared certificate name, if it has one
    copies: int  # the spec's replication_copies and replication_every
    every: int
    view: Callable[[], ViewSnapshot]
    follower: Callable[[], FollowerSummary]

    def is_peer(self, node_id: str) -> bool:
        """Whether `node_id` is a node of this job now: a member this node knows, its
        leader, or a node planned in the newest generation record."""
        vs = self.view()
        if node_id in vs.members or node_id == vs.leader:
            return True
        record = vs.record
        return record is not None and node_id in record.planned_set

    def may_fetch(self, who: str | None, ask: PieceAsk) -> Refusal | None:
        """Whether the node named `who` (its certificate's name) may fetch `ask` now: what
        the plan of this node's generation assigns it (`store.grants`). Without TLS there
        is no name to go by (every door is open: loopback or --insecure); the job's shared
        certificate name passes as any node (documented as weaker)."""
        if who is None or who == self.shared_identity:
            return None
        followed = self.follower()
        if followed.plan is None or followed.generation != ask.generation:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request of generation {ask.generation}; this node is at {followed.generation}",
            )
        why = fetch_refusal(
            followed.plan,
            who,
            self.node_id,
            ask.origin,
            ask.step,
            ask.key,
            copies=self.copies,
            every=self.every,
        )
        if why is None:
            return None
        log.warning("refused a state transfer to %s: %s", who[:64], why)
        return grpc.StatusCode.PERMISSION_DENIED, why


@dataclass(frozen=True)
class ServerPorts:
    """What the servers answer with: the store's pieces, the control part's status and
    drain, the journal's events, the health part's lift, the health service."""

    node_id: str
    incarnation: str
    store: LocalStore
    generation: Callable[[], int]  # the generation this node follows
    control: StatusPort
    journal: Journal
    lift: Callable[[str], tuple[bool, str]]
    health: HealthPort
    metrics: AgentMetrics
    doors: Doors


class Served(Protocol):
    """A started server: the port peers dial, and its stop."""

    @property
    def port(self) -> int: ...
    def stop(self) -> None: ...


ServerFactory = Callable[[AgentConfig, ServerPorts], Served]


class AgentServer:
    """The agent's servers: bound and started by `start` (`serve`), ended by `stop`."""

    def __init__(self, cfg: AgentConfig, ports: ServerPorts) -> None:
        self._cfg = cfg
        self._ports = ports
        self._port = 0
        self._server: grpc.Server | None = None
        self._health_server: grpc.Server | None = None
        self._socket: Path | None = None  # the control socket this server bound

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> None:
        """Bind `--listen` (and the control socket, `--health-listen`) and serve. Raises
        ConfigError naming the address it cannot listen on."""
        cfg, ports = self._cfg, self._ports
        # Separate limits: event streams and piece transfers each have their own, and the
        # pool keeps UNARY_THREADS beyond both for health checks, status and drains.
        threads = EVENT_STREAMS + FETCH_STREAMS + UNARY_THREADS
        token = TokenFile(cfg.token_file) if cfg.token_file is not None else None
        policy = Policy(
            tls=cfg.tls is not None,
            token=token is not None,
            shared_identity=cfg.tls_shared_identity,
        )
        # One interceptor decides who may call what, for every service served here.
        auth = AuthInterceptor(policy, token, ports.doors.is_peer)
        server = self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads),
            # No SO_REUSEPORT: a second process must not silently share this port.
            options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)],
            interceptors=[auth],
        )
        add_to_server(
            server,
            StateServicer(
                ports.store,
                ports.generation,
                max_fetch_streams=FETCH_STREAMS,
                authorize=ports.doors.may_fetch,
            ),
        )
        from elasticpp.rpc.agent.v1 import agent_pb2_grpc

        agent_pb2_grpc.add_AgentServiceServicer_to_server(
            AgentServicer(
                ports.control, ports.journal, ports.lift, max_event_streams=EVENT_STREAMS
            ),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(ports.health, server)
        if cfg.tls is not None:
            self._port = server.add_secure_port(cfg.listen, cfg.tls.server_credentials())
            ports.metrics.of(ports.metrics.certificate_expiry).set_function(cfg.tls.not_after)
        else:
            if not is_loopback(cfg.listen.rpartition(":")[0].strip("[]")):
                log.warning("--insecure: gRPC on %s is plaintext and unauthenticated", cfg.listen)
            self._port = server.add_insecure_port(cfg.listen)
        anonymous = cfg.anonymous_etcd()
        if anonymous:
            log.warning(
                "--insecure: etcd at %s is reached anonymously (whoever can write to it can "
                "stop or misdirect this job)",
                ",".join(anonymous),
            )
        if self._port == 0:
            raise ConfigError(f"agent: cannot listen on {cfg.listen}")
        if cfg.control_socket is not None:
            self._listen_control_socket(server, cfg.control_socket)
        server.start()
        if cfg.health_listen:
            # grpc.health.v1 alone, plaintext (kubelet's probes present no certificate):
            # it says SERVING or NOT_SERVING and nothing else.
            self._health_server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=2),
                options=[("grpc.so_reuseport", 0)],
            )
            health_pb2_grpc.add_HealthServicer_to_server(ports.health, self._health_server)
            if self._health_server.add_insecure_port(cfg.health_listen) == 0:
                raise ConfigError(f"agent: cannot listen on --health-listen {cfg.health_listen}")
            self._health_server.start()

    def stop(self) -> None:
        """Stop serving (idempotent); the control socket this server bound goes."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=0.5)
        health, self._health_server = self._health_server, None
        if health is not None:
            health.stop(grace=0)
        sock, self._socket = self._socket, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.unlink()

    def _listen_control_socket(self, server: grpc.Server, path: Path) -> None:
        """The local control socket: calls on it are trusted as the node's operator's (its
        file mode, 0600, lets only this agent's user connect). A path that holds anything
        but a socket is refused and left as it is."""
        if path.is_socket():
            path.unlink()  # a previous agent's, left by a crash
        elif path.exists():
            raise ConfigError(f"agent: --control-socket {path} exists and is not a socket")
        path.parent.mkdir(parents=True, exist_ok=True)
        if server.add_insecure_port(f"unix:{path}") == 0:
            raise ConfigError(f"agent: cannot listen on --control-socket {path}")
        self._socket = path
        os.chmod(path, 0o600)


def serve(cfg: AgentConfig, ports: ServerPorts) -> AgentServer:
    """Start the agent's servers (`ServerFactory`'s default); a half-started one is
    stopped before its error is raised."""
    server = AgentServer(cfg, ports)
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    return server
