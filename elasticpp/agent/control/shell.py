"""The control part of the agent: what operators and probes see and ask.

The gRPC servicers read a status snapshot the loop publishes, never the loop's live state;
a drain is a request the loop carries out; health follows the loop's heartbeat (NOT_SERVING
until joined and while the loop stalls). Its decisions (the end of the job and of a drain)
are `control.step.control_step`'s; this shell observes for it, publishes the status and the
gauges, and applies the actions only it emits.

It is built with its ports (the pool, the health service, the clock, the journal, the
metrics) and reads the other parts only through the summaries they publish each turn
(elasticpp.agent.kernel.summaries).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from grpc_health.v1 import health_pb2

from elasticpp.agent import probe
from elasticpp.agent.actions import Action, JobEndedGauge, ReleaseSpares
from elasticpp.agent.control.step import ControlObservation, ControlState, control_step
from elasticpp.agent.kernel.clock import Clock, LoopHeartbeat
from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.limits import LOOP_STALL_S, LOOP_WATCH_S
from elasticpp.agent.kernel.metrics import WORKER_STATES, AgentMetrics
from elasticpp.agent.kernel.ports import HealthPort, PoolPort
from elasticpp.agent.kernel.records import Record, fields, integer
from elasticpp.agent.kernel.summaries import (
    AgentStatus,
    ControlSummary,
    FollowerSummary,
    HealthSummary,
    ProgressSummary,
    RecoveryStatus,
    ViewSummary,
    WorkerStatus,
)
from elasticpp.cluster.barriers import timeline_member

log = logging.getLogger("elasticpp.agent")


@dataclass(frozen=True)
class ControlConfig:
    node_id: str
    incarnation: str
    job: str
    steps: int  # the job's
    exit_on_end: bool  # on_job_end "exit": leave once finished; else idle until removed
    unfinished_exit_code: int = 0  # a drain's exit status before the job ended


class Control:
    """The control part: status, drains, health, gauges and the end of the job."""

    def __init__(
        self,
        config: ControlConfig,
        *,
        clock: Clock,
        pool: PoolPort,
        health: HealthPort,
        metrics: AgentMetrics,
        heartbeat: LoopHeartbeat,
        serving: Callable[[], bool],
        wake: Callable[[], None],
    ) -> None:
        self.config = config
        self.state = ControlState()
        self._clock = clock
        self._pool = pool
        self._health = health
        self._metrics = metrics
        self._heartbeat = heartbeat
        self._serving = serving  # whether this agent's gRPC server is up
        self._wake = wake
        self._drains: queue.SimpleQueue[float] = queue.SimpleQueue()  # from gRPC threads
        self._status: AgentStatus | None = None  # published by the loop, read by RPCs
        self._malformed: set[str] = set()  # timelines already said not to be timelines

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only this part emits."""
        executor.register(JobEndedGauge, self._job_ended_gauge)
        executor.register(ReleaseSpares, lambda _: self._pool.release_spares())

    def summary(self) -> ControlSummary:
        s = self.state
        return ControlSummary(draining=s.draining, job_done=s.job_done, exit_code=s.exit_code)

    # ------------------------------------------------------------------ the step
    def step(
        self, follower: FollowerSummary, view: ViewSummary, health: HealthSummary
    ) -> list[Action]:
        """Observe, decide (`control_step`, pure); the caller executes what it returns."""
        try:
            drain_timeout_s: float | None = self._drains.get_nowait()
        except queue.Empty:
            drain_timeout_s = None
        g, cfg = follower.generation, self.config
        obs = ControlObservation(
            now_s=self._clock.monotonic(),
            node_id=cfg.node_id,
            generation=g,
            plan_nodes=follower.planned,
            # The leader writes a generation's timeline once every planned node arrived at
            # started-G (which only the leader reads).
            started_everywhere=timeline_member(g) in view.timelines,
            finished_here=follower.phase is Phase.DONE,
            done_reported=any(
                integer(fields(v), "step", -1) >= cfg.steps for v in view.done.values()
            ),
            job_ended=health.ended is not None,
            workers_alive=self._pool.any_alive(),
            has_spares=self._pool.has_spares(),
            drain_timeout_s=drain_timeout_s,
            exit_on_end=cfg.exit_on_end,
            unfinished_exit_code=cfg.unfinished_exit_code,
        )
        return control_step(self.state, obs)

    def _job_ended_gauge(self, action: JobEndedGauge) -> None:
        m = self._metrics
        m.job_ended.labels(**m.labels, status=action.status).set(1)
        if action.status == "finished":
            m.of(m.job_finished).set(1)

    # ------------------------------------------------------------------ gRPC threads
    def request_drain(self, timeout_s: float) -> tuple[bool, str]:
        """Leave the job: the leader re-plans without this node at a step boundary, the new
        layout takes this node's state, then the agent exits (0, or the code of a node that
        leaves an unfinished job: `AgentConfig.unfinished_exit_code`). Called on a gRPC thread: the
        request is queued for the loop, which alone writes the state (a flag read here is
        only a hint for the reply)."""
        if self.state.draining:
            return True, "already draining"
        self._drains.put(max(timeout_s, 1.0))
        self._wake()
        return True, "draining: the job moves off this node at the next step boundary"

    def status_snapshot(self) -> AgentStatus:
        """What the control RPCs read: a snapshot the loop publishes (at most STATUS_EVERY_S
        old), never the loop's live state, which another thread must not iterate."""
        snap = self._status
        if snap is not None:
            return snap
        # Before the loop's first publication: what is known without reading its state.
        return AgentStatus(self.config.node_id, self.config.job)

    # ------------------------------------------------------------------ the loop's
    def publish_status(
        self,
        follower: FollowerSummary,
        view: ViewSummary,
        health: HealthSummary,
        progress: ProgressSummary,
        *,
        job_stopping: bool = False,
    ) -> AgentStatus:
        """Build the status the RPCs read and publish it (one reference swap). While an
        operator's `job stop` is under way the phase is `stopping-job`."""
        plan = follower.plan
        phase = "draining" if self.state.draining else follower.phase or "waiting"
        if job_stopping:
            phase = "stopping-job"
        if health.ended is not None:
            phase = "ended"
        status = AgentStatus(
            node_id=self.config.node_id,
            job=self.config.job,
            generation=follower.generation,
            leader=view.leader or "",
            phase=str(phase),
            ended=f"{health.ended[0]}: {health.ended[1]}" if health.ended else "",
            waiting=follower.waiting,
            quarantined=dict(sorted(health.quarantined.items())),
            layout=str(plan.layout) if plan is not None else "",
            last_step=progress.last_step,
            last_loss=progress.last_loss,
            members=tuple(sorted(view.members)),
            workers=tuple(
                WorkerStatus(
                    w.rank,
                    w.pid,
                    w.state,
                    w.last_step,
                    w.generation,
                    plan.slot(w.rank).coord
                    if plan is not None and w.generation == follower.generation
                    else None,
                )
                for w in self._pool.seen()
            ),
            recoveries=self._recoveries(view.timelines),
        )
        self._status = status
        return status

    def _recoveries(self, timelines: Record) -> tuple[RecoveryStatus, ...]:
        """The timelines as the status shows them, oldest first; one that is not a
        timeline's shape (etcd is outside) is left out, and said once."""
        out = []
        for key, value in timelines.items():
            try:
                out.append(RecoveryStatus.of(fields(value)))
            except (TypeError, ValueError) as exc:
                if key not in self._malformed:
                    self._malformed.add(key)
                    log.warning("timeline %s is not a timeline (%s): not shown", key, exc)
        return tuple(sorted(out, key=lambda r: r.generation))

    def update_gauges(
        self,
        follower: FollowerSummary,
        view: ViewSummary,
        progress: ProgressSummary,
        is_leader: bool,
    ) -> None:
        """Set the gauges (on every view refresh), unless their values did not change."""
        counts = dict.fromkeys(WORKER_STATES, 0)
        counts.update(self._pool.counts())
        plan = follower.plan
        layout = (plan.pp, plan.tp, plan.dp) if plan is not None else (0, 0, 0)
        scalars = (
            1 if view.etcd_ok else 0,
            len(view.members),  # counted, not sorted
            1 if is_leader else 0,
            follower.generation,
            progress.safe_step,
        )
        values = (*scalars, tuple(counts.values()), layout)
        last = self.state.gauges
        if values == last:
            return
        self.state.gauges = values
        m = self._metrics
        gauges = (m.etcd_up, m.members, m.is_leader, m.generation, m.safe_step)
        for i, (gauge, value) in enumerate(zip(gauges, scalars, strict=True)):
            if last is None or last[i] != value:
                m.of(gauge).set(value)
        before = last[len(gauges)] if last is not None else None
        for i, (state, n) in enumerate(counts.items()):
            if not isinstance(before, tuple) or before[i] != n:
                m.of(m.workers, state=state).set(n)
        if last is None or last[-1] != layout:
            for dimension, size in zip(("pp", "tp", "dp"), layout, strict=True):
                m.of(m.layout, dimension=dimension).set(size)
        if counts["running"] == 0:
            # No rank trains here (between generations, a spare, the job over): this node's
            # last TFLOP/s and MFU are no longer true, and the job's sums must not count them.
            m.drop(m.model_tflops)
            m.drop(m.mfu)

    # ------------------------------------------------------------------ health
    def watch_loop(self, stop: threading.Event) -> None:
        """Health follows the decision loop's heartbeat: a wedged loop (a blocked call, a
        stalled disk) makes the node NOT_SERVING, so probes and Kubernetes see the truth."""
        while not stop.wait(LOOP_WATCH_S):
            if not self.check_loop():
                return

    def check_loop(self) -> bool:
        """One look of the loop watchdog (every LOOP_WATCH_S): health NOT_SERVING while the
        loop has been in one tick LOOP_STALL_S or more, SERVING again when it comes back.
        False once the server is gone (nothing to tell)."""
        if not self._serving():
            return False
        stalled_s = self._heartbeat.stuck_s()
        ok = stalled_s < LOOP_STALL_S
        if ok == self.state.loop_serving:
            return True
        self.state.loop_serving = ok
        status = health_pb2.HealthCheckResponse
        self.set_health(status.SERVING if ok else status.NOT_SERVING)
        if ok:
            log.warning("decision loop running again: health SERVING")
        else:
            log.warning("decision loop stalled for %.1f s: health NOT_SERVING", stalled_s)
        return True

    def set_health(self, status: int) -> None:
        """What the health service says, for the whole server ("") and for this node by
        name (`probe.node_service`: the entry peers' probes ask for)."""
        cfg = self.config
        self._health.set("", status)
        self._health.set(probe.node_service(cfg.node_id, cfg.incarnation), status)
