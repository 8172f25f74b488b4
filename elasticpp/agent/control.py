"""The control part of the agent: what operators and probes see and ask.

The gRPC servicers read a status snapshot the loop publishes, never the loop's live state;
a drain is a request the loop carries out; health follows the loop's heartbeat (NOT_SERVING
until joined and while the loop stalls); errors from outside are logged once and counted,
never fatal. Also the end of the job and of a drain.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from grpc_health.v1 import health_pb2

from elasticpp.agent import probe
from elasticpp.agent.actions import (
    Action,
    Event,
    JobEndedGauge,
    PublishMemberInfo,
    ReleaseSpares,
    StepDown,
)
from elasticpp.agent.decide import Phase
from elasticpp.agent.limits import LOOP_STALL_S, LOOP_WATCH_S
from elasticpp.agent.metrics import WORKER_STATES

log = logging.getLogger("elasticpp.agent")


@dataclass
class ControlState:
    """The control part's state: one object, written by this module's code on the loop
    (gRPC threads only queue drain requests), but `loop_serving`, the loop watchdog's own."""

    draining: bool = False
    drain_announced: bool = False  # the member key says draining; leadership resigned
    drain_deadline_s: float | None = None  # monotonic
    drain_requested_gen: int = 0  # the generation the drain was asked in
    job_done: bool = False  # the job trained every step (this node's, or a done barrier)
    errors_seen: set[tuple[str, str, str]] = field(default_factory=set)  # logged once each
    exit_code: int | None = None  # drained, or finished with on_job_end "exit"
    loop_serving: bool = True  # what the watchdog last said of the loop (`check_loop`)
    # The values the gauges were last set to (None: set them all at the next update); a
    # gauge is set only when its value changed.
    gauges: tuple[object, ...] | None = None


@dataclass(frozen=True)
class ControlObservation:
    """What the control part's step sees: other parts' published state, read by the
    loop at one moment, and this tick's drain request. Times are monotonic seconds."""

    now_s: float
    node_id: str
    generation: int  # the generation this node follows, 0 before any
    plan_nodes: frozenset[str] | None  # the nodes of its plan; None before any
    started_everywhere: bool  # the leader's timeline of this generation is written
    finished_here: bool  # this node's ranks trained every step (the follower's phase)
    done_reported: bool  # a node reported the job's last step trained
    job_ended: bool  # the job ended without finishing (elasticpp.agent.quarantine)
    workers_alive: bool
    has_spares: bool
    drain_timeout_s: float | None  # a drain asked for now (over gRPC), with its timeout
    exit_on_end: bool  # on_job_end "exit": leave once finished; else idle until removed
    # The exit status of a drain that leaves a job that has not finished (0 but under a
    # Kubernetes Job, where a pod that exits 0 counts its index complete).
    unfinished_exit_code: int = 0


def control_step(state: ControlState, obs: ControlObservation) -> list[Action]:
    """The end of the job and of a drain, decided: writes only `state`, does no I/O.
    A finished job exits 0 (or idles, its spares released) once its workers are gone; a
    drain announces itself, hands the leadership on, and exits 0 once a later plan without
    this node has started everywhere, the job is over, or the drain's time is up: with 0
    once the job finished, else with `unfinished_exit_code`."""
    actions: list[Action] = []
    if (obs.done_reported or obs.finished_here) and not state.job_done:
        state.job_done = True
        actions.append(JobEndedGauge("finished"))  # the alerts stay quiet from here on
    if state.job_done and not obs.workers_alive:
        if obs.exit_on_end:
            state.exit_code = 0
        elif obs.has_spares:
            # Idle until removed: the warm pool is of no use to a finished job.
            actions += [
                ReleaseSpares(),
                Event("decision", "job finished: this agent idles until it is removed"),
            ]
    if obs.drain_timeout_s is not None and not state.draining:
        state.draining = True
        state.drain_deadline_s = obs.now_s + max(obs.drain_timeout_s, 1.0)
        state.drain_requested_gen = obs.generation
    if not state.draining:
        return actions
    if not state.drain_announced:
        state.drain_announced = True
        actions += [
            PublishMemberInfo(),
            StepDown("draining"),
            Event("decision", "draining: announced; waiting for the hand-off"),
        ]
    handed_off = (
        obs.plan_nodes is not None
        and obs.node_id not in obs.plan_nodes
        and obs.generation > state.drain_requested_gen
        and obs.started_everywhere
    )
    no_job = obs.plan_nodes is None or state.job_done or obs.job_ended
    expired = state.drain_deadline_s is not None and obs.now_s > state.drain_deadline_s
    if state.exit_code is None and (handed_off or no_job or expired):
        actions.append(Event("decision", "drained" if handed_off or no_job else "drain timed out"))
        state.exit_code = 0 if state.job_done else obs.unfinished_exit_code
    return actions


class ControlPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _watch_loop(self) -> None:
        """Health follows the decision loop's heartbeat: a wedged loop (a blocked call, a
        stalled disk) makes the node NOT_SERVING, so probes and Kubernetes see the truth."""
        while not self._stop.wait(LOOP_WATCH_S):
            if not self.check_loop():
                return

    def check_loop(self) -> bool:
        """One look of the loop watchdog (every LOOP_WATCH_S): health NOT_SERVING while the
        loop has been in one tick LOOP_STALL_S or more, SERVING again when it comes back.
        False once the server is gone (nothing to tell)."""
        if self._server is None:
            return False
        stalled_s = self._heartbeat.stuck_s()
        ok = stalled_s < LOOP_STALL_S
        if ok == self._cs.loop_serving:
            return True
        self._cs.loop_serving = ok
        status = health_pb2.HealthCheckResponse
        self._set_health(status.SERVING if ok else status.NOT_SERVING)
        if ok:
            log.warning("decision loop running again: health SERVING")
        else:
            log.warning("decision loop stalled for %.1f s: health NOT_SERVING", stalled_s)
        return True

    def _set_health(self, status: Any) -> None:
        """What the health service says, for the whole server ("") and for this node by
        name (`probe.node_service`: the entry peers' probes ask for)."""
        self._health.set("", status)
        self._health.set(probe.node_service(self.node_id, self.incarnation), status)

    def _survive(self, source: str, exc: BaseException) -> None:
        """Error policy: nothing from outside (an etcd value, a disk error, a worker event)
        ends the agent. Logged once per distinct error, with its traceback; always counted."""
        self.metrics.errors_total.labels(**self.metrics.labels, source=source).inc()
        key = (source, type(exc).__name__, str(exc)[:200])
        if key in self._cs.errors_seen:
            return
        if len(self._cs.errors_seen) > 1000:
            self._cs.errors_seen.clear()  # bounded: a flood of distinct errors is logged again
        self._cs.errors_seen.add(key)
        log.error(
            "%s error, the agent goes on: %s: %s", source, type(exc).__name__, exc, exc_info=exc
        )

    def _event(self, kind: str, message: str) -> None:
        log.info("%s", message)
        self._events.append(kind, message, self.generation, at=self._clock.time())

    def events_since(
        self, index: int, timeout_s: float
    ) -> tuple[list[tuple[float, str, str, int]], int]:
        """Events after the `index`-th one ever logged (for the WatchEvents stream)."""
        return self._events.since(index, timeout_s)

    def _member_ids(self) -> Collection[str]:
        """The registered nodes where this agent reads them all (the leader); a follower,
        which reads only its own and the leader's, says the current generation's nodes."""
        vs = self._vs
        if vs.members_complete or vs.record is None:
            return vs.members.keys()
        return vs.record.planned_nodes

    def _known_members(self) -> list[str]:
        return sorted(self._member_ids())

    def _update_gauges(self) -> None:
        """Set the gauges (on every view refresh), unless their values did not change."""
        floor = self.store.floor
        counts = dict.fromkeys(WORKER_STATES, 0)
        counts.update(self.pool.counts())
        gs = self._fs.gen
        layout = (gs.plan.pp, gs.plan.tp, gs.plan.dp) if gs is not None else (0, 0, 0)
        values = (
            1 if self._vs.etcd_ok else 0,
            len(self._member_ids()),  # counted, not sorted
            1 if self._is_leader() else 0,
            self.generation,
            floor[1] if floor is not None else -1,
            tuple(counts.values()),
            layout,
        )
        last = self._cs.gauges
        if values == last:
            return
        self._cs.gauges = values
        m = self.metrics
        gauges = (m.etcd_up, m.members, m.is_leader, m.generation, m.safe_step)
        for i, (gauge, value) in enumerate(zip(gauges, values[: len(gauges)], strict=True)):
            if last is None or last[i] != value:
                m.of(gauge).set(value)
        before = last[len(gauges)] if last is not None else None
        for i, (state, n) in enumerate(counts.items()):
            if not isinstance(before, tuple) or before[i] != n:
                m.of(m.workers, state=state).set(n)
        if last is None or last[-1] != layout:
            for dimension, size in zip(("pp", "tp", "dp"), layout, strict=True):
                m.of(m.layout, dimension=dimension).set(size)

    def _control(self) -> None:
        """The control part's step: observe, decide (`control_step`, pure), execute."""
        gs = self._fs.gen
        try:
            drain_timeout_s: float | None = self._drain_requests.get_nowait()
        except queue.Empty:
            drain_timeout_s = None
        done = self._vs.barriers.get("done", {})
        obs = ControlObservation(
            now_s=self._clock.monotonic(),
            node_id=self.node_id,
            generation=self.generation,
            plan_nodes=gs.record.planned_set if gs else None,
            # The leader writes a generation's timeline once every planned node arrived at
            # started-G (which only the leader reads).
            started_everywhere=f"gen-{self.generation}" in self._vs.barriers.get("timelines", {}),
            finished_here=gs is not None and gs.phase is Phase.DONE,
            done_reported=any(int(v.get("step", -1)) >= self.spec.steps for v in done.values()),
            job_ended=self._hs.job_end is not None,
            workers_alive=self.pool.any_alive(),
            has_spares=bool(self.pool.spares()),
            drain_timeout_s=drain_timeout_s,
            exit_on_end=self.cfg.on_job_end == "exit",
            unfinished_exit_code=self.cfg.unfinished_exit_code,
        )
        self._execute(control_step(self._cs, obs))

    def drain(self, timeout_s: float) -> tuple[bool, str]:
        """Leave the job: the leader re-plans without this node at a step boundary, the new
        layout takes this node's state, then the agent exits (0, or the code of a node that
        leaves an unfinished job: `AgentConfig.unfinished_exit_code`)."""
        # Called on a gRPC thread: the request is queued for the loop, which alone writes
        # the agent's state (a flag read here is only a hint for the reply).
        if self._cs.draining:
            return True, "already draining"
        self._drain_requests.put(max(timeout_s, 1.0))
        self._wake.set()
        return True, "draining: the job moves off this node at the next step boundary"

    def status_snapshot(self) -> dict[str, Any]:
        """What the control RPCs read: a snapshot the loop publishes (at most STATUS_EVERY_S
        old), never the loop's live state, which another thread must not iterate."""
        snap = self._status
        if snap is not None:
            return snap
        # Before the loop's first publication: what is known without reading its state.
        return {
            "node_id": self.node_id,
            "job": self.spec.name,
            "generation": 0,
            "leader": "",
            "phase": "waiting",
            "ended": "",
            "quarantined": {},
            "layout": "",
            "last_step": -1,
            "last_loss": float("nan"),
            "members": [],
            "workers": [],
            "recoveries": [],
        }

    def status(self) -> dict[str, Any]:
        gs = self._fs.gen
        end = self._hs.job_end
        phase = "draining" if self._cs.draining else gs.phase.value if gs else "waiting"
        if end is not None:
            phase = "ended"
        return {
            "node_id": self.node_id,
            "job": self.spec.name,
            "generation": self.generation,
            "leader": self._vs.leader or "",
            "phase": phase,
            "ended": f"{end.status}: {end.reason}" if end is not None else "",
            "waiting": gs.waiting_said if gs is not None else "",
            "quarantined": self.quarantine_status(),
            "layout": str(gs.plan.layout) if gs else "",
            "last_step": self._ds.last_step,
            "last_loss": self._ds.last_loss,
            "members": self._known_members(),
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
                for w in self.pool.workers()
            ],
            "recoveries": self.timelines(),
        }
