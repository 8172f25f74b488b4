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

This module runs the agent: start-up, the decision loop and shutdown (its flags are
`config.AgentConfig`); `Agent` inherits from no part. Its parts are made and wired by
`compose.compose` (the composition root), which hands each the ports it needs; what the
parts ask of the loop itself is `compose.Loop`, which `Agent` answers. Its gRPC servers are
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
the view's snapshot, the other parts' summaries and liveness's probes of suspects), `stop`
(an operator's `job stop`) and `checkpoint` (`job checkpoint`: a checkpoint now); what
every part uses (the journal of decisions, the error policy, the executor, threads with
futures) is in `kernel`. How long the loop sleeps is `pace.tick_s`'s (pure) on what the
parts say. Timeouts and limits are in `limits`.

Who writes what: each part's state is plain data its object alone writes, on the decision
loop (`ControlState`, `ViewState`, `SupervisorState`, `DurabilityState`, `LivenessState`,
`HealthState`, `FollowerState` with the generation's `GenerationProgress`, and `LeaderState`, a new
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
Pure steps with actions as data (`actions`, applied by `execute`): the control part
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
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from grpc_health.v1 import health_pb2

from elasticpp.agent.actions import Action
from elasticpp.agent.compose import Seams, compose
from elasticpp.agent.config import AgentConfig
from elasticpp.agent.jobspec import JobSpec
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.limits import QUIET_TICK_S, VIEW_REFRESH_S
from elasticpp.agent.kernel.ports import HealthPort
from elasticpp.agent.kernel.summaries import AgentStatus, ProgressSummary
from elasticpp.agent.pace import PaceObservation, TurnPace, tick_s
from elasticpp.agent.server import Doors, Served, ServerFactory, ServerPorts, serve
from elasticpp.agent.supervisor.shell import WorkerFactory
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import ClusterUnavailableError, NodeIdConflictError
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.cluster.records import EventType, WatchEvent
from elasticpp.errors import ConfigError, ElasticppError

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
        # The seams are `compose.Seams`'s; `watchdog`: whether the agent starts its own loop
        # watchdog (a simulation checks its agents' loops from one thread: `check_loop`).
        self.cfg, self.spec, self.node_id = cfg, spec, cfg.node_id
        self.incarnation = uuid.uuid4().hex[:12]
        self._own_watchdog = watchdog
        self._server_factory = server_factory
        self.server: Served | None = None  # serving from `start` to `shutdown`
        self.port = 0
        self.pace = TurnPace()  # the loop's next turn and status publication
        self._stop = threading.Event()
        self._etcd_open = False  # `start` began to join: `shutdown` leaves etcd cleanly
        self._init_dir: Path | None = None  # step 0 of a job with init_from (`start`)
        seams = Seams(python, clock, worker_factory, meter, etcd_kv, wake, health, cluster)
        p = compose(cfg, spec, self.incarnation, self, seams)
        self.clock, self.wake, self._heartbeat, self.torch_ready = (
            p.clock, p.wake, p.heartbeat, p.torch_ready,
        )  # fmt: skip
        self.journal, self.metrics, self.errors, self.executor = (
            p.journal, p.metrics, p.errors, p.executor,
        )  # fmt: skip
        self.health_service, self.pool, self.worker_logs, self.store, self.cluster = (
            p.health_service, p.pool, p.worker_logs, p.store, p.cluster,
        )  # fmt: skip
        self.view, self.membership, self.control, self.health, self.liveness = (
            p.view, p.membership, p.control, p.health, p.liveness,
        )  # fmt: skip
        self.follower, self.durability, self.supervisor, self.leader, self.job_stop = (
            p.follower, p.durability, p.supervisor, p.leader, p.job_stop,
        )  # fmt: skip
        self.job_checkpoint = p.job_checkpoint

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        return f"{self.cfg.advertise_host}:{self.port}"

    def serving(self) -> bool:
        return self.server is not None

    def init_dir(self) -> Path | None:
        return self._init_dir

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
        now. A quarantine or cordon record or the job's end raises the health part's signal, the
        epoch key the view's epoch check; a RESYNC (events lost) raises both. (These keys
        had watches of their own, three more streams and threads an agent.) A follower sees
        no other node's member key: when a job starts, N registrations woke N agents."""
        if isinstance(event, WatchEvent):
            keys, resync = self.cluster.keys, event.type is EventType.RESYNC
            if (
                resync
                or event.key.startswith((keys.quarantine_prefix, keys.cordon_prefix))
                or event.key == keys.ended
            ):
                self.health.changed.raise_()
            if resync or event.key == keys.stop:
                self.job_stop.changed.raise_()
            if resync or event.key == keys.checkpoint:
                self.job_checkpoint.changed.raise_()
            if resync or event.key == keys.epoch:
                self.view.epoch_changed.raise_()
        self.view.reread.raise_()
        self.wake.set()

    def execute(self, actions: Sequence[Action]) -> None:
        """Apply what a part's pure step asked for, in order (the handlers the parts
        registered on `executor`)."""
        self.executor.run(actions)

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
            ("checkpoint", self.job_checkpoint.read),
            ("checkpoint", lambda: self.execute(self.job_checkpoint.step())),
            ("control", self.control_turn),
        ):
            if not self._part(name, step):
                return

    def status(self) -> AgentStatus:
        """Publish the status the control RPCs read, from this turn's summaries."""
        return self.control.publish_status(
            self.follower.summary(),
            self.view.summary(),
            self.health.summary(),
            self._progress_summary(),
            job_stopping=self.job_stop.requested(),
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
        floor, done = self.store.floor, self.durability.summary()
        return ProgressSummary(
            last_step=done.last_step,
            last_loss=done.last_loss,
            safe_step=floor[1] if floor is not None else -1,
        )

    def watch_leader(self) -> None:
        """The liveness part's watch on the leader, told whether this node reported the
        current generation failed itself."""
        rec = self.view.snapshot.record
        reported = rec is not None and self.follower.reported_failed(rec.generation)
        self.execute(self.liveness.check_leader(reported))

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
