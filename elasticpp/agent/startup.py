"""Start-up of the agent: serve gRPC (state transfers, control, health), import torch once,
prepare a job's initial weights, and join the job in etcd (the spec checked against the
stored one, the job epoch, warm workers, registration, watches). Joining waits for etcd up
to JOIN_TIMEOUT_S; a node becomes SERVING only once it has joined.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticpp import __version__
from elasticpp.agent.auth import AuthInterceptor, Policy
from elasticpp.agent.jobspec import JobSpec, diff
from elasticpp.agent.limits import (
    EVENT_STREAMS,
    FETCH_STREAMS,
    JOIN_TIMEOUT_S,
    LEASE_STALL_S,
    UNARY_THREADS,
)
from elasticpp.cluster.errors import ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.leases import ProgressGate
from elasticpp.cluster.records import propose_epoch
from elasticpp.errors import ConfigError
from elasticpp.store.grants import fetch_refusal
from elasticpp.store.service import GRPC_OPTIONS, PieceAsk, StateServicer, add_to_server
from elasticpp.transport import TokenFile, is_loopback

log = logging.getLogger("elasticpp.agent")


class StartupPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    _init_dir: Path | None  # step 0 of a job with init_from (`_prepare_init`)

    def start(self) -> None:
        """Serve gRPC, join the job in etcd, start warm workers. Raises on a bad spec."""
        self._serve_grpc()
        # NOT_SERVING until this node has joined the job: a probe (a Kubernetes readiness
        # check, a peer's confirmation) must not take a node that is still waiting for etcd
        # for a working one.
        self.control.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.cfg.metrics_port:
            try:
                self.metrics.serve(self.cfg.metrics_port, addr=self.cfg.metrics_host)
            except OSError as exc:
                raise ConfigError(
                    f"agent: cannot serve metrics on {self.cfg.metrics_host}:"
                    f"{self.cfg.metrics_port}: {exc}"
                ) from exc
        # torch is imported once, off the recovery path: the leader hosts the rendezvous store.
        # Before joining etcd, not beside it: a thread importing torch holds the GIL for
        # seconds, which can starve the lease keep-alive of a freshly registered node.
        self._import_torch()
        self._prepare_init()
        self._etcd_open = True
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            self._heartbeat.busy()  # each try at joining is this loop's work
            try:
                self._join_cluster()
                break
            except (ClusterUnavailableError, LeaseNotFoundError) as exc:
                # etcd busy or restarting: joining waits for it rather than failing the node.
                if time.monotonic() > deadline:
                    raise
                log.warning(
                    "joining job %s: etcd not available (%s); retrying", self.spec.name, exc
                )
                time.sleep(0.5)
        self._joined = True
        self._heartbeat.busy()
        self.control.set_health(health_pb2.HealthCheckResponse.SERVING)
        if self._own_watchdog:
            threading.Thread(
                target=self.control.watch_loop,
                args=(self._stop,),
                daemon=True,
                name="loop-watchdog",
            ).start()
        self.journal.write(
            "decision", f"node {self.node_id} joined job {self.spec.name} at {self.address}"
        )

    def _serve_grpc(self) -> None:
        """Serve state transfers, the control service and health on `cfg.listen` (sets
        `_server`, `_health` and `port`)."""
        from elasticpp.agent.service import AgentServicer
        from elasticpp.rpc.agent.v1 import agent_pb2_grpc

        # Separate limits: event streams and piece transfers each have their own, and the
        # pool keeps UNARY_THREADS beyond both for health checks, status and drains.
        threads = EVENT_STREAMS + FETCH_STREAMS + UNARY_THREADS
        cfg = self.cfg
        self._token = TokenFile(cfg.token_file) if cfg.token_file is not None else None
        policy = Policy(
            tls=cfg.tls is not None,
            token=self._token is not None,
            shared_identity=cfg.tls_shared_identity,
        )
        # One interceptor decides who may call what, for every service served here.
        auth = AuthInterceptor(policy, self._token, self._is_peer)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads),
            # No SO_REUSEPORT: a second process must not silently share this port.
            options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)],
            interceptors=[auth],
        )
        add_to_server(
            self._server,
            StateServicer(
                self.store,
                lambda: self.follower.generation,
                max_fetch_streams=FETCH_STREAMS,
                authorize=self._may_fetch,
            ),
        )
        agent_pb2_grpc.add_AgentServiceServicer_to_server(
            AgentServicer(
                self.control,
                self.journal,
                self.health.lift,
                max_event_streams=EVENT_STREAMS,
            ),
            self._server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if cfg.tls is not None:
            self.port = self._server.add_secure_port(cfg.listen, cfg.tls.server_credentials())
            self.metrics.of(self.metrics.certificate_expiry).set_function(cfg.tls.not_after)
        else:
            if not is_loopback(cfg.listen.rpartition(":")[0].strip("[]")):
                log.warning("--insecure: gRPC on %s is plaintext and unauthenticated", cfg.listen)
            self.port = self._server.add_insecure_port(cfg.listen)
        anonymous = cfg.anonymous_etcd()
        if anonymous:
            log.warning(
                "--insecure: etcd at %s is reached anonymously (whoever can write to it can "
                "stop or misdirect this job)",
                ",".join(anonymous),
            )
        if self.port == 0:
            raise ConfigError(f"agent: cannot listen on {cfg.listen}")
        if cfg.control_socket is not None:
            self._listen_control_socket(cfg.control_socket)
        self._server.start()
        if cfg.health_listen:
            # grpc.health.v1 alone, plaintext (kubelet's probes present no certificate):
            # it says SERVING or NOT_SERVING and nothing else.
            self._health_server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=2),
                options=[("grpc.so_reuseport", 0)],
            )
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            if self._health_server.add_insecure_port(cfg.health_listen) == 0:
                raise ConfigError(f"agent: cannot listen on --health-listen {cfg.health_listen}")
            self._health_server.start()

    def _listen_control_socket(self, path: Path) -> None:
        """The local control socket: calls on it are trusted as the node's operator's (its
        file mode, 0600, lets only this agent's user connect)."""
        if path.is_socket():
            path.unlink()  # a previous agent's, left by a crash
        elif path.exists():
            raise ConfigError(f"agent: --control-socket {path} exists and is not a socket")
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._server.add_insecure_port(f"unix:{path}") == 0:
            raise ConfigError(f"agent: cannot listen on --control-socket {path}")
        os.chmod(path, 0o600)

    def _is_peer(self, node_id: str) -> bool:
        """Whether `node_id` is a node of this job now: a member this node knows, its
        leader, or a node planned in the newest generation record (called on gRPC threads;
        reads the view, writes nothing)."""
        vs = self.view.snapshot
        if node_id in vs.members or node_id == vs.leader:
            return True
        record = vs.record
        return record is not None and node_id in record.planned_set

    def _may_fetch(self, who: str | None, ask: PieceAsk) -> tuple[grpc.StatusCode, str] | None:
        """Whether the node named `who` (its certificate's name) may fetch `ask` now: what
        the plan of this node's generation assigns it (`store.grants`). Without TLS there
        is no name to go by (every door is open: loopback or --insecure); the job's shared
        certificate name passes as any node (documented as weaker). Called on gRPC
        threads; reads the follower's generation, writes nothing."""
        if who is None or who == self.cfg.tls_shared_identity:
            return None
        followed = self.follower.summary()
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
            copies=self.spec.replication_copies,
            every=self.spec.replication_every,
        )
        if why is None:
            return None
        log.warning("refused a state transfer to %s: %s", who[:64], why)
        return grpc.StatusCode.PERMISSION_DENIED, why

    def _prepare_init(self) -> None:
        """A job that starts from trained weights (`init_from`) starts every worker from a
        step-0 directory of this node, converted once here, before joining."""
        if self.spec.init_from is None:
            return
        from elasticpp.train.hf import write_init_step

        self._init_dir = write_init_step(
            self.spec.model, Path(self.spec.init_from), self.cfg.state_dir / "init"
        )
        log.info("initial weights from %s in %s", self.spec.init_from, self._init_dir)

    def _join_cluster(self) -> None:
        """Idempotent: check the spec, start warm workers, register, watch."""
        stored = self.cluster.put_spec_if_absent(self.spec.to_json())
        if stored != self.spec.to_json():
            other = JobSpec.from_json(stored)
            fields = diff(self.spec, other)
            raise ConfigError(
                f"job spec differs from the one job {self.spec.name!r} runs with, in: "
                f"{', '.join(fields) or 'format'}"
            )
        self._check_version()
        # Larger than every epoch this node's store knows, even with its clock behind.
        job_epoch = self.cluster.epoch_if_absent(
            propose_epoch(self.store.newest_epoch()), self.node_id
        )
        self.store.set_epoch(job_epoch.epoch)  # refuses one below this node's own commits
        self.supervisor.spawn_warm()
        if self._registration is None:
            self._registration = self.cluster.register(
                self.node_id, self._member_info(), self.spec.lease_ttl_s, self._lease_gate()
            )
        # The view reads the leader, generation, barriers and the safe step from the job's
        # watch-fed cache, and this node's own member key; each change wakes the loop, and
        # the quarantines', the job end's and the epoch's tell their parts (`_on_watch`).
        # The other member keys are cached on the leader alone.
        self.cluster.follow(self._on_watch, own_node=self.node_id)

    def _check_version(self) -> None:
        """One job's agents run one elasticpp: a job whose leader runs another version is
        refused, naming both (records may change between versions; docs/deploy.md says how
        to upgrade a job). One read: the leader's member key, not every node's."""
        leader = self.cluster.leader()
        if leader is None or leader == self.node_id:
            return
        theirs = self.cluster.member_records([leader]).get(leader, {}).get("version")
        if isinstance(theirs, str) and theirs != __version__:
            raise ConfigError(
                f"job {self.spec.name!r} runs elasticpp {theirs[:40]} (its leader {leader}); "
                f"this agent is elasticpp {__version__}: a job's agents run one version. To "
                "upgrade, stop every agent of the job, then start the new version "
                "(docs/deploy.md, 'Upgrading a job')"
            )

    def _member_info(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "slots": len(self.supervisor.gpus),
            "draining": self.control.summary().draining,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "version": __version__,
        }

    def _fenced(self) -> bool:
        reg = self._registration
        return reg is not None and bool(reg.may_have_lapsed())

    def _lease_gate(self) -> ProgressGate:
        """Leases are renewed only while the decision loop runs (see limits.LEASE_STALL_S)."""
        return ProgressGate(self._heartbeat.stuck_s, LEASE_STALL_S)

    def _import_torch(self) -> None:
        import torch.distributed  # noqa: F401

        self._torch_ready.set()
