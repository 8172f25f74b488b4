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
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from elasticpp.agent.jobspec import JobSpec, diff
from elasticpp.agent.limits import (
    EVENT_STREAMS,
    FETCH_STREAMS,
    JOIN_TIMEOUT_S,
    LEASE_STALL_S,
    UNARY_THREADS,
)
from elasticpp.cluster import ClusterClient, ProgressGate
from elasticpp.cluster.errors import ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.records import propose_epoch
from elasticpp.errors import ConfigError
from elasticpp.store.service import GRPC_OPTIONS, StateServicer, add_to_server

log = logging.getLogger("elasticpp.agent")


class StartupPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def start(self) -> None:
        """Serve gRPC, join the job in etcd, start warm workers. Raises on a bad spec."""
        self._serve_grpc()
        # NOT_SERVING until this node has joined the job: a probe (a Kubernetes readiness
        # check, a peer's confirmation) must not take a node that is still waiting for etcd
        # for a working one.
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
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
        self.cluster = ClusterClient(
            list(self.cfg.etcd),
            self.spec.name,
            meter=self._meter,
            kv=self._shared_kv,
            security=self.cfg.etcd_security,
        )
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
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self._own_watchdog:
            threading.Thread(target=self._watch_loop, daemon=True, name="loop-watchdog").start()
        self._event(
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
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads), options=GRPC_OPTIONS
        )
        add_to_server(
            self._server,
            StateServicer(self.store, lambda: self.generation, max_fetch_streams=FETCH_STREAMS),
        )
        agent_pb2_grpc.add_AgentServiceServicer_to_server(
            AgentServicer(self, max_event_streams=EVENT_STREAMS), self._server
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(self.cfg.listen)
        if self.port == 0:
            raise ConfigError(f"agent: cannot listen on {self.cfg.listen}")
        self._server.start()

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
        assert self.cluster is not None
        stored = self.cluster.put_spec_if_absent(self.spec.to_json())
        if stored != self.spec.to_json():
            other = JobSpec.from_json(stored)
            fields = diff(self.spec, other)
            raise ConfigError(
                f"job spec differs from the one job {self.spec.name!r} runs with, in: "
                f"{', '.join(fields) or 'format'}"
            )
        # Larger than every epoch this node's store knows, even with its clock behind.
        job_epoch = self.cluster.epoch_if_absent(
            propose_epoch(self.store.newest_epoch()), self.node_id
        )
        self.store.set_epoch(job_epoch.epoch)  # refuses one below this node's own commits
        self._spawn_warm()
        if self._registration is None:
            self._registration = self.cluster.register(
                self.node_id, self._member_info(), self.spec.lease_ttl_s, self._lease_gate()
            )
        # The view reads the leader, generation, barriers and the safe step from the job's
        # watch-fed cache, and this node's own member key; each change wakes the loop, and
        # the quarantines', the job end's and the epoch's tell their parts (`_on_watch`).
        # The other member keys are cached on the leader alone.
        self.cluster.follow(self._on_watch, own_node=self.node_id)

    def _member_info(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "slots": len(self._ss.gpus),
            "draining": self._cs.draining,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
        }

    def _lease_gate(self) -> ProgressGate:
        """Leases are renewed only while the decision loop runs (see limits.LEASE_STALL_S)."""
        return ProgressGate(self._heartbeat.stuck_s, LEASE_STALL_S)

    def _import_torch(self) -> None:
        import torch.distributed  # noqa: F401

        self._torch_ready.set()
