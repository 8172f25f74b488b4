"""The supervisor part of the agent: the node's worker processes.

It keeps `slots` warm workers (spawned ahead, torch imported, idle until assigned), replaces
a spare that dies at once, turns worker events (read on each worker's own pipe by a reader
thread, queued, drained only by the decision loop) into worker state transitions
(`decide.WorkerState`), and acts on hangs and unhealthy GPUs. A malformed event or a disk
error while handling one is counted and the next event still counts.

The worker template (elasticpp.train.worker.forkserver) is pinged between forks: one that does not
answer in time (stopped, hung) is killed with the workers it forked and another is started,
and so is one that served and then died. Either is the template's fault, not the node's: the
generation of the ranks it took with it is reported failed with this node as no culprit.

`Supervisor` is built with its ports: the worker pool it fills, the clock, the journal, the
metrics, the error policy, the worker logs, what the other parts do with a worker's events
(`WorkerEvents`), where a failure is reported, and whether spares are wanted now (the other
parts' summaries decide it). Its decisions are `step`'s; its state is plain
(`step.SupervisorState`), the template's process is held here.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticpp.agent.actions import (
    Action,
    Event,
    KillWorker,
    PingTemplate,
    PublishMemberInfo,
    ReplaceSpare,
    ReplaceTemplate,
    ReportFailure,
    SpawnWarm,
)
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.decide import TransitionError, WorkerState
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.journal import ErrorPolicy, Journal
from elasticpp.agent.kernel.limits import GPU_CHECK_INTERVAL_S
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.pool import Worker, WorkerPool
from elasticpp.agent.kernel.records import JSONValue, integer, number
from elasticpp.agent.kernel.worklogs import WorkerLogs
from elasticpp.agent.supervisor.gpuhealth import describe_unhealthy, healthy_gpus, read_gpu_health
from elasticpp.agent.supervisor.step import (
    SupervisorObservation,
    SupervisorState,
    TemplateObservation,
    supervisor_rest_s,
    supervisor_step,
    worker_environment,
)
from elasticpp.errors import ElasticppError
from elasticpp.train.worker.procs import EXITED, WORKER_DEVICE_ENV, WorkerProcess, WorkerTemplate

log = logging.getLogger("elasticpp.agent")

# (log path, environment, name) -> a warm worker: a WorkerProcess, or a simulated one with
# the same methods (bench/scale.py)
WorkerFactory = Callable[[Path, dict[str, str], str], WorkerProcess]


@dataclass(frozen=True)
class WorkerEvents:
    """What the other parts do with the events of a worker that holds a rank."""

    on_started: Callable[[dict[str, JSONValue]], None]
    on_step: Callable[[Worker, dict[str, JSONValue]], None]
    on_snapshot: Callable[[Worker, dict[str, JSONValue]], None]
    on_snapshot_failed: Callable[[Worker, dict[str, JSONValue]], None]


# (log path, environment, on ready, python) -> the node's worker template (tests give another)
TemplateFactory = Callable[[Path, dict[str, str], Callable[[], None], str], WorkerTemplate]


def _worker_template(
    log_path: Path, env: dict[str, str], on_ready: Callable[[], None], python: str
) -> WorkerTemplate:
    return WorkerTemplate(log_path, env=env, on_ready=on_ready, python=python)


# Where a generation's failure is reported (the follower publishes it): (generation, why,
# whether it followed a peer's failure).
ReportFailed = Callable[[int, str, bool], None]


@dataclass(frozen=True)
class SupervisorConfig:
    node_id: str
    slots: int
    device: str  # "cpu" or "cuda"
    log_dir: Path  # the workers' and the template's logs
    ready_timeout_s: float
    hang_timeout_s: float
    first_step_timeout_s: float
    worker_threads: int | None = None
    python: str | None = None  # the workers' interpreter (default: this one)


class Supervisor:
    """The supervisor part: warm spares, the worker template, worker events and deadlines."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        clock: Clock,
        pool: WorkerPool,
        journal: Journal,
        metrics: AgentMetrics,
        errors: ErrorPolicy,
        logs: WorkerLogs,
        events: WorkerEvents,
        report_failed: ReportFailed,
        spares_wanted: Callable[[], bool],
        wake: Callable[[], None],
        worker_factory: WorkerFactory | None = None,
        template_factory: TemplateFactory = _worker_template,
    ) -> None:
        self.config = config
        self.state = SupervisorState(gpus=list(range(config.slots)))
        self._clock = clock
        self._pool = pool
        self._journal = journal
        self._metrics = metrics
        self._errors = errors
        self._logs = logs
        self._events = events
        self._report_failed = report_failed
        self._spares_wanted = spares_wanted
        self._wake = wake
        self._worker_factory = worker_factory  # a simulated worker's (bench/scale.py)
        self._template_factory = template_factory
        self._template: WorkerTemplate | None = None  # forks the warm workers, once ready

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only this part emits."""
        executor.register(KillWorker, self._kill_worker)
        executor.register(ReplaceSpare, self._replace_spare)
        executor.register(PingTemplate, self._ping_template)
        executor.register(ReplaceTemplate, self._replace_template)
        executor.register(SpawnWarm, lambda _: self.spawn_warm())

    @property
    def gpus(self) -> tuple[int, ...]:
        """The physical GPUs of this node's slots, healthy ones only."""
        return tuple(self.state.gpus)

    @property
    def template_pid(self) -> int | None:
        return self._template.pid if self._template is not None else None

    def close(self) -> None:
        """Stop the template (the agent kills the workers through the pool)."""
        if self._template is not None:
            self._template.close()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Action]:
        """The supervisor's deadlines on the clock: observe, decide (`supervisor_step`,
        pure); the caller executes what it returns. Worker events come in `drain_events`."""
        return supervisor_step(self._observation(self._clock.monotonic()))

    def rest_for_s(self, now_s: float) -> float | None:
        """How long the supervisor may rest (`step.supervisor_rest_s`)."""
        return supervisor_rest_s(self._observation(now_s))

    def _observation(self, now_s: float) -> SupervisorObservation:
        cfg, pool = self.config, self._pool
        spares = pool.spares()
        return SupervisorObservation(
            now_s=now_s,
            running=tuple(
                (w.proc.pid, w.rank, w.generation, w.last_progress_s, w.last_step >= 0)
                for w in pool.workers()
                if w.state is WorkerState.RUNNING
            ),
            overdue_spares=tuple(
                (p.pid, waited_s) for p, waited_s in pool.overdue_spares(now_s, cfg.ready_timeout_s)
            ),
            spares=len(spares),
            slots=cfg.slots,
            may_refill=self._spares_wanted(),
            hang_timeout_s=cfg.hang_timeout_s,
            ready_timeout_s=cfg.ready_timeout_s,
            first_step_timeout_s=cfg.first_step_timeout_s,
            template=self._template_observation(now_s),
            ready_spares=pool.ready_spares(),
            gpu_check_at_s=self.state.gpu_checked_s + GPU_CHECK_INTERVAL_S
            if cfg.device == "cuda"
            else None,
        )

    def _template_observation(self, now_s: float) -> TemplateObservation | None:
        t = self._template
        if t is None:
            return None
        return TemplateObservation(
            pid=t.pid,
            usable=t.usable(),
            lost=t.lost(),
            why_not=t.why_not or "",
            unanswered_s=t.unanswered_s(),
            since_ping_s=t.since_ping_s(),
            age_s=now_s - self.state.template_since_s,
            answer_timeout_s=t.answer_timeout_s,
        )

    # ------------------------------------------------------------------ warm workers
    def environment(self) -> tuple[dict[str, str], str]:
        """The environment of this node's workers and template, and the python to run."""
        cfg = self.config
        env = worker_environment(os.environ)
        env["ELASTICPP_NODE_ID"] = cfg.node_id
        env[WORKER_DEVICE_ENV] = cfg.device  # a CUDA worker initialises CUDA while warm
        if cfg.worker_threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(cfg.worker_threads))
        return env, cfg.python or sys.executable

    def spawn_warm(self) -> None:
        """Keep `slots` warm workers: spawned ahead, torch imported, waiting for work. They
        are forked from this node's worker template once it is ready (it imported torch
        once), and exec'd until then or if it cannot fork (elasticpp.train.worker.forkserver)."""
        env, python = self.environment()
        if self._worker_factory is None and not self._template_waited(env, python):
            return  # the template imports torch: the spares are forked from it in a moment
        while len(self._pool.spares()) < self.config.slots:
            name = f"{self.config.node_id}-w{uuid.uuid4().hex[:6]}"
            log_path = self.config.log_dir / f"{name}.log"
            if self._worker_factory is not None:  # a simulated worker (bench/scale.py)
                proc = self._worker_factory(log_path, env, name)
            else:
                proc = WorkerProcess(
                    log_path, env=env, name=name, template=self._template, python=python
                )
                how = "fork" if proc.forked else "exec"
                self._metrics.warm_started_total.labels(**self._metrics.labels, how=how).inc()
            proc.listen(self._pool.deliver)
            self._pool.add_spare(proc)

    def refill(self) -> None:
        """Level-triggered: one spare short of the slots is started again at once (a spare
        that died), when spares are wanted."""
        if self._spares_wanted() and len(self._pool.spares()) < self.config.slots:
            self.spawn_warm()

    def take_warm(self, count: int) -> list[WorkerProcess] | None:
        return self._pool.take_ready(count)

    def _template_waited(self, env: dict[str, str], python: str) -> bool:
        """Whether spares may be spawned now: the node's worker template is ready (forks),
        or failed (exec). It is started with the first spares; they wait for it, as they
        would for their own imports, and it is held to their deadline: a template not
        ready within `ready_timeout_s` is given up and counts as a never-ready spare (the
        follower reports this node sick for it), and spares are exec'd."""
        now = self._clock.monotonic()
        if self._template is None:
            self._template = self._start_template(env, python)
        if not self._template.loading():
            return True
        waited_s = now - self.state.template_since_s
        timeout_s = self.config.ready_timeout_s
        if waited_s <= timeout_s:
            return False
        self._template.give_up(f"not ready within {timeout_s:.0f} s")
        self._pool.note_never_ready(now)
        self._journal.write(
            "worker",
            f"worker template {self._template.pid} not ready {waited_s:.0f} s after its start "
            f"(ready_timeout_s is {timeout_s:.0f}): spares start with exec",
        )
        return True

    def _start_template(self, env: dict[str, str], python: str) -> WorkerTemplate:
        template = self._template_factory(
            self.config.log_dir / f"{self.config.node_id}-template.log", env, self._wake, python
        )
        self.state.template_since_s = self._clock.monotonic()
        return template

    # ------------------------------------------------------------------ the handlers
    def _kill_worker(self, action: KillWorker) -> None:
        w = self._pool.worker(action.pid)
        if w is not None:
            self._pool.kill_worker(w)  # reaped by its reader thread; the loop goes on

    def _replace_spare(self, action: ReplaceSpare) -> None:
        spare = next((p for p in self._pool.spares() if p.pid == action.pid), None)
        if spare is not None:
            self._pool.replace_overdue(spare, self._clock.monotonic())
            self._metrics.worker_failures_total.labels(**self._metrics.labels).inc()

    def _ping_template(self, action: PingTemplate) -> None:
        if self._template is not None and self._template.pid == action.pid:
            self._template.ping()

    def _replace_template(self, action: ReplaceTemplate) -> list[Action]:
        """Kill the template with the workers it forked (they die with it, by their
        parent-death signal: killed here first, so that their exits are ours and not
        failures of theirs), report the generations of those that held ranks failed, this
        node being no culprit (a new template serves it again), and start another template
        if spares are wanted now (else the next spare starts it)."""
        old, pid, why = self._template, action.pid, action.why
        if old is None or old.pid != pid:
            return []  # already replaced
        forked = old.forked_pids()
        lost: dict[int, list[int]] = {}
        for w in self._pool.workers():
            if w.proc.pid not in forked:
                continue
            if w.state in (WorkerState.STARTING, WorkerState.RUNNING):
                lost.setdefault(w.generation, []).append(w.rank)
            if w.state not in (WorkerState.DONE, WorkerState.STOPPED, WorkerState.FAILED):
                self._pool.kill_worker(w)
        for spare in self._pool.spares():
            if spare.pid in forked:
                self._pool.drop_spare(spare, kill=True)
        old.give_up(why, quiet=True)  # SIGKILL of its process group; reaped
        self._template = None
        if self._worker_factory is None and self._spares_wanted():
            self._template = self._start_template(*self.environment())
        return [
            ReportFailure(g, f"rank(s) {sorted(r)} killed with their worker template {pid} ({why})")
            for g, r in sorted(lost.items())
        ]

    # ------------------------------------------------------------------ worker events
    def drain_events(self) -> None:
        """Every event the workers' reader threads queued, in order."""
        while True:
            item = self._pool.next_event()
            if item is None:
                return
            proc, event = item
            try:
                self._on_event(proc, event)
            except TransitionError as exc:  # a late or reordered event must not end the agent
                log.warning("worker %d: event %s ignored: %s", proc.pid, event.get("event"), exc)
            except (OSError, ElasticppError, ValueError, KeyError, TypeError) as exc:
                # A malformed event, or a disk error (ENOSPC on metrics.jsonl or a manifest):
                # this event is lost, the loop and the other events are not.
                self._errors.survive("worker", exc)

    def _on_event(self, proc: WorkerProcess, event: dict[str, JSONValue]) -> None:
        kind = event.get("event")
        pool = self._pool
        if kind == "ready":
            pool.mark_ready(proc.pid)
            return
        w = pool.worker(proc.pid)
        if w is None:
            if kind == EXITED and pool.is_spare(proc):
                # A spare that dies (an OOM kill, a crash while importing torch) is replaced
                # at once (once this node's ranks run, if they are starting): the next
                # recovery on this node needs it.
                log.warning(
                    "warm worker %d exited with %s; starting a replacement",
                    proc.pid,
                    event.get("returncode"),
                )
                pool.drop_spare(proc)
                self._metrics.worker_failures_total.labels(**self._metrics.labels).inc()
                self.refill()
            return
        w.last_progress_s = self._clock.monotonic()
        if kind == "started":
            if w.state is WorkerState.STARTING:  # a stop may already have been asked for
                w.move(WorkerState.RUNNING)
            self._events.on_started(event)
            log.info(
                "rank %d of generation %d started in %.2f s %s",
                w.rank,
                w.generation,
                number(event, "setup_seconds", 0.0),
                event.get("setup") or "",
            )
        elif kind == "step":
            w.last_step = integer(event, "step")
            self._events.on_step(w, event)
        elif kind == "snapshot":
            self._events.on_snapshot(w, event)
        elif kind == "snapshot_failed":
            self._events.on_snapshot_failed(w, event)
        elif kind == "stopped":
            w.move(WorkerState.STOPPED)
        elif kind == "halted":
            w.move(WorkerState.STOPPED)
            pool.rank_halted(w.generation, str(event.get("message")))  # the follower acts
        elif kind == "done":
            w.move(WorkerState.DONE)
            pool.rank_done(w.generation, w.rank)
        elif kind == "error":
            w.followed_a_peer = event.get("peer") is True
            log.warning("worker rank %d: %s", w.rank, event.get("message"))
        elif kind == EXITED:
            rc = event.get("returncode")
            if w.state not in (WorkerState.DONE, WorkerState.STOPPED, WorkerState.FAILED):
                w.move(WorkerState.FAILED)
                if not w.killed_by_us:
                    self._failed_log(proc, w.generation, w.rank, rc)
                    self._report_failed(
                        w.generation,
                        f"worker rank {w.rank} exited with code {rc}"
                        + (" after a peer went away" if w.followed_a_peer else ""),
                        w.followed_a_peer,
                    )
            pool.forget(proc.pid)
            log_path = getattr(proc, "log_path", None)
            if log_path is not None:
                self._logs.forget(log_path)

    def _failed_log(self, proc: WorkerProcess, generation: int, rank: int, rc: Any) -> None:
        """A worker that failed on its own: the tail of its log (its traceback) in the agent's
        log and in a failure event (`ctl events`), and its log kept beside the job's first
        failures (the root cause of a crash loop outlives the rotation)."""
        log_path = getattr(proc, "log_path", None)
        if log_path is None:
            return
        tail = self._logs.failure_tail(log_path)
        kept = self._logs.keep(log_path)
        where = f" (log: {kept})" if kept is not None else ""
        log.error(
            "worker rank %d of generation %d exited with code %s%s; its last lines:\n%s",
            rank,
            generation,
            rc,
            where,
            tail or "(nothing)",
        )
        self._journal.record(
            "worker",
            f"rank {rank} of generation {generation} exited with code {rc}{where}: "
            + (tail or "(no output)"),
            generation,
        )

    # ------------------------------------------------------------------ GPUs
    def check_gpus(self, generation: int) -> list[Action]:
        """Drop GPUs that NVML reports unhealthy from this node's slots: the member record
        says the new slot count and generation `generation` (0: none) fails here, so that
        the leader re-plans around them."""
        now = self._clock.monotonic()
        state = self.state
        if self.config.device != "cuda" or now - state.gpu_checked_s < GPU_CHECK_INTERVAL_S:
            return []
        state.gpu_checked_s = now
        readings = read_gpu_health()
        if readings is None:
            return []
        healthy = set(healthy_gpus(readings))
        lost = [g for g in state.gpus if g not in healthy]
        if not lost:
            return []
        state.gpus = [g for g in state.gpus if g in healthy]
        actions: list[Action] = [
            Event("worker", "unhealthy: " + "; ".join(describe_unhealthy(readings))),
            PublishMemberInfo(),
        ]
        if generation > 0:
            actions.append(ReportFailure(generation, f"GPU(s) {lost} unhealthy"))
        return actions
