"""The node agent: one per node. It supervises the node's workers, meets the other agents
in etcd, and — as leader — re-plans and resumes training when nodes fail or join.

How one generation runs (DESIGN.md, "Recovery, step by step"):

1. The leader writes generation G (plan, nodes and their addresses, the rendezvous store
   address, why) by compare-and-swap. A loss stops the old workers at once; a join or a
   drain (`graceful`) stops them at the next step boundary, so nothing is recomputed.
2. Every live agent stops its old workers, commits what they handed over, and arrives at
   barrier `stopped-G` with a digest of what its store holds (a few hundred bytes).
3. The leader pulls the holdings detail it needs from the nodes the digests name (gRPC),
   resolves the resume step and which source serves each piece, and publishes it
   as barrier `resume-G`, each piece named once (elasticpp.store.instruction); every agent
   derives its own ranks' fetches from it and the plan.
4. Agents with ranks fetch (local pieces are hard-linked; remote ones stream over gRPC with
   checksums), hand assignments to WARM workers (torch already imported), and arrive at
   `started-G` when all of theirs report "started".

Job epochs: the first agent to join a job whose etcd state has none creates its epoch (a
create-if-absent key, `ClusterClient.epoch_if_absent`); every agent reads it at join and its
store commits in it, so generation numbers that restart at 1 after an etcd wipe never collide
with the ones before. A running agent that sees the epoch go (the job's etcd state started
afresh under it) stops its workers and exits with `view.EPOCH_ENDED_EXIT`; restarted, it joins the
new epoch and the job resumes from what the nodes hold.

Fencing: workers rendezvous under the prefix `gen<G>`, state requests carry G and are
refused by a store on a newer generation, and every generation write is a CAS guarded by
the leader key. One loop thread makes every decision; watches and worker readers only wake
it, so there is no lock-ordering to get wrong. The loop sleeps until woken (threads that
hand results back through futures wake it too, probes included) or for a tick (`pace`).

This module composes the agent: the parts, start-up, the decision loop and shutdown (its
flags are `config.AgentConfig`); `Agent` inherits from no part. Its gRPC servers are
`server`'s (built by a factory the agent is given: a simulation's answers on one shared
server); the one executor of the parts' actions is `kernel.executor` (the table of handlers
each part registers). Each part is an object with ports, one sub-package each with its pure
`step` and its `shell`: `membership` (joining the job and the registration: built with its
etcd calls, the store's epochs, the loop's heartbeat and what the member record says),
`control` (built with the pool, the health service, the clock and
the metrics, it reads the others only through the summaries of `kernel.summaries`), `view`
(built with the etcd client's reads: the others read what it knows through its frozen
`View.snapshot`), `supervisor` (the worker processes: built with the pool, the worker logs,
what the other parts do with a worker's events, where failures are reported and whether
spares are wanted), `durability` (commits, commit records, replication, persistence: built
with the store, where commit records go, the peers' member records, whether the node is
fenced and the plan it follows), `liveness` (probes of suspects and of the leader: built
with the view's snapshot and the etcd call that deposes a leader), `health` (quarantines,
the job's end, halts: built with its etcd calls, the pool and the leader's term; it carries
out the leader's health decisions), `follower` (the phases of a generation with their
deadlines, arrivals, the fetch of resume state, handing the ranks to warm workers: built
with the view, the pool, the supervisor's warm workers, the store and the executor) and
`leader` (campaigns, plans, resume instructions, the safe step: built with its etcd calls,
the view's snapshot, the other parts' summaries and liveness's probes of suspects); what
every part uses (the journal of decisions, the error policy, the executor, threads with
futures) is in `kernel`. How long the loop sleeps is `pace.tick_s`'s (pure) on what the
parts say. Timeouts and limits are in `limits`.

Who writes what: each part's state is plain data its object alone writes, on the decision
loop (`ControlState`, `ViewState`, `SupervisorState`, `DurabilityState`, `LivenessState`,
`HealthState`, `FollowerState` with the generation's `_GenState`, and `LeaderState`, a new
one per term); the worker pool (`WorkerPool`) is written through its methods. A part reads
another through its summary or the view's snapshot and asks for changes through the ports
it was built with; watches, gRPC and worker threads only raise signals or queue requests
(`inbox`), and the fetch, pull and replication threads hand results back through futures
the shells hold. Values a part derives from several sources stay with their sources and
are combined by the reader: the newest join (the view's `last_join_s`, liveness's
`revived_s`, health's `readmitted_s`), the detection time of a change (the view's
`detected`, the follower's `detected()`), the exit status (`exit_requested`). Each part's
step runs in its own error boundary (`_part`). Parts read time from an injected clock
(`clock`).
Pure steps with actions as data (`actions`, applied by `_execute`): the control part
(`control.control_step`), the job's end (`health.step.job_end_step`), the supervisor's
deadlines (`supervisor.step.supervisor_step`), a follower's watch on the leader
(`liveness.step.leader_watch_step`), the view's reading of etcd (`view.view_step`), the
follower's way through a generation (`follower.step.follower_step`: arrivals, the fetch and
the assignment fed back), the durability part's worker events (`durability.step`: the
store's record, commit and drop fed back) and the leader's decisions
(`leader.step.leader_step`: its writes and reads fed back). The verdicts of probes and the
leader's health judgement come before its step. Pure rules under the parts: `decide` (re-
planning, phases), `sick` (quarantine) and the leader's resolve
(`elasticpp.store.resolver`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from elasticpp.agent.actions import (
    Action,
    Event,
    StopWorkers,
    UpdateGauges,
)
from elasticpp.agent.config import AgentConfig
from elasticpp.agent.control.shell import Control, ControlConfig
from elasticpp.agent.durability.shell import Durability, DurabilityConfig
from elasticpp.agent.follower.shell import Follower, FollowerConfig, FollowerPorts
from elasticpp.agent.health.shell import Health, HealthConfig
from elasticpp.agent.jobspec import JobSpec
from elasticpp.agent.kernel.clock import Clock, LoopHeartbeat, SystemClock
from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.journal import ErrorPolicy, Journal
from elasticpp.agent.kernel.limits import (
    QUIET_TICK_S,
    VIEW_REFRESH_S,
)
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.pool import WorkerPool
from elasticpp.agent.kernel.ports import HealthPort
from elasticpp.agent.kernel.summaries import (
    ProgressSummary,
)
from elasticpp.agent.kernel.worklogs import WorkerLogs
from elasticpp.agent.leader.shell import Leader, LeaderConfig, LeaderPorts
from elasticpp.agent.liveness.shell import Liveness
from elasticpp.agent.membership.shell import Membership, MembershipPorts
from elasticpp.agent.pace import PaceObservation, TurnPace, tick_s
from elasticpp.agent.server import Doors, Served, ServerFactory, ServerPorts, serve
from elasticpp.agent.stop.shell import JobStop, StopConfig
from elasticpp.agent.supervisor.shell import (
    Supervisor,
    SupervisorConfig,
    WorkerEvents,
    WorkerFactory,
)
from elasticpp.agent.view.shell import View
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import (
    ClusterUnavailableError,
    NodeIdConflictError,
)
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.cluster.records import EventType, WatchEvent
from elasticpp.errors import ConfigError, ElasticppError
from elasticpp.plan import Plan
from elasticpp.store.local import LocalStore
from elasticpp.transport import Dialer

log = logging.getLogger("elasticpp.agent")


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        spec: JobSpec,
        *,
        python: str | None = None,
        clock: Clock | None = None,
        worker_factory: WorkerFactory | None = None,
        meter: EtcdMeter | None = None,
        etcd_kv: EtcdKV | None = None,
        wake: threading.Event | None = None,
        watchdog: bool = True,
        health: HealthPort | None = None,
        cluster: ClusterClient | None = None,
        server_factory: ServerFactory = serve,
    ) -> None:
        self.clock: Clock = clock or SystemClock()  # every part's decisions read it
        # Simulation seams (bench/scale.py): what starts a warm worker (default: a worker
        # process, elasticpp.train.worker.procs), a counter of this agent's etcd requests, an etcd
        # connection shared by the simulated agents of one process (default: its own), the
        # event that wakes the loop (a simulation's also schedules the agent's next `turn`
        # on its pool of loop threads), whether the agent starts its own loop watchdog
        # (a simulation checks its agents' loops from one thread: `check_loop`) and the
        # health service it answers on (a simulation's agents share one). `cluster`: the
        # job's etcd client (default: one made here from the flags; tests give another).
        self._own_watchdog = watchdog
        self.cfg = cfg
        self.spec = spec
        self.node_id = cfg.node_id
        self.incarnation = uuid.uuid4().hex[:12]
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        # Resume directories are links for workers of a run that is over; a generation
        # number of a later epoch must not find an earlier run's pieces in its directory.
        shutil.rmtree(cfg.state_dir / "resume", ignore_errors=True)
        # Anchors (replicated steps) at or above the safe step stay until a newer one is
        # published: see elasticpp.store.replicate for the guarantee.
        self.store = LocalStore(
            cfg.state_dir / "store",
            cfg.node_id,
            anchor_every=spec.replication_every if spec.replication_copies else None,
            job=spec.identity(),
        )
        self.metrics_path = cfg.state_dir / "metrics.jsonl"
        self.log_dir = cfg.state_dir / "logs"
        # Worker output per assignment, teed to stdout (elasticpp.agent.kernel.worklogs).
        self.worker_logs = WorkerLogs(self.log_dir)
        self.python = python
        # Inboxes: what watches, gRPC threads and other parts may hand over
        # (elasticpp.agent.kernel.inbox)
        self.wake = wake if wake is not None else threading.Event()  # the loop ticks now
        self._stop = threading.Event()
        # What every part uses: the journal of decisions (`ctl events`), the error policy,
        # the executor of the actions their steps return (elasticpp.agent.kernel).
        self.journal = Journal(self.clock, lambda: self.follower.generation)
        self.metrics = AgentMetrics.create(cfg.node_id, spec.name)
        self.errors = ErrorPolicy(self.metrics)
        self.executor = Executor()
        self.health_service: HealthPort = health if health is not None else HealthServicer()
        # Each part's state: one object, one writer (that part's module, on the loop).
        self.pool = WorkerPool(
            self.wake, clock=self.clock.monotonic
        )  # the supervisor's workers (elasticpp.agent.kernel.pool)
        # The executor's own: the lifecycle of this agent's server, registration and loop.
        # Every channel to a peer (probes, state transfers): TLS with this node's
        # certificate when the job has one (elasticpp.transport, the one place).
        self._dialer = Dialer(cfg.tls)
        self._heartbeat = LoopHeartbeat()  # read by the loop-watchdog and the lease gate
        self.pace = TurnPace()  # the loop's next turn and status publication
        self._init_dir: Path | None = None  # step 0 of a job with init_from (`start`)
        self._server_factory = server_factory
        self.server: Served | None = None  # serving from `start` to `shutdown`
        self.port = 0
        # The job's etcd client: no request until `start` joins (a channel connects lazily).
        self.cluster = (
            cluster
            if cluster is not None
            else ClusterClient(
                list(cfg.etcd),
                spec.name,
                meter=meter,
                kv=etcd_kv,
                security=cfg.etcd_security,
                prefix=cfg.etcd_prefix,
            )
        )
        self.view = View(
            cfg.node_id,
            cluster=self.cluster,
            clock=self.clock,
            journal=self.journal,
            metrics=self.metrics,
            epoch=lambda: self.store.epoch,
            set_floor=self.store.set_floor,
        )
        self._etcd_open = False  # `start` began to join: `shutdown` leaves etcd cleanly
        self.torch_ready = threading.Event()  # torch imported (`start`): it may lead
        self.membership = Membership(
            cfg.node_id,
            self.incarnation,
            spec,
            cluster=self.cluster,
            heartbeat=self._heartbeat,
            ports=MembershipPorts(
                newest_epoch=self.store.newest_epoch,
                set_epoch=self.store.set_epoch,
                spawn_warm=lambda: self.supervisor.spawn_warm(),
                address=lambda: self.address,
                slots=lambda: len(self.supervisor.gpus),
                draining=lambda: self.control.summary().draining,
                members=lambda: self.view.snapshot.members,
                on_watch=self.on_watch,
            ),
        )
        m = self.membership
        self.control = Control(
            ControlConfig(
                cfg.node_id,
                self.incarnation,
                spec.name,
                spec.steps,
                exit_on_end=cfg.on_job_end == "exit",
                unfinished_exit_code=cfg.unfinished_exit_code,
            ),
            clock=self.clock,
            pool=self.pool,
            health=self.health_service,
            metrics=self.metrics,
            heartbeat=self._heartbeat,
            serving=lambda: self.server is not None,
            wake=self.wake.set,
        )
        self.control.register(self.executor)
        self.view.register(self.executor)
        # What the parts ask of the agent itself: the workers as a whole, the gauges of
        # every part.
        m.register(self.executor)
        self.executor.register(StopWorkers, lambda _: self.pool.stop_workers())
        self.executor.register(UpdateGauges, lambda _: self.update_gauges())
        self.health = Health(
            HealthConfig(cfg.node_id, exit_on_end=cfg.on_job_end == "exit"),
            clock=self.clock,
            journal=self.journal,
            metrics=self.metrics,
            records=self.cluster.health,
            pool=self.pool,
            own_step=self._own_step,
            last_step=lambda: self.durability.state.last_step,
            leadership=lambda: self.leader.leadership,
            reread=self.view.reread.raise_,
        )
        self.health.register(self.executor)
        self.liveness = Liveness(
            cfg.node_id,
            clock=self.clock,
            journal=self.journal,
            errors=self.errors,
            view=lambda: self.view.snapshot,
            depose=lambda leader: self.cluster.depose(leader),
            dialer=self._dialer,
            wake=self.wake.set,
        )
        self.liveness.register(self.executor)
        self.follower = Follower(
            FollowerConfig(
                cfg.node_id,
                cfg.state_dir,
                self.log_dir,
                cfg.backend,
                cfg.device,
                worker_threads=cfg.worker_threads,
            ),
            spec=spec,
            clock=self.clock,
            journal=self.journal,
            metrics=self.metrics,
            cluster=self.cluster,
            pool=self.pool,
            store=self.store,
            dialer=self._dialer,
            logs=self.worker_logs,
            ports=FollowerPorts(
                view=lambda: self.view.snapshot,
                member_records=self.view.member_records,
                etcd_down=self.etcd_down,
                take_warm=lambda count: self.supervisor.take_warm(count),
                gpus=lambda: self.supervisor.gpus,
                drain=lambda: self.supervisor.drain_events(),
                address=lambda: self.address,
                next_step=lambda: self.durability.state.next_step_committed,
                init_dir=lambda: self._init_dir,
                member_lease=m.member_lease,
                execute=self.execute,
            ),
            wake=self.wake.set,
        )
        self.follower.register(self.executor)
        self.durability = Durability(
            DurabilityConfig(
                cfg.node_id,
                self.metrics_path,
                spec.steps,
                spec.train.precision,
                spec.peak_tflops,
                replication_copies=spec.replication_copies,
                replication_every=spec.replication_every,
                persist_dir=spec.persist_dir,
                persist_every=spec.persist_every,
            ),
            clock=self.clock,
            store=self.store,
            metrics=self.metrics,
            records=self.cluster.commits,
            member_records=self.view.member_records,
            dialer=self._dialer,
            fenced=m.fenced,
            member_lease=m.member_lease,
            current_plan=self._current_plan,
            wake=self.wake.set,
        )
        self.durability.register(self.executor)
        d = self.durability
        self.supervisor = Supervisor(
            SupervisorConfig(
                cfg.node_id,
                cfg.slots,
                cfg.device,
                self.log_dir,
                ready_timeout_s=spec.ready_timeout_s,
                hang_timeout_s=spec.hang_timeout_s,
                first_step_timeout_s=spec.first_step_deadline_s,
                worker_threads=cfg.worker_threads,
                python=python,
            ),
            clock=self.clock,
            pool=self.pool,
            journal=self.journal,
            metrics=self.metrics,
            errors=self.errors,
            logs=self.worker_logs,
            events=WorkerEvents(
                on_started=lambda e: self.execute(d.on_started(e)),
                on_step=lambda w, e: self.execute(d.on_step(w, e)),
                on_snapshot=lambda w, e: self.execute(d.on_snapshot(w, e)),
                on_snapshot_failed=lambda w, e: self.execute(d.on_snapshot_failed(w, e)),
            ),
            report_failed=lambda g, why: self.follower.report_failure(g, why),
            spares_wanted=self._spares_wanted,
            wake=self.wake.set,
            worker_factory=worker_factory,
        )
        self.supervisor.register(self.executor)
        live = self.liveness
        self.leader = Leader(
            LeaderConfig(cfg.node_id, cfg.advertise_host, self.store.job),
            spec=spec,
            clock=self.clock,
            journal=self.journal,
            metrics=self.metrics,
            cluster=self.cluster,
            dialer=self._dialer,
            ports=LeaderPorts(
                view=lambda: self.view.snapshot,
                reread=self.view.reread.raise_,
                follower=self.follower.summary,
                detected=self.follower.detected,
                control=self.control.summary,
                health=self.health.summary,
                quarantines=self.health.quarantines,
                liveness=live.summary,
                dead_now=live.dead_now,
                settle_probes=live.settle,
                confirm_suspects=live.confirm_suspects,
                fenced=m.fenced,
                leaving=lambda: self.exit_requested() is not None,
                torch_ready=self.torch_ready.is_set,
                lease_gate=m.lease_gate,
                epoch=lambda: self.store.epoch,
                execute=self.execute,
                wake=self.wake.set,
            ),
        )
        self.leader.register(self.executor)
        self.job_stop = JobStop(
            StopConfig(cfg.node_id, spec.stop_timeout_s),
            clock=self.clock,
            records=self.cluster.health,
            arrivals=self.cluster.arrivals,
            pool=self.pool,
            committed=lambda: max(self.store.committed_steps(self.node_id), default=-1),
            persist_outcome=d.persist_outcome,
            persist_now=d.persist_now,
            members=lambda: self.view.snapshot.members,
            member_lease=m.member_lease,
            ended=self.health.changed.raise_,
        )
        self.job_stop.register(self.executor)
        self.executor.register(Event, lambda a: self.journal.write(a.kind, a.message))
        self.metrics.of(self.metrics.target_steps).set(spec.steps)
        self.metrics.of(self.metrics.job_finished).set(0)

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        return f"{self.cfg.advertise_host}:{self.port}"

    def start(self) -> None:
        """Serve gRPC, join the job in etcd, start warm workers. Raises on a bad spec."""
        self.serve()
        # NOT_SERVING until this node has joined the job: a probe (a Kubernetes readiness
        # check, a peer's confirmation) must not take a node that is still waiting for etcd
        # for a working one.
        self.control.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        cfg = self.cfg
        if cfg.metrics_port:
            try:
                self.metrics.serve(cfg.metrics_port, addr=cfg.metrics_host)
            except OSError as exc:
                raise ConfigError(
                    f"agent: cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc}"
                ) from exc
        # torch is imported once, off the recovery path: the leader hosts the rendezvous store.
        # Before joining etcd, not beside it: a thread importing torch holds the GIL for
        # seconds, which can starve the lease keep-alive of a freshly registered node.
        import torch.distributed  # noqa: F401

        self.torch_ready.set()
        if self.spec.init_from is not None:
            # A job that starts from trained weights starts every worker from a step-0
            # directory of this node, converted once here, before joining.
            from elasticpp.train.model.hf import write_init_step

            self._init_dir = write_init_step(
                self.spec.model, Path(self.spec.init_from), cfg.state_dir / "init"
            )
            log.info("initial weights from %s in %s", self.spec.init_from, self._init_dir)
        self._etcd_open = True
        self.membership.join()
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

    def serve(self) -> None:
        """Serve state transfers, the control service and health (the server factory's)."""
        doors = Doors(
            self.node_id,
            self.cfg.tls_shared_identity,
            self.spec.replication_copies,
            self.spec.replication_every,
            view=lambda: self.view.snapshot,
            follower=self.follower.summary,
        )
        self.server = self._server_factory(
            self.cfg,
            ServerPorts(
                self.node_id,
                self.incarnation,
                self.store,
                lambda: self.follower.generation,
                self.control,
                self.journal,
                self.health.lift,
                self.health_service,
                self.metrics,
                doors,
            ),
        )
        self.port = self.server.port

    def on_watch(self, event: WatchEvent) -> None:
        """A change under the job's cached keys (on a watch thread): the view reads again
        now. A quarantine record or the job's end raises the health part's signal, the
        epoch key the view's epoch check; a RESYNC (events lost) raises both. (These keys
        had watches of their own, three more streams and threads an agent.) A follower sees
        no other node's member key: when a job starts, N registrations woke N agents."""
        if isinstance(event, WatchEvent):
            keys, resync = self.cluster.keys, event.type is EventType.RESYNC
            if resync or event.key.startswith(keys.quarantine_prefix) or event.key == keys.ended:
                self.health.changed.raise_()
            if resync or event.key == keys.stop:
                self.job_stop.changed.raise_()
            if resync or event.key == keys.epoch:
                self.view.epoch_changed.raise_()
        self.view.reread.raise_()
        self.wake.set()

    def execute(self, actions: Sequence[Action]) -> None:
        """Apply what a part's pure step asked for, in order (the handlers the parts
        registered on `executor`)."""
        self.executor.run(actions)

    def _own_step(self) -> int | None:
        """This node's newest own committed step, if any."""
        own = self.store.committed_steps(self.node_id)
        return own[-1] if own else None

    def _current_plan(self) -> tuple[int, Plan] | None:
        """The generation this node follows, and its plan (with this node's model)."""
        followed = self.follower.summary()
        return (followed.generation, followed.plan) if followed.plan is not None else None

    def run(self) -> int:
        """The decision loop; returns the exit code."""
        try:
            while not self._stop.is_set():
                self.wake.wait(self.idle_for())
                self.wake.clear()
                code = self.turn()
                if code is not None:
                    return code
            # Stopped (a signal): a finished job's agent says so, any other says it left.
            return 0 if self.control.summary().job_done else self.cfg.unfinished_exit_code
        finally:
            self.shutdown()

    def turn(self) -> int | None:
        """One turn of the decision loop, woken or due: a tick, the status the RPCs read,
        and the checks that end the agent. Returns the exit code when the agent is to stop;
        raises NodeIdConflictError when another agent holds this node id. `run` calls it on
        the loop thread; a simulation of many agents (bench/scalesim.py) calls it from a
        pool of threads, one turn of one agent at a time, after `wake.clear()`."""
        self._heartbeat.busy()
        if self.pace.deferred(self._stop.is_set(), time.monotonic()):
            return None  # what woke it is taken by the turn its pace allows (idle_for)
        cpu_s = time.thread_time()
        try:
            self.tick()
            if self.pace.status_due(time.monotonic()):
                self.status()
        except Exception as exc:  # a daemon survives what comes from outside
            self.errors.survive("internal", exc)
        self.pace.after_turn(time.thread_time() - cpu_s, self.leader.acting(), time.monotonic())
        conflict = self.membership.conflict()
        if conflict is not None:  # two agents, one node id: this one must go
            self.journal.write("decision", f"node {self.node_id}: {conflict}")
            raise NodeIdConflictError(f"node {self.node_id}: {conflict}")
        return self.exit_requested()

    # ------------------------------------------------------------------ the loop's pace
    def idle_for(self) -> float:
        """The loop is about to wait: the longest it may (`rest_s`, `TurnPace.idle_for`);
        from now on it counts as idle, not stalled (`clock.LoopHeartbeat`)."""
        tick = self.pace.idle_for(self.rest_s(), time.monotonic())
        self._heartbeat.idle()
        return tick

    def rest_s(self) -> float:
        """How long the loop may sleep when nothing wakes it (`pace.tick_s`, on what the
        parts say now)."""
        follower, view, leader = self.follower.summary(), self.view.snapshot, self.leader.summary()
        current = view.record.generation if view.record is not None else 0
        now_s = self.clock.monotonic()
        campaign_at_s = leader.campaign_at_s  # leaderless: this node's campaign is due then
        return tick_s(
            PaceObservation(
                joined=self.membership.joined,
                etcd_ok=view.etcd_ok,
                current=current,
                followed=follower.generation,
                follower_settled=self.follower.settled(current),
                suspecting=self.liveness.summary().suspecting,
                draining=self.control.summary().draining,
                # A step reported within a quiet tick keeps the training tick: that every
                # part of its durability work (commits, replication, the safe step) wakes
                # the loop is not established. Other worker events wake it once. On the
                # real clock: the pool's reader threads stamp the steps on it.
                training=time.monotonic() - self.pool.trained_at_s < QUIET_TICK_S,
                leading=leader.leading,
                led_generation=leader.generation,
                timeline_written=leader.timeline_written,
                phase=follower.phase,
                rest_s=self.supervisor.rest_for_s(now_s),
                campaign_in_s=campaign_at_s - now_s
                if campaign_at_s is not None and view.leader is None
                else None,
            )
        )

    def exit_requested(self) -> int | None:
        """The exit status a part asked for, if one did: the view (the job's epoch is
        gone), the health part (the job ended), control (drained, or finished)."""
        for code in (
            self.view.snapshot.exit_code,
            self.health.summary().exit_code,
            self.control.summary().exit_code,
        ):
            if code is not None:
                return code
        return None

    def stopping(self) -> bool:
        """Whether the agent was asked to stop (`request_stop`, a signal)."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        self._stop.set()
        self.wake.set()

    def shutdown(self, *, lost: bool = False) -> None:
        """Kill every process this agent started; leave etcd cleanly if it can. `lost`: end
        as a lost node ends (a simulation's crash, bench/scalesim.py): the server stops
        answering first, and etcd is left without a word (no resignation, no revoked lease,
        no last commit record), so its leases lapse by their TTL."""
        self._stop.set()  # ends the loop watchdog too
        if lost:
            self._stop_serving()  # probes find it dead from now on
        self.pool.kill_all()
        self.supervisor.close()
        self.worker_logs.close()  # what the killed workers wrote last, copied
        # The persister's copy finished; the newest commit record put while etcd is ours.
        leave = self._etcd_open and not lost
        self.durability.close(flush=leave)
        if leave:
            self.leader.close()
        if self._etcd_open:
            self.membership.close(revoke=not lost)
            with contextlib.suppress(ElasticppError):
                self.cluster.close()  # keep-alives stop
            self._etcd_open = False
        self.follower.close()  # no more failure reports
        self.health.close()  # no more halts on record
        self._stop_serving()
        self.liveness.close()

    def _stop_serving(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    # ------------------------------------------------------------------ the loop
    def tick(self) -> None:
        """One cycle. Each part's step runs in its own error boundary (`_part`): an error
        in one is logged once and counted, and the parts after it still run; only an
        unreachable etcd ends the etcd half of the tick early (training goes on)."""
        for name, step in (
            ("worker", self.supervisor.drain_events),
            ("supervisor", lambda: self.execute(self.supervisor.step())),
            (
                "supervisor",
                lambda: self.execute(self.supervisor.check_gpus(self.follower.generation)),
            ),
        ):
            self._part(name, step)
        now = self.clock.monotonic()
        view = self.view.snapshot
        if self.view.reread.is_raised() or now - view.last_refresh_s >= VIEW_REFRESH_S:
            self._part("view", self.refresh_view)
        view = self.view.snapshot
        if not view.etcd_ok:
            return  # training goes on; membership changes wait for etcd
        epoch_changed = self.view.epoch_changed.is_raised() or (
            view.record is None and self.follower.generation > 0
        )
        if epoch_changed and (
            not self._part("view", self.view.check_epoch) or self.exit_requested() is not None
        ):
            return
        for name, step in (("health", self.health.read), ("health", self.health.publish_halt)):
            if not self._part(name, step):
                return
        if self.health.summary().ended is not None:
            self._part("health", lambda: self.execute(self.health.check_job_end()))
            self._part("control", self.control_turn)  # an idle agent leaves when drained
            return  # an ended job stays ended: nothing is planned or followed again
        if not self._part("stop", self.job_stop.read):
            return
        if self.job_stop.requested():
            # An operator stops the job: nothing is planned or followed any more; the
            # workers stop at a step boundary and the leader ends the job (elasticpp.agent.stop).
            for name, step in (
                ("leader", self.leader.campaign),
                ("stop", lambda: self.execute(self.job_stop.step())),
                ("stop", self.lead_stop),
                ("control", self.control_turn),
            ):
                if not self._part(name, step):
                    return
            return
        for name, step in (
            ("follower", self.follower.publish_failures),
            ("liveness", self.watch_leader),
            ("leader", self.leader.campaign),
            ("follower", self.follower.step),
            ("leader", self.lead),
            ("control", self.control_turn),
        ):
            if not self._part(name, step):
                return

    def status(self) -> dict[str, Any]:
        """Publish the status the control RPCs read, from this turn's summaries."""
        return self.control.publish_status(
            self.follower.summary(),
            self.view.summary(),
            self.health.summary(),
            self._progress_summary(),
        )

    def control_turn(self) -> None:
        """The control part's step on this turn's summaries."""
        self.execute(
            self.control.step(self.follower.summary(), self.view.summary(), self.health.summary())
        )

    def update_gauges(self) -> None:
        self.control.update_gauges(
            self.follower.summary(),
            self.view.summary(),
            self._progress_summary(),
            self.leader.acting(),
        )

    # The summaries the parts publish (elasticpp.agent.kernel.summaries), built here from
    # the states of the parts that are not objects yet; each moves into its part with it.
    def refresh_view(self) -> None:
        """The view's read of etcd, as the leader (every member, the arrivals) or not, with
        the nodes the liveness part found dead."""
        self.execute(self.view.refresh(self.leader.summary().leading, self.liveness.dead_now))

    def etcd_down(self, exc: Exception) -> None:
        self.execute(self.view.etcd_down(exc))

    def _progress_summary(self) -> ProgressSummary:
        floor = self.store.floor
        return ProgressSummary(
            last_step=self.durability.state.last_step,
            last_loss=self.durability.state.last_loss,
            safe_step=floor[1] if floor is not None else -1,
        )

    def watch_leader(self) -> None:
        """The liveness part's watch on the leader, told whether this node reported the
        current generation failed itself."""
        rec = self.view.snapshot.record
        reported = rec is not None and self.follower.reported_failed(rec.generation)
        self.execute(self.liveness.check_leader(reported))

    def _spares_wanted(self) -> bool:
        """Spares are wanted, except while this node's ranks of the current generation are
        starting (spares import torch, and on a loaded node that would compete for the CPU
        with the ranks the recovery waits for; the pool is full again a moment after they
        run), while the agent leaves, and once the job is over."""
        control = self.control.summary()
        return not (
            self.exit_requested() is not None
            or control.draining
            or self.follower.summary().phase is Phase.STARTING
            or control.job_done
            or self.health.summary().ended is not None
            or self.job_stop.requested()
        )

    def lead(self) -> None:
        if self.leader.acting():
            self.leader.lead()

    def lead_stop(self) -> None:
        if self.leader.acting():
            self.execute(self.job_stop.lead())

    def _part(self, source: str, step: Callable[[], object]) -> bool:
        """Run one part's step in its own error boundary. False when etcd is unreachable
        (the steps after it that need etcd wait for the next tick)."""
        try:
            step()
        except ClusterUnavailableError as exc:
            self.etcd_down(exc)
            return False
        except Exception as exc:  # one part's error must not starve the others
            self.errors.survive(source, exc)
        return True


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

        def stop_when_set() -> None:
            stop_event.wait()
            agent.request_stop()

        threading.Thread(target=stop_when_set, daemon=True).start()
    return agent.run()
