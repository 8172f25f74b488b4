"""The node agent: one per node. It supervises the node's workers, meets the other agents
in etcd, and — as leader — re-plans and resumes training when nodes fail or join.

How one generation runs (DESIGN.md, "Recovery, step by step"):

1. The leader writes generation G (plan, nodes and their addresses, the rendezvous store
   address, why) by compare-and-swap. A loss stops the old workers at once; a join or a
   drain (`graceful`) stops them at the next step boundary, so nothing is recomputed.
2. Every live agent stops its old workers, commits what they handed over, and arrives at
   barrier `stopped-G` with what its store holds.
3. The leader resolves the resume step and, per rank, which pieces to fetch from whom, and
   publishes it as barrier `resume-G`.
4. Agents with ranks fetch (local pieces are hard-linked; remote ones stream over gRPC with
   checksums), hand assignments to WARM workers (torch already imported), and arrive at
   `started-G` when all of theirs report "started".

Fencing: workers rendezvous under the prefix `gen<G>`, state requests carry G and are
refused by a store on a newer generation, and every generation write is a CAS guarded by
the leader key. One loop thread makes every decision; watches and worker readers only wake
it, so there is no lock-ordering to get wrong.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from elasticpp.agent import probe
from elasticpp.agent.decide import (
    ClusterView,
    Phase,
    Replan,
    TransitionError,
    Wait,
    WorkerState,
    decide_replan,
    is_hung,
    live_nodes,
    phase_deadline_s,
    phase_transition,
    transition,
)
from elasticpp.agent.gpuhealth import describe_unhealthy, healthy_gpus, read_gpu_health
from elasticpp.agent.jobspec import JobSpec, diff
from elasticpp.agent.metrics import WORKER_STATES, AgentMetrics
from elasticpp.checkpoint.manifest import PieceKey, step_dirname
from elasticpp.cluster import ClusterClient
from elasticpp.cluster.client import RESUME_MEMBER
from elasticpp.cluster.errors import (
    ClusterDataError,
    ClusterUnavailableError,
    LeaseNotFoundError,
)
from elasticpp.cluster.records import GenerationRecord
from elasticpp.errors import CheckpointError, ConfigError, ElasticppError
from elasticpp.plan import ClusterSpec, ModelSpec, NodeSpec, Plan
from elasticpp.plan.search import plan as plan_layout
from elasticpp.store.client import StateClient
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings
from elasticpp.store.local import LocalStore
from elasticpp.store.persist import Persister, checkpoint_holdings, copy_verified
from elasticpp.store.resolver import resolve
from elasticpp.store.service import GRPC_OPTIONS, StateServicer, add_to_server
from elasticpp.train.procs import EXITED, WorkerProcess
from elasticpp.train.worker import is_snapshot_writer

log = logging.getLogger("elasticpp.agent")

DEAD_RECHECK_S = 2.0  # how often the leader probes nodes it confirmed dead
LEADER_SUSPECT_S = 0.3  # a failure left unanswered this long makes followers probe the leader
STOP_GRACE_S = 20.0  # a graceful stop that takes longer is turned into a kill
MAX_REPLAN_BACKOFF_S = 10.0  # ceiling of the wait between failed generations
JOIN_TIMEOUT_S = 60.0  # how long a starting agent waits for etcd before giving up
GPU_CHECK_INTERVAL_S = 10.0  # NVML health poll, only with --device cuda
LOOP_STALL_S = 10.0  # health turns NOT_SERVING when the decision loop has not run this long
EVENT_STREAMS = 4  # concurrent `ctl events` streams per agent
FETCH_STREAMS = 16  # concurrent piece transfers served per agent
UNARY_THREADS = 8  # server threads kept for health, status, drain and ListSteps
WORKER_LOGS_KEPT = 32  # newest worker log files kept in <state_dir>/logs
METRICS_ROTATE_BYTES = 64 << 20  # metrics.jsonl is rotated (one old file kept) past this
STATUS_EVERY_S = 0.2  # how often the loop publishes the status snapshot the RPCs read


@dataclass(frozen=True)
class AgentConfig:
    node_id: str
    etcd: tuple[str, ...]
    listen: str  # host:port of the agent's gRPC server; port 0 picks a free one
    slots: int
    state_dir: Path
    advertise_host: str = ""  # what peers dial; default: the listen host (127.0.0.1 for 0.0.0.0)
    exit_when_done: bool = True
    backend: str = "gloo"
    device: str = "cpu"
    worker_threads: int | None = 1  # torch threads per CPU worker (None: torch's default)
    metrics_port: int = 0  # Prometheus /metrics on this port; 0 = not served

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ConfigError(f"agent: slots must be >= 1, got {self.slots}")
        if not self.etcd:
            raise ConfigError("agent: --etcd needs at least one HOST:PORT")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"agent: --listen must be HOST:PORT, got {self.listen!r}")
        if not self.advertise_host:
            object.__setattr__(
                self, "advertise_host", "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host
            )


@dataclass
class _Worker:
    proc: WorkerProcess
    rank: int
    generation: int
    plan: Plan
    state: WorkerState = WorkerState.STARTING
    last_progress_s: float = field(default_factory=time.monotonic)
    last_step: int = -1
    killed_by_us: bool = False

    def move(self, new: WorkerState) -> None:
        self.state = transition(self.state, new)


@dataclass
class _GenState:
    """This agent's progress through one generation."""

    record: GenerationRecord
    phase: Phase = Phase.STOPPING
    phase_since_s: float = field(default_factory=time.monotonic)
    stop_sent: bool = False
    stop_began_s: float = field(default_factory=time.monotonic)
    fetch_thread: threading.Thread | None = None
    fetch_error: str | None = None
    fetch_done_at: float | None = None
    resume: dict[str, Any] | None = None
    # Ranks of this node that reported "done": kept here, not on the worker, because a
    # worker's "done" and its exit can arrive in one tick and the exit forgets the worker.
    done_ranks: set[int] = field(default_factory=set)
    # leader bookkeeping
    resume_written: bool = False
    timeline_written: bool = False
    stopped_waiting_since_s: float = field(default_factory=time.monotonic)

    @property
    def generation(self) -> int:
        return self.record.generation

    def enter(self, phase: Phase) -> None:
        self.phase = phase_transition(self.phase, phase)
        self.phase_since_s = time.monotonic()

    def overdue(self, now_s: float, hang_timeout_s: float) -> float | None:
        """The deadline of the current phase if it has passed, else None."""
        deadline = phase_deadline_s(self.phase, hang_timeout_s)
        if deadline is None or now_s - self.phase_since_s <= deadline:
            return None
        return deadline

    @functools.cached_property
    def plan(self) -> Plan:
        return Plan.from_dict(self.record.plan)

    @property
    def graceful(self) -> bool:
        return bool(self.record.extra.get("graceful"))


class Agent:
    def __init__(self, cfg: AgentConfig, spec: JobSpec, *, python: str | None = None) -> None:
        self.cfg = cfg
        self.spec = spec
        self.node_id = cfg.node_id
        self.incarnation = uuid.uuid4().hex[:12]
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = LocalStore(cfg.state_dir / "store", cfg.node_id)
        self.metrics_path = cfg.state_dir / "metrics.jsonl"
        self.log_dir = cfg.state_dir / "logs"
        self.python = python
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._wq: queue.Queue[tuple[WorkerProcess, dict[str, Any]]] = queue.Queue()
        self._warm: list[WorkerProcess] = []  # spawned, maybe not yet ready
        self._ready: set[int] = set()  # pids of warm workers that reported "ready"
        self._workers: dict[int, _Worker] = {}  # by pid, current and old generations
        self._gen: _GenState | None = None
        self._events: deque[tuple[float, str, str, int]] = deque(maxlen=500)
        self._event_cond = threading.Condition()
        self._total_events = 0
        self._replicating = False
        self._last_wait = ""
        self._drain_announced = False
        self._drain_requested_gen = 0
        self._snap_reports: dict[tuple[int, int], set[int]] = {}
        self._pending_failures: dict[int, dict[str, Any]] = {}  # generation -> report
        self._errors_seen: set[tuple[str, str, str]] = set()
        self._fence_logged = False
        self._suspect_since: dict[int, float] = {}  # generation -> failure first seen
        self._leader_probed_s = 0.0
        self._persister: Persister | None = None
        self._joined = False
        self._heartbeat_s = time.monotonic()  # the loop's last iteration (loop-watchdog)
        self._status: dict[str, Any] | None = None  # published by the loop, read by RPCs
        self._status_at_s = 0.0
        self._written_steps: set[tuple[int, int]] = set()
        self.last_step = -1
        self.last_loss = float("nan")
        self._next_step_committed = 0  # steps applied as last seen from our workers
        # cluster view, refreshed from etcd by the loop
        self._dirty = True
        self._members: dict[str, dict[str, Any]] = {}
        self._record: GenerationRecord | None = None
        self._record_rev = 0
        self._leader: str | None = None
        self._barriers: dict[str, dict[str, Any]] = {}
        self._last_join_s = time.monotonic()
        self._init_dir: Path | None = None  # step 0 of a job with init_from (see _prepare_init)
        self._skipped_seen = 0  # unreadable etcd values already counted in the metrics
        self._dead: dict[str, str] = {}  # node -> incarnation confirmed dead by probe
        self._dead_checked_s = 0.0  # when dead nodes were last probed again
        self._etcd_ok = True
        self._last_refresh_s = 0.0
        self._leadership: Any = None
        self._tcpstore: Any = None
        self._store_address: str | None = None
        self._draining = False
        self._drain_deadline_s: float | None = None
        self._done = False
        self._job_done_step: int | None = None
        self._detected: dict[int, float] = {}  # generation -> wall time the change was seen
        self._server: grpc.Server | None = None
        self.port = 0
        self.cluster: ClusterClient | None = None
        self._registration: Any = None
        self._torch_ready = threading.Event()
        self._watches: set[str] = set()
        self._replan_failures = 0
        self._replan_not_before_s = 0.0
        self._gpus = list(range(cfg.slots))  # physical GPUs of the slots, healthy ones only
        self._gpu_checked_s = 0.0
        self.metrics = AgentMetrics.create(cfg.node_id, spec.name)

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        return f"{self.cfg.advertise_host}:{self.port}"

    @property
    def generation(self) -> int:
        return self._gen.generation if self._gen else 0

    def start(self) -> None:
        """Serve gRPC, join the job in etcd, start warm workers. Raises on a bad spec."""
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
        # NOT_SERVING until this node has joined the job: a probe (a Kubernetes readiness
        # check, a peer's confirmation) must not take a node that is still waiting for etcd
        # for a working one.
        self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.cfg.metrics_port:
            try:
                self.metrics.serve(self.cfg.metrics_port)
            except OSError as exc:
                raise ConfigError(
                    f"agent: cannot serve metrics on port {self.cfg.metrics_port}: {exc}"
                ) from exc
        # torch is imported once, off the recovery path: the leader hosts the rendezvous store.
        # Before joining etcd, not beside it: a thread importing torch holds the GIL for
        # seconds, which can starve the lease keep-alive of a freshly registered node.
        self._import_torch()
        self._prepare_init()
        self.cluster = ClusterClient(list(self.cfg.etcd), self.spec.name)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
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
        self._heartbeat_s = time.monotonic()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        threading.Thread(target=self._watch_loop, daemon=True, name="loop-watchdog").start()
        self._event(
            "decision", f"node {self.node_id} joined job {self.spec.name} at {self.address}"
        )

    def _watch_loop(self) -> None:
        """Health follows the decision loop's heartbeat: a wedged loop (a blocked call, a
        stalled disk) makes the node NOT_SERVING, so probes and Kubernetes see the truth."""
        serving = True
        while not self._stop.wait(0.5):
            stalled_s = time.monotonic() - self._heartbeat_s
            ok = stalled_s < LOOP_STALL_S
            if ok == serving:
                continue
            serving = ok
            status = health_pb2.HealthCheckResponse
            if self._server is None:
                return
            self._health.set("", status.SERVING if ok else status.NOT_SERVING)
            if ok:
                log.warning("decision loop running again: health SERVING")
            else:
                log.warning("decision loop stalled for %.1f s: health NOT_SERVING", stalled_s)

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
        self._spawn_warm()
        if self._registration is None:
            self._registration = self.cluster.register(
                self.node_id, self._member_info(), ttl_s=self.spec.lease_ttl_s
            )
        wake = self._on_watch
        keys = self.cluster.keys
        for key, prefix in (
            (keys.nodes_prefix, True),
            (keys.leader, False),
            (keys.generation, False),
            (keys.barriers_prefix, True),
        ):
            if key not in self._watches:
                self.cluster.watch(key, wake, prefix=prefix)
                self._watches.add(key)

    def _member_info(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "slots": len(self._gpus),
            "draining": self._draining,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
        }

    def _import_torch(self) -> None:
        import torch.distributed  # noqa: F401

        self._torch_ready.set()

    def _on_watch(self, _event: Any) -> None:
        self._dirty = True
        self._wake.set()

    def run(self) -> int:
        """The decision loop; returns the exit code."""
        try:
            while not self._stop.is_set():
                self._wake.wait(0.05)
                self._wake.clear()
                self._heartbeat_s = time.monotonic()
                try:
                    self._tick()
                    if self._heartbeat_s - self._status_at_s >= STATUS_EVERY_S:
                        self._status_at_s = self._heartbeat_s
                        self._status = self.status()
                except Exception as exc:  # a daemon survives what comes from outside
                    self._survive("internal", exc)
                if self._done:
                    return 0
            return 0
        finally:
            self.shutdown()

    def _survive(self, source: str, exc: BaseException) -> None:
        """Error policy: nothing from outside (an etcd value, a disk error, a worker event)
        ends the agent. Logged once per distinct error, with its traceback; always counted."""
        self.metrics.errors_total.labels(**self.metrics.labels, source=source).inc()
        key = (source, type(exc).__name__, str(exc)[:200])
        if key in self._errors_seen:
            return
        if len(self._errors_seen) > 1000:
            self._errors_seen.clear()  # bounded: a flood of distinct errors is logged again
        self._errors_seen.add(key)
        log.error(
            "%s error, the agent goes on: %s: %s", source, type(exc).__name__, exc, exc_info=exc
        )

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def shutdown(self) -> None:
        """Kill every process this agent started; leave etcd cleanly if it can."""
        self._stop.set()  # ends the loop watchdog too
        for w in list(self._workers.values()):
            w.proc.kill()
        for p in self._warm:
            p.kill()
        self._warm.clear()
        if self._persister is not None:
            self._persister.close(timeout_s=10.0)
        if self.cluster is not None:
            with contextlib.suppress(ElasticppError):
                if self._leadership is not None:
                    self._leadership.resign()
            with contextlib.suppress(ElasticppError):
                if self._registration is not None:
                    self._registration.close()
            with contextlib.suppress(ElasticppError):
                self.cluster.close()
            self.cluster = None
        if self._server is not None:
            self._server.stop(grace=0.5)
            self._server = None

    # ------------------------------------------------------------------ events log
    def _event(self, kind: str, message: str) -> None:
        log.info("%s", message)
        with self._event_cond:
            self._events.append((time.time(), kind, message, self.generation))
            self._total_events += 1
            self._event_cond.notify_all()

    def events_since(
        self, index: int, timeout_s: float
    ) -> tuple[list[tuple[float, str, str, int]], int]:
        """Events after the `index`-th one ever logged (for the WatchEvents stream)."""
        with self._event_cond:
            total = self._events_total()
            if total <= index:
                self._event_cond.wait(timeout_s)
                total = self._events_total()
            items = list(self._events)
            first = total - len(items)
            return items[max(0, index - first) :], total

    def _events_total(self) -> int:
        return self._total_events

    # ------------------------------------------------------------------ warm pool
    def _spawn_warm(self) -> None:
        """Keep `slots` warm workers: spawned ahead, torch imported, waiting for work."""
        env = dict(os.environ)
        env["ELASTICPP_NODE_ID"] = self.node_id
        if self.cfg.worker_threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(self.cfg.worker_threads))
        while len(self._warm) < self.cfg.slots:
            name = f"{self.node_id}-w{uuid.uuid4().hex[:6]}"
            kwargs: dict[str, Any] = {"env": env, "name": name}
            if self.python:
                kwargs["python"] = self.python
            proc = WorkerProcess(self.log_dir / f"{name}.log", **kwargs)
            proc.listen(lambda p, e: (self._wq.put((p, e)), self._wake.set()))
            self._warm.append(proc)

    def _take_warm(self, count: int) -> list[WorkerProcess] | None:
        ready = [p for p in self._warm if p.pid in self._ready and p.alive()]
        if len(ready) < count:
            return None
        taken = ready[:count]
        self._warm = [p for p in self._warm if p not in taken]
        return taken

    # ------------------------------------------------------------------ the loop
    def _tick(self) -> None:
        self._drain_worker_events()
        self._check_hangs()
        self._check_gpus()
        now = time.monotonic()
        if self._dirty or now - self._last_refresh_s > 1.0:
            self._refresh()
        if not self._etcd_ok:
            return  # training goes on; membership changes wait for etcd
        try:
            self._publish_failures()
            self._check_leader()
            self._maybe_campaign()
            self._follow_generation()
            if self._is_leader():
                self._lead()
            self._check_done()
            self._check_drain()
        except ClusterUnavailableError as exc:
            self._etcd_down(exc)

    def _etcd_down(self, exc: Exception) -> None:
        if self._etcd_ok:
            self._event("decision", f"etcd unreachable ({exc}); training continues, changes wait")
        self._etcd_ok = False
        self.metrics.etcd_up.labels(**self.metrics.labels).set(0)

    def _count_skipped(self) -> None:
        assert self.cluster is not None
        new = self.cluster.skipped_values - self._skipped_seen
        if new > 0:
            self._skipped_seen += new
            self.metrics.etcd_values_skipped_total.labels(**self.metrics.labels).inc(new)

    def _refresh(self) -> None:
        assert self.cluster is not None
        self._dirty = False
        self._last_refresh_s = time.monotonic()
        try:
            members = self.cluster.members().nodes
            record, rev = self.cluster.read_generation()
            leader = self.cluster.leader()
            barriers: dict[str, dict[str, Any]] = {}
            names = ["done", "timelines"]
            gen = record.generation if record else 0
            if gen:
                names += [f"{b}-{gen}" for b in ("stopped", "resume", "started", "failed")]
            for name in names:
                barriers[name], _ = self.cluster.barrier_state(name)
        except ClusterUnavailableError as exc:
            self._etcd_down(exc)
            return
        except ClusterDataError as exc:
            # The generation record itself is unreadable (corrupt, or a newer format): keep
            # the last view and keep training; acting on a guess could break the fencing.
            self.cluster.skip_value(self.cluster.keys.generation, exc)
            return
        finally:
            self._count_skipped()
        if not self._etcd_ok:
            self._event("decision", "etcd reachable again")
            self._etcd_ok = True
        joined = [
            n
            for n, info in members.items()
            if self._members.get(n, {}).get("incarnation") != info.get("incarnation")
        ]
        left = sorted(set(self._members) - set(members))
        next_gen = (record.generation if record else 0) + 1
        if joined:
            self._last_join_s = time.monotonic()
            self._detected.setdefault(next_gen, time.time())
            self._event("membership", f"member(s) joined: {', '.join(sorted(joined))}")
            for n in joined:
                if self._dead.get(n) != members[n].get("incarnation"):
                    self._dead.pop(n, None)
        if left:
            self._event("membership", f"member(s) left: {', '.join(left)}")
            planned = set(record.extra.get("nodes", {})) if record else set()
            if planned & (set(left) - set(self._dead)):
                # A lease lapse is the detection only for a node not already found dead.
                self._detected.setdefault(next_gen, time.time())
        self._members = members
        self._record, self._record_rev = record, rev
        self._leader = leader
        self._barriers = barriers
        self._update_gauges()

    def _update_gauges(self) -> None:
        m, lbl = self.metrics, self.metrics.labels
        m.etcd_up.labels(**lbl).set(1 if self._etcd_ok else 0)
        m.members.labels(**lbl).set(len(self._members))
        m.is_leader.labels(**lbl).set(1 if self._is_leader() else 0)
        m.generation.labels(**lbl).set(self.generation)
        counts = dict.fromkeys(WORKER_STATES, 0)
        counts["warm"] = len(self._warm)
        for w in self._workers.values():
            counts[w.state.value] += 1
        for state, n in counts.items():
            m.workers.labels(**lbl, state=state).set(n)

    # ------------------------------------------------------------------ workers
    def _drain_worker_events(self) -> None:
        while True:
            try:
                proc, event = self._wq.get_nowait()
            except queue.Empty:
                return
            try:
                self._on_worker_event(proc, event)
            except TransitionError as exc:  # a late or reordered event must not end the agent
                log.warning("worker %d: event %s ignored: %s", proc.pid, event.get("event"), exc)
            except (OSError, ElasticppError, ValueError, KeyError, TypeError) as exc:
                # A malformed event, or a disk error (ENOSPC on metrics.jsonl or a manifest):
                # this event is lost, the loop and the other events are not.
                self._survive("worker", exc)

    def _on_worker_event(self, proc: WorkerProcess, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "ready":
            self._ready.add(proc.pid)
            return
        w = self._workers.get(proc.pid)
        if w is None:
            if kind == EXITED and proc in self._warm:
                # A spare that dies (an OOM kill, a crash while importing torch) is replaced
                # at once: the next recovery on this node needs it, and nothing else would
                # refill the pool until an assignment that can no longer happen.
                log.warning(
                    "warm worker %d exited with %s; starting a replacement",
                    proc.pid,
                    event.get("returncode"),
                )
                self._warm.remove(proc)
                self._ready.discard(proc.pid)
                self.metrics.worker_failures_total.labels(**self.metrics.labels).inc()
                if not (self._done or self._draining):
                    self._spawn_warm()
            return
        w.last_progress_s = time.monotonic()
        if kind == "started":
            if w.state is WorkerState.STARTING:  # a stop may already have been asked for
                w.move(WorkerState.RUNNING)
        elif kind == "step":
            w.last_step = int(event["step"])
            self._on_step(w, event)
        elif kind == "snapshot":
            self._on_snapshot(w, event)
        elif kind == "stopped":
            w.move(WorkerState.STOPPED)
        elif kind == "done":
            w.move(WorkerState.DONE)
            if self._gen is not None and w.generation == self._gen.generation:
                self._gen.done_ranks.add(w.rank)
        elif kind == "error":
            log.warning("worker rank %d: %s", w.rank, event.get("message"))
        elif kind == EXITED:
            rc = event.get("returncode")
            if w.state not in (WorkerState.DONE, WorkerState.STOPPED, WorkerState.FAILED):
                w.move(WorkerState.FAILED)
                if not w.killed_by_us:
                    self._report_failure(
                        w.generation, f"worker rank {w.rank} exited with code {rc}"
                    )
            del self._workers[proc.pid]

    def _on_step(self, w: _Worker, event: dict[str, Any]) -> None:
        step, gen = int(event["step"]), int(event.get("generation", w.generation))
        self.last_step = max(self.last_step, step)
        self._next_step_committed = max(self._next_step_committed, step + 1)
        self.last_loss = float(event["loss"])
        if (gen, step) in self._written_steps:
            return
        self._written_steps.add((gen, step))
        m, lbl = self.metrics, self.metrics.labels
        m.step.labels(**lbl).set(step)
        m.loss.labels(**lbl).set(self.last_loss)
        m.steps_total.labels(**lbl).inc()
        if event.get("step_seconds") is not None:
            m.step_seconds.labels(**lbl).observe(float(event["step_seconds"]))
        plan = self._gen.plan if self._gen else None
        line = {
            "step": step,
            "loss": event["loss"],
            "generation": gen,
            "layout": str(plan.layout) if plan else "",
            "time": time.time(),
            "node": self.node_id,
            "lr": event.get("lr"),
            "grad_norm": event.get("grad_norm"),
            "step_seconds": event.get("step_seconds"),
        }
        # Rotated, one old file kept: a job that runs for weeks must not fill the disk.
        with contextlib.suppress(FileNotFoundError):
            if self.metrics_path.stat().st_size > METRICS_ROTATE_BYTES:
                os.replace(self.metrics_path, self.metrics_path.with_name("metrics.jsonl.1"))
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def _on_snapshot(self, w: _Worker, event: dict[str, Any]) -> None:
        step = int(event["step"])
        try:
            self.store.record_pieces(step, event["pieces"], w.generation)
        except CheckpointError as exc:
            # A report that is late (its generation already committed the step) or
            # malformed: what is committed stays as it is.
            log.info("snapshot of step %d from rank %d not recorded: %s", step, w.rank, exc)
            return
        reports = self._snap_reports.setdefault((w.generation, step), set())
        reports.add(w.rank)
        plan = w.plan
        writers = {s.rank for s in plan.ranks_on(self.node_id) if is_snapshot_writer(plan, s.rank)}
        if writers <= reports:
            if self._fenced():
                # Self-fencing: the job may have re-planned without this node; what it
                # computes now must not become state that others resume from.
                if not self._fence_logged:
                    self._fence_logged = True
                    self._event(
                        "decision",
                        f"membership lease may have lapsed: step {step} and later are not "
                        "committed, replicated or persisted until it is renewed",
                    )
                return
            if self._fence_logged:
                self._fence_logged = False
                self._event("decision", "membership lease renewed: committing again")
            try:
                self.store.commit(step, plan.model.units, w.generation)
            except CheckpointError as exc:
                log.warning("step %d not committed: %s", step, exc)
                return
            for old in [k for k in self._snap_reports if k[1] <= step]:
                del self._snap_reports[old]
            if self.cluster is not None:
                # The job's high-water mark: a job that ever committed a step never silently
                # starts over from step 0 when its state is lost.
                with contextlib.suppress(ClusterUnavailableError):
                    self.cluster.record_commit(w.generation, self.node_id, step)
            if self.spec.replication_copies and step % self.spec.replication_every == 0:
                self._replicate_async()
            if (
                self.spec.persist_dir
                and self.spec.persist_every
                and (step % self.spec.persist_every == 0 or step == self.spec.steps)
            ):
                self._persist_async(step, plan.model)

    def _fenced(self) -> bool:
        reg = self._registration
        return reg is not None and bool(reg.may_have_lapsed())

    def _report_failure(self, generation: int, reason: str) -> None:
        self._event("worker", f"failure in generation {generation}: {reason}")
        self.metrics.worker_failures_total.labels(**self.metrics.labels).inc()
        self._detected.setdefault(generation + 1, time.time())
        # Level-triggered: the report stays pending until etcd has it, so a failure seen
        # while etcd is down is published when it returns instead of being lost.
        self._pending_failures.setdefault(generation, {"reason": reason, "at": time.time()})
        self._publish_failures()

    def _publish_failures(self) -> None:
        for generation in sorted(self._pending_failures):
            if self._gen is not None and generation < self._gen.generation:
                del self._pending_failures[generation]  # a newer plan already replaced it
                continue
            if self.cluster is None:
                return
            try:
                self.cluster.arrive(
                    f"failed-{generation}", self.node_id, self._pending_failures[generation]
                )
            except ClusterUnavailableError as exc:
                self._etcd_down(exc)
                return
            del self._pending_failures[generation]

    def _check_hangs(self) -> None:
        now = time.monotonic()
        for w in list(self._workers.values()):
            if w.state is WorkerState.RUNNING and is_hung(
                w.last_progress_s, now, self.spec.hang_timeout_s
            ):
                self._event(
                    "worker",
                    f"worker rank {w.rank} made no progress for "
                    f"{self.spec.hang_timeout_s:.0f} s: killing it",
                )
                w.killed_by_us = True
                w.move(WorkerState.FAILED)
                w.proc.kill()
                self._report_failure(w.generation, f"worker rank {w.rank} hung")

    def _check_gpus(self) -> None:
        """Drop GPUs that NVML reports unhealthy from this node's slots, and have the leader
        re-plan around them."""
        now = time.monotonic()
        if self.cfg.device != "cuda" or now - self._gpu_checked_s < GPU_CHECK_INTERVAL_S:
            return
        self._gpu_checked_s = now
        readings = read_gpu_health()
        if readings is None:
            return
        healthy = set(healthy_gpus(readings))
        lost = [g for g in self._gpus if g not in healthy]
        if not lost:
            return
        self._gpus = [g for g in self._gpus if g in healthy]
        self._event("worker", "unhealthy: " + "; ".join(describe_unhealthy(readings)))
        if self._registration is not None:
            with contextlib.suppress(ElasticppError):
                self._registration.update(self._member_info())
        gs = self._gen
        if gs is not None:
            self._report_failure(gs.generation, f"GPU(s) {lost} unhealthy")

    # ------------------------------------------------------------------ following plans
    def _follow_generation(self) -> None:
        rec = self._record
        if rec is not None and rec.generation > self.generation:
            self._enter_generation(rec)
        gs = self._gen
        if gs is None:
            return
        if gs.phase is Phase.STOPPING:
            self._stop_old_workers(gs)
        if gs.phase is Phase.MOVING:
            self._move_state(gs)
        if gs.phase is Phase.STARTING:
            self._check_started(gs)
        self._check_phase_deadline(gs)

    def _check_phase_deadline(self, gs: _GenState) -> None:
        """Every phase that waits on someone else has a deadline; past it, the agent reports
        the generation failed so that the leader re-plans, instead of waiting for good."""
        if gs.phase is Phase.MOVING and gs.fetch_thread is not None and gs.fetch_thread.is_alive():
            gs.phase_since_s = time.monotonic()  # a transfer in flight has its own timeouts
            return
        deadline = gs.overdue(time.monotonic(), self.spec.hang_timeout_s)
        if deadline is None:
            return
        waited = (
            "the resume instruction or a warm worker"
            if gs.phase is Phase.MOVING
            else ("its ranks to start")
        )
        self._report_failure(
            gs.generation, f"waited {deadline:.0f} s for {waited} ({gs.phase.value})"
        )
        gs.enter(Phase.FAILED)

    def _enter_generation(self, rec: GenerationRecord) -> None:
        old = self._gen
        self._gen = _GenState(rec)
        plan = Plan.from_dict(rec.plan)
        self._event(
            "decision",
            f"generation {rec.generation}: layout {plan.layout} on "
            f"{len(rec.extra.get('nodes', {}))} node(s) ({rec.extra.get('reason', '')}); "
            + (
                "stopping at the next step boundary"
                if rec.extra.get("graceful")
                else "stopping now"
            ),
        )
        del old

    def _old_workers(self, gs: _GenState) -> list[_Worker]:
        return [w for w in self._workers.values() if w.generation < gs.generation]

    def _stop_old_workers(self, gs: _GenState) -> None:
        old = [w for w in self._old_workers(gs) if w.proc.alive()]
        active = [
            w
            for w in old
            if w.state in (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.STOPPING)
        ]
        if gs.graceful and active and not gs.stop_sent:
            for w in active:
                with contextlib.suppress(ElasticppError):
                    w.proc.stop_at(0)  # 0: at the next boundary; ranks agree by all-reduce
                w.move(WorkerState.STOPPING)
            gs.stop_sent = True
        elif (not gs.graceful or time.monotonic() - gs.stop_began_s > STOP_GRACE_S) and old:
            for w in old:
                w.killed_by_us = True
                if w.state not in (WorkerState.DONE, WorkerState.STOPPED, WorkerState.FAILED):
                    w.move(WorkerState.FAILED)
                w.proc.kill()
        if any(w.proc.alive() for w in self._old_workers(gs)):
            return
        self._drain_worker_events()
        # Exits are processed; old workers are gone. Report what this node holds.
        assert self.cluster is not None
        holdings = self.store.holdings()
        self.cluster.arrive(
            f"stopped-{gs.generation}",
            self.node_id,
            {
                "holdings": holdings.to_dict(),
                "next_step": self._next_step_committed,
                "at": time.time(),
            },
        )
        gs.enter(Phase.MOVING)
        log.info("generation %d: old workers stopped; holdings reported", gs.generation)

    def _move_state(self, gs: _GenState) -> None:
        # Whoever leads now may have written it (a leader elected mid-transition takes over
        # the one written by the leader of the record, or writes it if none exists).
        resume = self._barriers.get(f"resume-{gs.generation}", {}).get(RESUME_MEMBER)
        if resume is None:
            return
        plan = gs.plan
        mine = plan.ranks_on(self.node_id)
        if not mine:
            gs.enter(Phase.IDLE)
            self._event("decision", f"generation {gs.generation}: no ranks on this node (spare)")
            self._arrive_started(gs, moved_s=0.0)
            return
        if gs.fetch_thread is None:
            gs.resume = resume
            gs.fetch_thread = threading.Thread(
                target=self._fetch, args=(gs, resume), daemon=True, name="fetch-state"
            )
            gs.fetch_thread.start()
            return
        if gs.fetch_thread.is_alive():
            return
        if gs.fetch_error is not None:
            self._event(
                "decision", f"generation {gs.generation}: state fetch failed: {gs.fetch_error}"
            )
            self._report_failure(gs.generation, f"state fetch failed: {gs.fetch_error}")
            gs.enter(Phase.FAILED)
            return
        workers = self._take_warm(len(mine))
        if workers is None:
            return  # warm workers still importing torch
        self._assign(gs, resume, mine, workers)
        self._spawn_warm()
        gs.enter(Phase.STARTING)

    def _init_path(self) -> str | None:
        return None if self._init_dir is None else str(self._init_dir)

    def _resume_dir(self, gs: _GenState) -> Path:
        return self.cfg.state_dir / "resume" / f"gen-{gs.generation:06d}"

    def _fetch(self, gs: _GenState, resume: dict[str, Any]) -> None:
        try:
            step = int(resume["step"])
            target = self._resume_dir(gs)
            target.mkdir(parents=True, exist_ok=True)
            plan = gs.plan
            wanted: dict[str, tuple[str, str, str, int]] = {}
            for s in plan.ranks_on(self.node_id):
                for name, origin, source, sha, size in resume["fetches"].get(str(s.rank), []):
                    # Names come from etcd: only a piece name, never a path, is used.
                    wanted[PieceKey.parse(str(name)).filename] = (
                        str(origin),
                        str(source),
                        str(sha),
                        int(size),
                    )
            local = [(o, step, n) for n, (o, src, _, _) in wanted.items() if src == self.node_id]
            self.store.materialize(target, local)
            for name, (_o, source, sha, size) in sorted(wanted.items()):
                if source == DISK_SOURCE:  # the persistent checkpoint, for whole-cluster loss
                    assert self.spec.persist_dir is not None
                    src = Path(self.spec.persist_dir) / step_dirname(step) / name
                    copy_verified(src, target / name, sha, size)
            # Sources may lie outside the new plan (a draining node hands its state over).
            addresses = {n: str(i.get("address")) for n, i in self._members.items()}
            addresses.update(gs.record.extra.get("sources", {}))
            addresses.update(gs.record.extra.get("nodes", {}))
            clients: dict[str, StateClient] = {}
            try:
                for name, (origin, source, sha, size) in sorted(wanted.items()):
                    if source in (self.node_id, DISK_SOURCE):
                        continue
                    client = clients.get(source)
                    if client is None:
                        client = clients[source] = StateClient(addresses[source], timeout_s=60)
                    client.fetch_piece(
                        step, name, origin, target / name, sha, gs.generation, expected_size=size
                    )
            finally:
                for c in clients.values():
                    c.close()
            gs.fetch_done_at = time.time()
        except Exception as exc:  # reported to the loop, which reports it to the leader
            gs.fetch_error = f"{type(exc).__name__}: {exc}"

    def _persist_async(self, step: int, model: ModelSpec) -> None:
        """Copy this node's pieces of `step` into the (shared) checkpoint directory; the
        last node to contribute writes the manifest. Off the training path, on one thread
        with a bounded queue: a newer checkpoint supersedes one that is still waiting."""
        assert self.spec.persist_dir is not None
        if self._persister is None:
            self._persister = Persister(self.store, Path(self.spec.persist_dir), keep=2)
        self._persister.submit(step, model)

    def _replicate_async(self) -> None:
        gs = self._gen
        if gs is None or self._replicating:
            return
        try:
            from elasticpp.store.replicate import replicate_once
        except ImportError:
            return
        addresses = dict(gs.record.extra.get("nodes", {}))
        members = {n: str(i.get("address")) for n, i in self._members.items()}
        addresses.update(members)
        ring = sorted(addresses)
        generation = gs.generation

        def run() -> None:
            try:
                replicate_once(
                    self.store, addresses, ring, self.spec.replication_copies, generation
                )
            except Exception as exc:  # replication is best effort; the next round retries
                log.warning("replication failed: %s", exc)
            finally:
                self._replicating = False

        self._replicating = True
        threading.Thread(target=run, daemon=True, name="replicate").start()

    def _assign(
        self, gs: _GenState, resume: dict[str, Any], mine: list[Any], workers: list[WorkerProcess]
    ) -> None:
        step = int(resume["step"])
        host, _, port = (gs.record.store_address or "").rpartition(":")
        job = self.spec.train_config().to_dict()
        for slot, proc in zip(mine, workers, strict=True):
            assignment = {
                "format_version": 1,
                "plan": gs.record.plan,
                "rank": slot.rank,
                "store_host": host,
                "store_port": int(port),
                "store_prefix": f"gen{gs.generation}",
                "job": job,
                "start_step": step,
                "resume_dir": str(self._resume_dir(gs)) if step > 0 else self._init_path(),
                "snapshot_dir": str(self.store.snapshot_dir(gs.generation)),
                "snapshot_every": self.spec.snapshot_every,
                "backend": self.cfg.backend,
                "device": self.cfg.device,
                "num_threads": self.cfg.worker_threads,
                "gpu_index": self._gpus[slot.local_rank] if self.cfg.device == "cuda" else None,
            }
            w = _Worker(proc=proc, rank=slot.rank, generation=gs.generation, plan=gs.plan)
            self._workers[proc.pid] = w
            self._ready.discard(proc.pid)
            proc.assign(assignment)
        self._event(
            "decision",
            f"generation {gs.generation}: started ranks {[s.rank for s in mine]} at step {step}",
        )

    def _check_started(self, gs: _GenState) -> None:
        mine = [w for w in self._workers.values() if w.generation == gs.generation]
        if mine and all(w.state is not WorkerState.STARTING for w in mine):
            moved = gs.fetch_done_at or time.time()
            self._arrive_started(gs, moved_s=moved)
            gs.enter(Phase.RUNNING)
            self._clean_local(gs.generation)

    def _clean_local(self, generation: int) -> None:
        """Bounded disk use for weeks of uptime: resume directories of older generations
        (their workers are gone) and all but the newest worker logs."""
        resume_root = self.cfg.state_dir / "resume"
        if resume_root.is_dir():
            for d in resume_root.iterdir():
                if d.name.startswith("gen-") and d.name < f"gen-{generation:06d}":
                    shutil.rmtree(d, ignore_errors=True)
        if self.log_dir.is_dir():
            logs = sorted(self.log_dir.glob("*.log"), key=lambda p: p.stat().st_mtime)
            for old in logs[:-WORKER_LOGS_KEPT]:
                old.unlink(missing_ok=True)

    def _arrive_started(self, gs: _GenState, moved_s: float) -> None:
        assert self.cluster is not None
        self.cluster.arrive(
            f"started-{gs.generation}", self.node_id, {"moved_at": moved_s, "at": time.time()}
        )

    # ------------------------------------------------------------------ leader
    def _is_leader(self) -> bool:
        # Acts only while the term is held: a loop that stalled past the lease TTL, or whose
        # keep-alive failed, must not write on the strength of what it read before.
        return (
            self._leadership is not None
            and self._leadership.is_held()
            and self._leader == self.node_id
        )

    def _check_leader(self) -> None:
        """Detect by suspicion, confirm by probe, for the leader too: when a failure of the
        current generation has waited LEADER_SUSPECT_S without a new plan, a follower probes
        the leader's agent and, if it is dead (a refused connection is final at once),
        deposes its term so that a new leader is elected now, not after its lease lapses."""
        rec, leader = self._record, self._leader
        if rec is None or leader is None or leader == self.node_id:
            return
        failed = self._barriers.get(f"failed-{rec.generation}", {})
        if not failed:
            self._suspect_since.clear()
            return
        now = time.monotonic()
        since = self._suspect_since.setdefault(rec.generation, now)
        if now - since < LEADER_SUSPECT_S or now - self._leader_probed_s < DEAD_RECHECK_S:
            return
        self._leader_probed_s = now
        address = self._members.get(leader, {}).get("address")
        if address and probe.answers(str(address)):
            return
        assert self.cluster is not None
        if self.cluster.depose(leader):
            self._event("decision", f"leader {leader} confirmed dead by probe: deposed")
            self._dead[leader] = str(self._members.get(leader, {}).get("incarnation", ""))
            self._dirty = True

    def _maybe_campaign(self) -> None:
        deposed = self._leader is not None and self._leader != self.node_id
        if self._leadership is not None and (deposed or not self._leadership.is_held()):
            self._event("decision", f"node {self.node_id} lost the leadership")
            with contextlib.suppress(ElasticppError):
                self._leadership.resign()
            self._leadership = None
            self._dirty = True
            return
        if self._leader is not None or self._draining or self._done:
            return
        assert self.cluster is not None
        if not self._torch_ready.is_set():
            return  # the leader hosts the rendezvous store; wait until torch is imported
        leadership = self.cluster.campaign(self.node_id, ttl_s=self.spec.lease_ttl_s)
        if leadership is None:
            return
        self._leadership = leadership
        self._leader = self.node_id
        self._start_rendezvous_store()
        self._event("decision", f"node {self.node_id} is the leader")

    def _start_rendezvous_store(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        self._tcpstore = TCPStore(
            self.cfg.advertise_host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )
        self._store_address = f"{self.cfg.advertise_host}:{self._tcpstore.port}"

    def _view(self) -> ClusterView:
        rec = self._record
        current = tuple(sorted(rec.extra.get("nodes", {}))) if rec else None
        failed = set(self._barriers.get(f"failed-{rec.generation}", {})) if rec else set()
        dead = {
            n for n, inc in self._dead.items() if self._members.get(n, {}).get("incarnation") == inc
        }
        recorded = rec.extra.get("incarnations", {}) if rec else {}
        restarted = {
            n
            for n, inc in recorded.items()
            if n in self._members and self._members[n].get("incarnation") != inc
        }
        return ClusterView(
            members=self._members,
            dead=dead,
            current_nodes=current,
            failed=failed,
            now_s=time.monotonic(),
            last_join_s=self._last_join_s,
            job_done=self._job_done_step is not None,
            restarted=restarted,
        )

    def _probe(self, nodes: list[str]) -> set[str]:
        """The nodes whose agent does not answer a health check (dead, not just slow)."""

        def check(node: str) -> bool:
            address = self._members.get(node, {}).get("address")
            return bool(address) and probe.answers(str(address))

        others = [n for n in nodes if n != self.node_id]
        with futures.ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
            alive = dict(zip(others, pool.map(check, others), strict=True))
        return {n for n, ok in alive.items() if not ok}

    def _recheck_dead(self) -> None:
        """A node confirmed dead that still holds its registration is probed again now and
        then: if it answers (it was only slow or stopped for a while), it is no longer dead,
        and the leader takes it back as it would a joining node."""
        now = time.monotonic()
        if not self._dead or now - self._dead_checked_s < DEAD_RECHECK_S:
            return
        self._dead_checked_s = now
        registered = [
            n for n, inc in self._dead.items() if self._members.get(n, {}).get("incarnation") == inc
        ]
        back = set(registered) - self._probe(registered)
        for n in sorted(back):
            del self._dead[n]
            self._last_join_s = now
            self._event("decision", f"node {n} answers again: no longer dead")

    def _confirm_dead(self, nodes: list[str]) -> None:
        for n in self._probe(nodes):
            inc = str(self._members.get(n, {}).get("incarnation", ""))
            if self._dead.get(n) != inc:
                self._dead[n] = inc
                self._event("decision", f"node {n} confirmed dead by probe")

    def _lead(self) -> None:
        self._recheck_dead()
        rec = self._record
        view = self._view()
        if (
            rec is not None
            and view.failed
            and not (set(self._dead) & set(view.current_nodes or ()))
        ):
            # Suspicion (a worker failure) is confirmed by probing before the TTL lapses.
            self._confirm_dead([n for n in (view.current_nodes or ()) if n != self.node_id])
            view = self._view()
        decision = decide_replan(
            view,
            min_nodes=self.spec.min_nodes,
            max_nodes=self.spec.max_nodes,
            settle_s=self.spec.join_settle_s,
        )
        gs = self._gen
        in_progress = (
            gs is not None
            and rec is not None
            and gs.generation == rec.generation
            and gs.phase in (Phase.STOPPING, Phase.MOVING)
            and not gs.resume_written
        )
        if isinstance(decision, Replan):
            if time.monotonic() < self._replan_not_before_s:
                return
            if not (decision.graceful and in_progress):
                self._write_generation(decision, view)
                return
        elif isinstance(decision, Wait) and self._last_wait != decision.reason:
            self._last_wait = decision.reason
            self._event("decision", f"waiting: {decision.reason}")
        if rec is None or gs is None or gs.generation != rec.generation:
            return
        self._lead_resume(gs, view)
        self._lead_timeline(gs)

    def _write_generation(self, decision: Replan, view: ClusterView) -> None:
        assert self.cluster is not None
        rec = self._record
        generation = (rec.generation if rec else 0) + 1
        nodes = [NodeSpec(n, int(self._members[n].get("slots", 1))) for n in decision.nodes]
        cluster = ClusterSpec(tuple(nodes), self.spec.device_spec())
        try:
            result = plan_layout(
                self.spec.model,
                cluster,
                self.spec.global_batch,
                micro_batch=self.spec.micro_batch,
                top_k=0,
            )
        except ElasticppError as exc:
            if self._last_wait != str(exc):
                self._last_wait = str(exc)
                self._event("decision", f"cannot plan for {list(decision.nodes)}: {exc}")
            return
        plan = result.best.with_generation(generation)
        extra = {
            "reason": decision.reason,
            "graceful": decision.graceful if rec is not None else False,
            "nodes": {n: str(self._members[n]["address"]) for n in decision.nodes},
            # Every live node may serve state, also one outside the new plan (draining).
            "sources": {
                n: str(self._members[n]["address"]) for n in live_nodes(view) if n in self._members
            },
            # A node whose agent restarts lost its workers: the plan must change even if the
            # node id came back before its lease lapsed.
            "incarnations": {n: str(self._members[n].get("incarnation")) for n in decision.nodes},
            "previous_layout": Plan.from_dict(rec.plan).layout.__str__() if rec else "",
            "detected_at": self._detection_time(generation),
            "planned_at": time.time(),
        }
        record = GenerationRecord(
            generation=generation,
            plan=plan.to_dict(),
            leader=self.node_id,
            created_at=time.time(),
            store_address=self._store_address,
            extra=extra,
        )
        if self.cluster.write_generation(record, self._record_rev, self._leadership):
            # Back off when generations keep failing before they train (a bug or a bad
            # node must not turn into a re-plan storm); a generation that trains resets it.
            self._replan_failures = 0 if decision.graceful else self._replan_failures + 1
            backoff_s = 0.0
            if self._replan_failures > 2:
                backoff_s = min(MAX_REPLAN_BACKOFF_S, 0.25 * 2 ** (self._replan_failures - 3))
            self._replan_not_before_s = time.monotonic() + backoff_s
            for g in [g for g in self._detected if g <= generation]:
                del self._detected[g]
            self._event(
                "decision",
                f"leader: generation {generation} = {plan.layout}, "
                f"micro-batches {list(plan.microbatches)} "
                f"({decision.reason})",
            )
            self._dirty = True

    def _never_committed(self, generation: int) -> bool:
        assert self.cluster is not None
        return not self.cluster.ever_committed()

    def _detection_time(self, generation: int) -> float:
        """When the change behind `generation` was first seen: a failure report of the
        current generation (by any agent), a lapsed lease or a join seen here, else now."""
        seen = [self._detected.get(generation, time.time())]
        rec = self._record
        if rec is not None:
            for v in self._barriers.get(f"failed-{rec.generation}", {}).values():
                if isinstance(v, dict) and isinstance(v.get("at"), (int, float)):
                    seen.append(float(v["at"]))
        return min(seen)

    def _lead_resume(self, gs: _GenState, view: ClusterView) -> None:
        if gs.resume_written:
            return
        assert self.cluster is not None
        if RESUME_MEMBER in self._barriers.get(f"resume-{gs.generation}", {}):
            gs.resume_written = True  # an earlier leader of this generation wrote it
            return
        stopped = self._barriers.get(f"stopped-{gs.generation}", {})
        expected = set(live_nodes(view))
        missing = expected - set(stopped)
        if missing:
            if time.monotonic() - gs.stopped_waiting_since_s > 2.0:
                gs.stopped_waiting_since_s = time.monotonic()
                self._confirm_dead(sorted(missing))
            return
        holdings = {
            n: NodeHoldings.from_dict(v["holdings"]) for n, v in stopped.items() if n in expected
        }
        plan = gs.plan
        disk = None
        if self.spec.persist_dir and Path(self.spec.persist_dir).is_dir():
            disk = checkpoint_holdings(Path(self.spec.persist_dir))
        try:
            rp = resolve(holdings, plan, live_nodes=sorted(expected), disk=disk)
        except ElasticppError as exc:
            if self._never_committed(gs.generation):
                rp = None  # a fresh job: nothing was ever committed
            else:
                msg = (
                    f"generation {gs.generation}: cannot resume: {exc}; the job committed "
                    "steps before, so it does not start over (restore a checkpoint into "
                    "persist_dir or bring back a node that holds the state)"
                )
                if self._last_wait != msg:
                    self._last_wait = msg
                    self._event("decision", msg)
                return
        fetches: dict[str, list[list[Any]]] = {}
        step = 0
        if rp is not None:
            step = rp.step
            for rank, items in rp.fetches.items():
                fetches[str(rank)] = [
                    [f.piece_name, f.origin_node, f.source_node, f.sha256, f.size] for f in items
                ]
        next_steps = [int(v.get("next_step", 0)) for v in stopped.values()]
        written = self.cluster.write_resume(
            gs.generation,
            {
                "step": step,
                "fetches": fetches,
                "at": time.time(),
                "recomputed": max([*next_steps, step]) - step,
            },
            self._leadership,
        )
        self._dirty = True
        if not written:
            log.info(
                "generation %d: resume not written (written before or leadership lost)",
                gs.generation,
            )
            return
        gs.resume_written = True
        self._event("decision", f"leader: generation {gs.generation} resumes at step {step}")

    def _lead_timeline(self, gs: _GenState) -> None:
        if gs.timeline_written or not gs.resume_written:
            return
        if f"gen-{gs.generation}" in self._barriers.get("timelines", {}):
            # Written by the leader that ran this generation; a leader elected later (at the
            # job's end, say) must not overwrite it with what it did not see.
            gs.timeline_written = True
            return
        started = self._barriers.get(f"started-{gs.generation}", {})
        nodes = set(gs.record.extra.get("nodes", {}))
        if not nodes <= set(started):
            return
        self._replan_failures = 0
        assert self.cluster is not None
        resumes = self._barriers.get(f"resume-{gs.generation}", {})
        resume = resumes.get(RESUME_MEMBER) or {}
        stopped = self._barriers.get(f"stopped-{gs.generation}", {})
        detected = float(gs.record.extra.get("detected_at", gs.record.created_at))
        stopped_at = max(float(v.get("at", 0)) for v in stopped.values()) if stopped else detected
        moved_at = max(float(v.get("moved_at", 0)) for v in started.values())
        resumed_at = max(float(v.get("at", 0)) for v in started.values())
        timeline = {
            "generation": gs.generation,
            "reason": gs.record.extra.get("reason", ""),
            "layout_before": gs.record.extra.get("previous_layout", ""),
            "layout_after": str(gs.plan.layout),
            "resume_step": int(resume.get("step", 0)),
            "steps_recomputed": int(resume.get("recomputed", 0)),
            "detected_at": detected,
            "planned_s": float(gs.record.extra.get("planned_at", detected)) - detected,
            "stopped_s": stopped_at - detected,
            "moved_s": max(moved_at, stopped_at) - detected,
            "resumed_s": resumed_at - detected,
        }
        self.cluster.arrive("timelines", f"gen-{gs.generation}", timeline)
        gs.timeline_written = True
        # The generation runs: what older ones left in etcd goes (bounded growth).
        removed = self.cluster.housekeep(gs.generation)
        if removed:
            log.info("leader: removed %d etcd key(s) of older generations", removed)
        if gs.record.extra.get("previous_layout"):
            self.metrics.recoveries_total.labels(**self.metrics.labels).inc()
            self.metrics.recovery_seconds.labels(**self.metrics.labels).observe(
                timeline["resumed_s"]
            )
        self._event(
            "recovery",
            "generation {generation} ({reason}): {layout_before} -> "
            "{layout_after}, resumed at step {resume_step} after {resumed_s:.2f} s, "
            "{steps_recomputed} step(s) recomputed".format(**timeline),
        )

    def timelines(self) -> list[dict[str, Any]]:
        values = self._barriers.get("timelines", {})
        return sorted(values.values(), key=lambda t: int(t.get("generation", 0)))

    # ------------------------------------------------------------------ done, drain
    def _check_done(self) -> None:
        done = self._barriers.get("done", {})
        if any(int(v.get("step", -1)) >= self.spec.steps for v in done.values()):
            self._job_done_step = self.spec.steps
        gs = self._gen
        mine = {s.rank for s in gs.plan.ranks_on(self.node_id)} if gs else set()
        if gs and mine and mine <= gs.done_ranks and gs.phase is not Phase.DONE:
            gs.enter(Phase.DONE)
            assert self.cluster is not None
            self.cluster.arrive("done", self.node_id, {"step": self.spec.steps, "at": time.time()})
            self._event("decision", f"job finished all {self.spec.steps} steps")
            self._job_done_step = self.spec.steps
        if (
            self._job_done_step is not None
            and self.cfg.exit_when_done
            and not any(w.proc.alive() for w in self._workers.values())
        ):
            self._done = True

    def drain(self, timeout_s: float) -> tuple[bool, str]:
        """Leave the job: the leader re-plans without this node at a step boundary, the new
        layout takes this node's state, then the agent exits 0."""
        if self._draining:
            return True, "already draining"
        self._draining = True
        self._drain_deadline_s = time.monotonic() + max(timeout_s, 1.0)
        self._drain_requested_gen = self.generation
        self._wake.set()
        return True, "draining: the job moves off this node at the next step boundary"

    def _check_drain(self) -> None:
        if not self._draining:
            return
        assert self.cluster is not None
        if not self._drain_announced:
            self._registration.update(self._member_info())
            if self._leadership is not None:
                self._leadership.resign()
                self._leadership = None
                self._leader = None
            self._drain_announced = True
            self._event("decision", "draining: announced; waiting for the hand-off")
        gs = self._gen
        handed_off = (
            gs is not None
            and self.node_id not in gs.record.extra.get("nodes", {})
            and gs.generation > self._drain_requested_gen
            and set(gs.record.extra.get("nodes", {}))
            <= set(self._barriers.get(f"started-{gs.generation}", {}))
        )
        no_job = gs is None or self._job_done_step is not None
        expired = self._drain_deadline_s is not None and time.monotonic() > self._drain_deadline_s
        if handed_off or no_job or expired:
            self._event("decision", "drained" if handed_off or no_job else "drain timed out")
            self._done = True

    # ------------------------------------------------------------------ status
    def status_snapshot(self) -> dict[str, Any]:
        """What the control RPCs read: a snapshot the loop publishes (at most STATUS_EVERY_S
        old), never the loop's live state, which another thread must not iterate."""
        snap = self._status
        return snap if snap is not None else self.status()

    def status(self) -> dict[str, Any]:
        gs = self._gen
        return {
            "node_id": self.node_id,
            "job": self.spec.name,
            "generation": self.generation,
            "leader": self._leader or "",
            "phase": ("draining" if self._draining else gs.phase.value if gs else "waiting"),
            "layout": str(gs.plan.layout) if gs else "",
            "last_step": self.last_step,
            "last_loss": self.last_loss,
            "members": sorted(self._members),
            "workers": [
                {
                    "rank": w.rank,
                    "pid": w.proc.pid,
                    "state": w.state.value,
                    "last_step": w.last_step,
                    "generation": w.generation,
                    "coord": gs.plan.slot(w.rank).coord
                    if gs and w.generation == gs.generation
                    else None,
                }
                for w in self._workers.values()
            ],
            "recoveries": self.timelines(),
        }


def run_agent(
    cfg: AgentConfig,
    spec: JobSpec,
    stop_event: threading.Event | None = None,
    on_started: Callable[[Agent], None] | None = None,
) -> int:
    agent = Agent(cfg, spec)
    try:
        agent.start()
    except BaseException:
        agent.shutdown()
        raise
    if on_started is not None:
        on_started(agent)
    if stop_event is not None:
        threading.Thread(
            target=lambda: (stop_event.wait(), agent.request_stop()), daemon=True
        ).start()
    return agent.run()
