"""The agent's parts, made and wired: the composition root (`compose`). Each part is an
object built with the ports it needs; a port that another part answers is a bound method or
a small function of that part's summary, never the part itself. What the parts ask of the
agent's loop (its address, the executor's run, whether it leaves) is the `Loop` port."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from grpc_health.v1.health import HealthServicer

from elasticpp.agent.actions import Action, Event, StopWorkers, UpdateGauges
from elasticpp.agent.checkpoint.shell import CheckpointConfig, JobCheckpoint
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
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.pool import WorkerPool
from elasticpp.agent.kernel.ports import HealthPort
from elasticpp.agent.kernel.worklogs import WorkerLogs
from elasticpp.agent.leader.shell import Leader, LeaderConfig, LeaderPorts
from elasticpp.agent.liveness.shell import Liveness
from elasticpp.agent.membership.shell import Membership, MembershipPorts
from elasticpp.agent.stop.shell import JobStop, StopConfig
from elasticpp.agent.supervisor.shell import (
    Supervisor,
    SupervisorConfig,
    WorkerEvents,
    WorkerFactory,
)
from elasticpp.agent.view.shell import View
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.cluster.records import WatchEvent
from elasticpp.plan import Plan
from elasticpp.store.local import LocalStore
from elasticpp.transport import Dialer


class Loop(Protocol):
    """What the parts ask of the agent's loop itself."""

    @property
    def address(self) -> str: ...  # host:port of this agent's server
    def serving(self) -> bool: ...  # its server is up
    def init_dir(self) -> Path | None: ...  # step 0 of a job with init_from (`start`)
    def execute(self, actions: Sequence[Action]) -> None: ...
    def exit_requested(self) -> int | None: ...
    def on_watch(self, event: WatchEvent) -> None: ...
    def etcd_down(self, exc: Exception) -> None: ...
    def update_gauges(self) -> None: ...


class _Registers(Protocol):
    def register(self, executor: Executor) -> None: ...


@dataclass(frozen=True)
class Seams:
    """What a simulation (bench/scale.py) or a test puts in place of the real thing: the
    worker's Python, the clock, what starts a warm worker (default: a worker process,
    elasticpp.train.worker.procs), a counter of this agent's etcd requests, an etcd
    connection shared by the simulated agents of one process (default: its own), the event
    that wakes the loop (a simulation's also schedules the agent's next turn), the health
    service it answers on (a simulation's agents share one) and the job's etcd client
    (default: one made from the flags)."""

    python: str | None = None
    clock: Clock | None = None
    worker_factory: WorkerFactory | None = None
    meter: EtcdMeter | None = None
    etcd_kv: EtcdKV | None = None
    wake: threading.Event | None = None
    health: HealthPort | None = None
    cluster: ClusterClient | None = None


@dataclass(frozen=True)
class Parts:
    """What every part uses (the kernel's: clock, journal, metrics, error policy, executor,
    the loop's wake and heartbeat, the worker pool and logs, the store, the etcd client) and
    the parts, each one object."""

    clock: Clock
    wake: threading.Event
    heartbeat: LoopHeartbeat  # read by the loop-watchdog and the lease gate
    torch_ready: threading.Event  # torch imported (`start`): this node may lead
    journal: Journal
    metrics: AgentMetrics
    errors: ErrorPolicy
    executor: Executor
    health_service: HealthPort
    pool: WorkerPool
    worker_logs: WorkerLogs
    store: LocalStore
    cluster: ClusterClient
    view: View
    membership: Membership
    control: Control
    health: Health
    liveness: Liveness
    follower: Follower
    durability: Durability
    supervisor: Supervisor
    leader: Leader
    job_stop: JobStop
    job_checkpoint: JobCheckpoint


def compose(cfg: AgentConfig, spec: JobSpec, incarnation: str, loop: Loop, seams: Seams) -> Parts:
    """Make the parts of node `cfg.node_id`'s agent and register their handlers on one
    executor. Parts built later are named by closures, read only once the loop runs."""
    clock: Clock = seams.clock or SystemClock()  # every part's decisions read it
    node = cfg.node_id
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    # Resume directories are links for workers of a run that is over; a generation
    # number of a later epoch must not find an earlier run's pieces in its directory.
    shutil.rmtree(cfg.state_dir / "resume", ignore_errors=True)
    # Anchors (replicated steps) at or above the safe step stay until a newer one is
    # published: see elasticpp.store.replicate for the guarantee.
    store = LocalStore(
        cfg.state_dir / "store",
        node,
        anchor_every=spec.replication_every if spec.replication_copies else None,
        job=spec.identity(),
    )
    log_dir = cfg.state_dir / "logs"
    worker_logs = WorkerLogs(log_dir)  # per assignment, teed to stdout (kernel.worklogs)
    wake = seams.wake if seams.wake is not None else threading.Event()  # the loop ticks now
    journal = Journal(clock, lambda: follower.generation)  # the decisions (`ctl events`)
    metrics = AgentMetrics.create(node, spec.name)
    errors = ErrorPolicy(metrics)
    executor = Executor()
    health_service = seams.health if seams.health is not None else HealthServicer()
    pool = WorkerPool(wake, clock=clock.monotonic)
    # Every channel to a peer (probes, state transfers): TLS with this node's certificate
    # when the job has one (elasticpp.transport, the one place).
    dialer = Dialer(cfg.tls)
    heartbeat = LoopHeartbeat()
    torch_ready = threading.Event()
    # The job's etcd client: no request until `start` joins (a channel connects lazily).
    cluster = seams.cluster or ClusterClient(
        list(cfg.etcd),
        spec.name,
        meter=seams.meter,
        kv=seams.etcd_kv,
        security=cfg.etcd_security,
        prefix=cfg.etcd_prefix,
    )
    view = View(
        node,
        cluster=cluster,
        clock=clock,
        journal=journal,
        metrics=metrics,
        epoch=lambda: store.epoch,
        set_floor=store.set_floor,
    )
    membership = Membership(
        node,
        incarnation,
        spec,
        cluster=cluster,
        heartbeat=heartbeat,
        ports=MembershipPorts(
            newest_epoch=store.newest_epoch,
            set_epoch=store.set_epoch,
            spawn_warm=lambda: supervisor.spawn_warm(),
            address=lambda: loop.address,
            slots=lambda: len(supervisor.gpus),
            draining=lambda: control.summary().draining,
            members=lambda: view.snapshot.members,
            on_watch=loop.on_watch,
        ),
    )
    control = Control(
        ControlConfig(
            node,
            incarnation,
            spec.name,
            spec.steps,
            exit_on_end=cfg.on_job_end == "exit",
            unfinished_exit_code=cfg.unfinished_exit_code,
        ),
        clock=clock,
        pool=pool,
        health=health_service,
        metrics=metrics,
        heartbeat=heartbeat,
        serving=loop.serving,
        wake=wake.set,
    )
    health = Health(
        HealthConfig(node, exit_on_end=cfg.on_job_end == "exit"),
        clock=clock,
        journal=journal,
        metrics=metrics,
        records=cluster.health,
        requests=cluster.requests,
        pool=pool,
        own_step=lambda: max(store.committed_steps(node), default=None),
        last_step=lambda: durability.summary().last_step,
        leadership=lambda: leader.leadership,
        reread=view.reread.raise_,
    )
    liveness = Liveness(
        node,
        clock=clock,
        journal=journal,
        errors=errors,
        view=lambda: view.snapshot,
        depose=cluster.depose,
        dialer=dialer,
        wake=wake.set,
    )
    follower = Follower(
        FollowerConfig(
            node,
            cfg.state_dir,
            log_dir,
            cfg.backend,
            cfg.device,
            worker_threads=cfg.worker_threads,
        ),
        spec=spec,
        clock=clock,
        journal=journal,
        metrics=metrics,
        cluster=cluster,
        pool=pool,
        store=store,
        dialer=dialer,
        logs=worker_logs,
        ports=FollowerPorts(
            view=lambda: view.snapshot,
            member_records=view.member_records,
            etcd_down=loop.etcd_down,
            take_warm=lambda count: supervisor.take_warm(count),
            gpus=lambda: supervisor.gpus,
            drain=lambda: supervisor.drain_events(),
            address=lambda: loop.address,
            next_step=lambda: durability.summary().next_step_committed,
            init_dir=loop.init_dir,
            member_lease=membership.member_lease,
            execute=loop.execute,
        ),
        wake=wake.set,
    )

    def followed() -> tuple[int, Plan] | None:
        """The generation this node follows, and its plan (with this node's model)."""
        summary = follower.summary()
        return (summary.generation, summary.plan) if summary.plan is not None else None

    durability = Durability(
        DurabilityConfig(
            node,
            cfg.state_dir / "metrics.jsonl",
            spec.steps,
            spec.train.precision,
            spec.peak_tflops,
            replication_copies=spec.replication_copies,
            replication_every=spec.replication_every,
            persist_dir=spec.persist_dir,
            persist_every=spec.persist_every,
            model=spec.model,
        ),
        clock=clock,
        store=store,
        metrics=metrics,
        records=cluster.commits,
        member_records=view.member_records,
        dialer=dialer,
        fenced=membership.fenced,
        member_lease=membership.member_lease,
        current_plan=followed,
        wake=wake.set,
    )
    d = durability

    def spares_wanted() -> bool:
        """Spares are wanted, except while this node's ranks of the current generation are
        starting (spares import torch, and on a loaded node that would compete for the CPU
        with the ranks the recovery waits for; the pool is full again a moment after they
        run), while the agent leaves, and once the job is over or is being stopped."""
        summary = control.summary()
        return not (
            loop.exit_requested() is not None
            or summary.draining
            or follower.summary().phase is Phase.STARTING
            or summary.job_done
            or health.summary().ended is not None
            or job_stop.requested()
        )

    supervisor = Supervisor(
        SupervisorConfig(
            node,
            cfg.slots,
            cfg.device,
            log_dir,
            ready_timeout_s=spec.ready_timeout_s,
            hang_timeout_s=spec.hang_timeout_s,
            first_step_timeout_s=spec.first_step_deadline_s,
            worker_threads=cfg.worker_threads,
            python=seams.python,
        ),
        clock=clock,
        pool=pool,
        journal=journal,
        metrics=metrics,
        errors=errors,
        logs=worker_logs,
        events=WorkerEvents(
            on_started=lambda e: loop.execute(d.on_started(e)),
            on_step=lambda w, e: loop.execute(d.on_step(w, e)),
            on_snapshot=lambda w, e: loop.execute(d.on_snapshot(w, e)),
            on_snapshot_failed=lambda w, e: loop.execute(d.on_snapshot_failed(w, e)),
        ),
        report_failed=follower.report_failure,
        spares_wanted=spares_wanted,
        wake=wake.set,
        worker_factory=seams.worker_factory,
    )
    leader = Leader(
        LeaderConfig(node, cfg.advertise_host, store.job),
        spec=spec,
        clock=clock,
        journal=journal,
        metrics=metrics,
        cluster=cluster,
        dialer=dialer,
        ports=LeaderPorts(
            view=lambda: view.snapshot,
            reread=view.reread.raise_,
            follower=follower.summary,
            detected=follower.detected,
            control=control.summary,
            health=health.summary,
            quarantines=health.quarantines,
            liveness=liveness.summary,
            dead_now=liveness.dead_now,
            settle_probes=liveness.settle,
            confirm_suspects=liveness.confirm_suspects,
            fenced=membership.fenced,
            leaving=lambda: loop.exit_requested() is not None,
            torch_ready=torch_ready.is_set,
            lease_gate=membership.lease_gate,
            epoch=lambda: store.epoch,
            execute=loop.execute,
            wake=wake.set,
        ),
    )
    job_stop = JobStop(
        StopConfig(node, spec.stop_timeout_s),
        clock=clock,
        requests=cluster.requests,
        records=cluster.health,
        arrivals=cluster.arrivals,
        pool=pool,
        committed=lambda: max(store.committed_steps(node), default=-1),
        persist_outcome=d.persist_outcome,
        persist_now=d.persist_now,
        members=lambda: view.snapshot.members,
        member_lease=membership.member_lease,
        ended=health.changed.raise_,
    )
    job_checkpoint = JobCheckpoint(
        CheckpointConfig(node),
        clock=clock,
        records=cluster.requests,
        arrivals=cluster.arrivals,
        held=lambda: store.committed_steps(node),
        persist_outcome=d.persist_outcome,
        persist_now=d.persist_now,
        member_lease=membership.member_lease,
    )
    parts: tuple[_Registers, ...] = (
        control, view, membership, health, liveness, follower, durability, supervisor,
        leader, job_stop, job_checkpoint,
    )  # fmt: skip
    for part in parts:
        part.register(executor)  # the handlers of the actions its step emits
    # What the parts ask of the agent itself: the workers as a whole, the gauges of every
    # part, the journal.
    executor.register(StopWorkers, lambda _: pool.stop_workers())
    executor.register(UpdateGauges, lambda _: loop.update_gauges())
    executor.register(Event, lambda a: journal.write(a.kind, a.message))
    metrics.of(metrics.target_steps).set(spec.steps)
    metrics.of(metrics.job_finished).set(0)
    return Parts(
        clock=clock,
        wake=wake,
        heartbeat=heartbeat,
        torch_ready=torch_ready,
        journal=journal,
        metrics=metrics,
        errors=errors,
        executor=executor,
        health_service=health_service,
        pool=pool,
        worker_logs=worker_logs,
        store=store,
        cluster=cluster,
        view=view,
        membership=membership,
        control=control,
        health=health,
        liveness=liveness,
        follower=follower,
        durability=durability,
        supervisor=supervisor,
        leader=leader,
        job_stop=job_stop,
        job_checkpoint=job_checkpoint,
    )
