"""N simulated nodes in one process, each the real `Agent` (elasticpp.agent.node): its decision
loop, parts, executor, etcd client and records, and its gRPC server (liveness probes go over
loopback as on a cluster), against one real etcd. Only the workers
are simulated: `SimWorker` has the methods the agent calls on a worker process and answers at
once ("ready" when started, "started" when assigned, "stopped" when asked to stop), on the
caller's thread, through the same event queue a real worker's reader thread feeds. The store is
the real `LocalStore` on disk; simulated workers snapshot nothing, so it holds no steps and
every generation resumes at step 0 (no transfers, and no holdings for the leader to pull).

A lost node is `SimAgent.crash()` (`Agent.shutdown(lost=True)`): its loop stops without
leaving etcd (no resignation, no revoked lease), its gRPC server stops answering and its etcd
client closes, so its lease lapses after the job's `lease_ttl_s`, as a node that lost power.

By default the agents of one process share one gRPC server (`SharedServer`): each answers the
health checks of its own name there (`probe.node_service`, what peers' probes ask for), and a
crashed agent's name is forgotten, so a probe of it is answered NOT_FOUND and finds it dead at
once, as a refused connection does. A real node runs one server; hundreds in one process would
each wake five times a second to poll (the largest idle cost of a simulated node). No
simulated node serves state transfers or control RPCs: none holds a step to pull or move.
The agents of a process share an address, so a prober keeps one channel a process, not one a
peer (elasticpp.agent.probe.ProbeChannels): a real leader's first round of probes opens a
connection to every suspect.

Invariants: a `SimCluster` owns every agent and thread it starts and `close()` ends them all;
it never writes to etcd itself (the observer only reads); times are on the monotonic clock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.scaleloops import LoopPool
from elasticpp.agent import probe
from elasticpp.agent.jobspec import JobSpec, parse_job_spec
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.agent.server import ServerPorts, serve
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.errors import ElasticppError
from elasticpp.train.worker.procs import EXITED

log = logging.getLogger("elasticpp.bench.scale")

_PIDS = itertools.count(10_000_000)  # above any real pid: a simulated worker is never signalled


class SimWorker:
    """A warm worker without a process: the methods of elasticpp.train.worker.procs.WorkerProcess
    the agent uses, each answered at once with the event a real worker would send."""

    def __init__(
        self,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        name: str = "",
        fails: Callable[[], bool] = lambda: False,
    ) -> None:
        self.name = name
        self._fails = fails  # a sick node's worker: it dies while starting
        self.log_path = log_path
        self.pid = next(_PIDS)
        self.returncode: int | None = None
        self.assignment: dict[str, Any] | None = None
        self._on_event: Callable[[Any, dict[str, Any]], None] | None = None
        self._queued: list[dict[str, Any]] = [{"event": "ready", "pid": self.pid}]
        self._lock = threading.Lock()

    def _deliver(self, event: dict[str, Any]) -> None:
        with self._lock:
            if self._on_event is None:
                self._queued.append(event)
                return
            on_event = self._on_event
        on_event(self, event)

    def listen(self, on_event: Callable[[Any, dict[str, Any]], None]) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
            self._on_event = on_event
        for event in queued:
            on_event(self, event)

    def poll_event(self, timeout_s: float = 0.0) -> dict[str, Any] | None:
        with self._lock:
            return self._queued.pop(0) if self._queued else None

    def send(self, obj: Mapping[str, Any]) -> None:
        if self.returncode is not None:
            raise ElasticppError(f"worker {self.pid}: stdin closed")
        if obj.get("cmd") == "stop_at":
            self._exit({"event": "stopped"}, 0)
        elif self._fails():
            self._exit({"event": "error", "message": "simulated: the device failed"}, 1)
        else:
            self.assignment = dict(obj)
            self._deliver({"event": "started", "setup_seconds": 0.0, "setup": "simulated"})

    def assign(self, assignment: Mapping[str, Any]) -> None:
        self.send(assignment)

    def stop_at(self, step: int) -> None:
        self.send({"cmd": "stop_at", "step": step})

    def alive(self) -> bool:
        return self.returncode is None

    def _exit(self, last: dict[str, Any] | None, returncode: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            self.returncode = returncode
        if last is not None:
            self._deliver(last)
        self._deliver({"event": EXITED, "returncode": returncode})

    def kill(self, *, wait: bool = True, timeout_s: float = 10.0) -> None:
        self._exit(None, -9)

    def fail(self) -> None:
        """Die as a worker whose device failed (from any thread)."""
        self._exit({"event": "error", "message": "simulated: the device failed"}, 1)

    def terminate(self, grace_s: float = 5.0) -> None:
        self._exit(None, -15)


class SharedHealth(health_pb2_grpc.HealthServicer):
    """The health service of a process's simulated agents: each node's status under its
    own name; a name not served (never, or no longer) is NOT_FOUND. The whole server's
    entry ("") is not kept: no probe of a node asks for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, int] = {}

    def set(self, service: str, status: int) -> None:
        if service:
            with self._lock:
                self._status[service] = status

    def forget(self, service: str) -> None:
        with self._lock:
            self._status.pop(service, None)

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)


class SharedServer:
    """One gRPC server (health only) for every simulated agent of a process."""

    THREADS = 32  # the probes of a transition: every follower may probe the leader at once

    def __init__(self) -> None:
        self.health = SharedHealth()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.THREADS))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        if self.port == 0:
            raise ElasticppError("simulated nodes: cannot listen on a loopback port")
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)

    def serve(self, cfg: AgentConfig, ports: ServerPorts) -> _Served:
        """An agent's `ServerFactory`: it answers here under its own name."""
        return _Served(self, probe.node_service(ports.node_id, ports.incarnation))


class _Served:
    """A simulated agent's place on the shared server: stopping it forgets its name."""

    def __init__(self, shared: SharedServer, service: str) -> None:
        self._health = shared.health
        self._service = service
        self.port = shared.port

    def stop(self) -> None:
        self._health.forget(self._service)


class SimAgent(Agent):
    """The real agent; `crash()` ends it as a lost node ends, without leaving etcd. Built
    with `server_factory=shared.serve`, it answers on a `SharedServer` (see the module)."""

    _crashed = False

    def crash(self) -> None:
        self._crashed = True
        self.request_stop()

    def shutdown(self, *, lost: bool = False) -> None:
        super().shutdown(lost=lost or self._crashed)


def sim_spec_fields(name: str, nodes: int, slots: int, lease_ttl_s: int = 3) -> dict[str, Any]:
    """The job spec (as a job file holds it) every simulated cluster of `nodes` x `slots`
    can run: the tiny model, data parallel over every slot (the planner's choice), a batch
    every smaller world divides."""
    return {
        "name": name,
        "model": "tiny",
        "global_batch": 4096,
        "micro_batch": 1,
        "steps": 1_000_000,
        "seed": 0,
        "min_nodes": 1,
        "max_nodes": nodes + 8,  # room for joins
        "lease_ttl_s": lease_ttl_s,
        "join_settle_s": 1.0,
        "snapshot_every": 1_000_000,
        "hang_timeout_s": 3600.0,  # simulated workers report no steps
    }


def sim_spec(name: str, nodes: int, slots: int, lease_ttl_s: int = 3) -> JobSpec:
    return parse_job_spec(sim_spec_fields(name, nodes, slots, lease_ttl_s))


@dataclass(frozen=True)
class SimNode:
    agent: SimAgent
    thread: threading.Thread | None  # its loop's own thread; None on the cluster's LoopPool


class SimCluster:
    """`nodes` simulated agents of one job in this process: one loop thread each, or with
    `loop_threads` their loops' turns on a `LoopPool` of that many threads (and one loop
    watchdog for all of them); a gRPC server each, or with `shared_server` one for all
    (see the module)."""

    def __init__(
        self,
        endpoint: str,
        node_ids: list[str],
        slots: int,
        state_root: Path,
        spec: JobSpec,
        meter: EtcdMeter | None = None,
        *,
        share_etcd: bool = False,
        agents_per_connection: int = 0,
        loop_threads: int = 0,
        shared_server: bool = False,
        parked_threads: int = 0,
        profile_turns: Path | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.slots = slots
        self.state_root = state_root
        self.spec = spec
        self.meter = meter
        self.nodes: dict[str, SimNode] = {}
        self.crashed: set[str] = set()
        self.sick: set[str] = set()  # nodes whose workers fail as they start
        # Shared etcd connections (with `share_etcd`): one for every `agents_per_connection`
        # agents of this process (0: one for all). One watch stream and one keep-alive stream
        # carry the watches and leases of the agents on it, as thousands of connections' idle
        # polling would fill the process's core; etcd serves the same watchers, leases and
        # requests as for a connection per node. Not one for 512 agents: every request takes
        # the channel's and the client's locks, and a holder that waits for the GIL makes
        # hundreds of turns wait behind it (turns of 4-16 s at 1,024 nodes).
        self.share_etcd = share_etcd
        self.agents_per_connection = agents_per_connection
        self.kvs: list[EtcdKV] = []
        self._on_last_kv = 0  # agents on the newest shared connection
        # With a pool, a turn's etcd requests on a shared connection give its slot to another
        # turn while they wait (`LoopPool.waiting`), on one of `parked_threads` more threads.
        self.loops = (
            LoopPool(loop_threads, parked=parked_threads, profile_to=profile_turns)
            if loop_threads > 0
            else None
        )
        self.server = SharedServer() if shared_server else None
        for node_id in node_ids:
            self.add(node_id)

    def add(self, node_id: str) -> SimAgent:
        """Start one more agent (a join when the job runs)."""
        cfg = AgentConfig(
            node_id, (self.endpoint,), "127.0.0.1:0", self.slots, self.state_root / node_id
        )

        def worker(log_path: Path, env: dict[str, str], name: str) -> SimWorker:
            return SimWorker(log_path, env, name, fails=lambda: node_id in self.sick)

        wake = self.loops.wake() if self.loops is not None else None
        agent = SimAgent(
            cfg,
            self.spec,
            worker_factory=worker,
            meter=self.meter,
            etcd_kv=self._kv(),
            wake=wake,
            watchdog=self.loops is None,
            health=self.server.health if self.server is not None else None,
            server_factory=self.server.serve if self.server is not None else serve,
        )
        try:
            agent.start()
        except BaseException:
            agent.shutdown()
            raise
        thread = None
        if self.loops is not None and wake is not None:
            self.loops.add(agent, wake)
        else:
            thread = threading.Thread(target=agent.run, name=f"loop-{node_id}", daemon=True)
            thread.start()
        self.nodes[node_id] = SimNode(agent, thread)
        return agent

    def _kv(self) -> EtcdKV | None:
        """The shared connection the next agent uses (None: it opens its own)."""
        if not self.share_etcd:
            return None
        if not self.kvs or 0 < self.agents_per_connection <= self._on_last_kv:
            # A turn's requests on it wait outside the pool's slots (`LoopPool.waiting`): a
            # node's round trip holds its own turn only.
            waiting = self.loops.waiting if self.loops is not None else None
            self.kvs.append(EtcdKV([self.endpoint], meter=self.meter, around_request=waiting))
            self._on_last_kv = 0
        self._on_last_kv += 1
        return self.kvs[-1]

    def loop_cpu_s(self, node_id: str) -> float:
        """CPU seconds `node_id`'s decision loop has used."""
        node = self.nodes.get(node_id)
        if node is None:
            return 0.0
        if node.thread is None:
            return self.loops.cpu_s(node_id) if self.loops is not None else 0.0
        return thread_cpu_s(node.thread)

    def live(self, *, healthy: bool = False) -> list[SimAgent]:
        """The agents not crashed (and, with `healthy`, not sick)."""
        return [
            n.agent
            for k, n in self.nodes.items()
            if k not in self.crashed and not (healthy and k in self.sick)
        ]

    def crash(self, node_id: str) -> None:
        self.crashed.add(node_id)
        self.nodes[node_id].agent.crash()

    def make_sick(self, node_id: str) -> None:
        """`node_id`'s workers fail now, and every worker it starts fails as it starts."""
        self.sick.add(node_id)
        for w in self.nodes[node_id].agent.pool.workers():
            if isinstance(w.proc, SimWorker):
                w.proc.fail()

    def close(self) -> None:
        for n in self.nodes.values():
            n.agent.request_stop()
        if self.loops is not None:
            self.loops.close()
        for n in self.nodes.values():
            if n.thread is not None:
                n.thread.join(timeout=10.0)
            with contextlib.suppress(Exception):
                n.agent.shutdown()
        for kv in self.kvs:
            kv.close()
        if self.server is not None:
            self.server.stop()


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds `thread` has used (Linux: its own CPU clock)."""
    ident = thread.ident
    if ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, ProcessLookupError):
        return 0.0
