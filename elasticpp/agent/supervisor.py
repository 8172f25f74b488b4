"""The supervisor part of the agent: the node's worker processes.

It keeps `slots` warm workers (spawned ahead, torch imported, idle until assigned), replaces
a spare that dies at once, turns worker events (read on each worker's own pipe by a reader
thread, queued, drained only by the decision loop) into worker state transitions
(`decide.WorkerState`), and acts on hangs and unhealthy GPUs. A malformed event or a disk
error while handling one is counted and the next event still counts.

The worker template (elasticpp.train.forkserver) is pinged between forks: one that does not
answer in time (stopped, hung) is killed with the workers it forked and another is started,
and so is one that served and then died. Either is the template's fault, not the node's: the
generation of the ranks it took with it is reported failed with this node as no culprit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elasticpp.agent.actions import (
    Action,
    Event,
    KillWorker,
    PingTemplate,
    ReplaceSpare,
    ReplaceTemplate,
    ReportFailure,
    SpawnWarm,
)
from elasticpp.agent.decide import (
    Phase,
    TransitionError,
    WorkerState,
    is_hung,
)
from elasticpp.agent.gpuhealth import describe_unhealthy, healthy_gpus, read_gpu_health
from elasticpp.agent.limits import (
    GPU_CHECK_INTERVAL_S,
    TEMPLATE_PING_EVERY_S,
    TEMPLATE_RESTART_MIN_S,
)
from elasticpp.errors import ElasticppError
from elasticpp.train.procs import EXITED, WORKER_DEVICE_ENV, WorkerProcess, WorkerTemplate

log = logging.getLogger("elasticpp.agent")


@dataclass
class SupervisorState:
    """The supervisor's state besides its worker pool (`pool.WorkerPool`): one object,
    written by this module's code on the loop."""

    gpus: list[int]  # physical GPUs of the slots, healthy ones only
    gpu_checked_s: float = 0.0  # monotonic
    template: WorkerTemplate | None = None  # forks the warm workers, once it is ready
    template_since_s: float = 0.0  # monotonic: when it was started


@dataclass(frozen=True)
class TemplateObservation:
    """The node's worker template, as the supervisor's step sees it. Seconds, monotonic."""

    pid: int
    usable: bool  # ready, forks
    lost: bool  # it served forks, then died or was given up (`WorkerTemplate.lost`)
    why_not: str  # why it is not used, once it is not
    # On the template's own clock (elasticpp.train.procs.WorkerTemplate times its pings):
    unanswered_s: float | None  # its ping waits for an answer this long (None: none waits)
    since_ping_s: float | None  # since its last ping was sent (None: never pinged)
    age_s: float  # since it was started
    answer_timeout_s: float  # an answer later than this: it is hung


@dataclass(frozen=True)
class SupervisorObservation:
    """What the supervisor's step sees. Times are monotonic seconds."""

    now_s: float
    # (pid, rank, generation, last progress, whether it completed a step of its generation)
    running: tuple[tuple[int, int, int, float, bool], ...]
    overdue_spares: tuple[tuple[int, float], ...]  # (pid, seconds waited) not ready in time
    spares: int
    slots: int
    may_refill: bool  # spares are wanted now (`SupervisorPart._may_refill`)
    hang_timeout_s: float
    ready_timeout_s: float
    first_step_timeout_s: float = 0.0
    template: TemplateObservation | None = None


def hang_timeout_for(stepped: bool, hang_timeout_s: float, first_step_timeout_s: float) -> float:
    """The hang rule's timeout for a running worker: `hang_timeout_s`, or, until it completed
    its generation's first step (compiling with `compile: true`, cold caches, the first
    collectives), the longer `first_step_timeout_s`. 0 turns the rule off."""
    if hang_timeout_s <= 0:
        return 0.0
    return hang_timeout_s if stepped else max(hang_timeout_s, first_step_timeout_s)


def template_step(t: TemplateObservation) -> list[Action]:
    """The worker template's deadlines: a ping unanswered for `answer_timeout_s` replaces
    it (it is stopped or hung, and reaps nothing: the workers it forked and that exited stay
    zombies), as does a template that served and is gone, once TEMPLATE_RESTART_MIN_S after
    its start (one that dies at every start is not started again at every tick); a usable
    template is pinged every TEMPLATE_PING_EVERY_S."""
    if t.usable and t.unanswered_s is not None and t.unanswered_s > t.answer_timeout_s:
        why = f"no answer to a ping in {t.unanswered_s:.0f} s (stopped or hung)"
        return [
            Event(
                "worker",
                f"worker template {t.pid}: {why}: killing it with the workers it forked, "
                "and starting another",
            ),
            ReplaceTemplate(t.pid, why),
        ]
    if t.lost and t.age_s >= TEMPLATE_RESTART_MIN_S:
        return [
            Event("worker", f"worker template {t.pid} is gone ({t.why_not}): starting another"),
            ReplaceTemplate(t.pid, t.why_not),
        ]
    due = t.since_ping_s is None or t.since_ping_s >= TEMPLATE_PING_EVERY_S
    if t.usable and t.unanswered_s is None and due:
        return [PingTemplate(t.pid)]
    return []


def supervisor_step(obs: SupervisorObservation) -> list[Action]:
    """The supervisor's deadlines, decided; no I/O. A running worker that made no progress
    for `hang_timeout_s` is killed (without waiting) and its generation reported failed; a
    spare not ready `ready_timeout_s` after its start (stuck importing torch, initialising a
    GPU) is replaced, and a generation waiting for it fails in the follower, blaming this
    node; the warm pool is refilled one spare per step, when spares are wanted."""
    actions: list[Action] = []
    for pid, rank, generation, last_progress_s, stepped in obs.running:
        timeout_s = hang_timeout_for(stepped, obs.hang_timeout_s, obs.first_step_timeout_s)
        if is_hung(last_progress_s, obs.now_s, timeout_s):
            what = "no progress" if stepped else "no first step"
            actions += [
                Event(
                    "worker", f"worker rank {rank} made {what} for {timeout_s:.0f} s: killing it"
                ),
                KillWorker(pid),
                ReportFailure(generation, f"worker rank {rank} hung"),
            ]
    for pid, waited_s in obs.overdue_spares:
        actions += [
            Event(
                "worker",
                f"warm worker {pid} not ready {waited_s:.0f} s after its start "
                f"(ready_timeout_s is {obs.ready_timeout_s:.0f}): replacing it",
            ),
            ReplaceSpare(pid),
        ]
    if obs.template is not None:
        actions += template_step(obs.template)
    if obs.may_refill and obs.spares - len(obs.overdue_spares) < obs.slots:
        actions.append(SpawnWarm())
    return actions


# What a worker (where the user's model code runs) does not inherit of the agent's
# environment: where systemd keeps this service's credentials (its TLS key, the etcd
# password). The agent takes every secret of its own from files, never from the environment;
# the user's own variables (a hub token their code needs, say) are theirs and pass.
_AGENT_ONLY = ("CREDENTIALS_DIRECTORY",)


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment, less what points at the agent's own secrets."""
    return {k: v for k, v in environ.items() if k not in _AGENT_ONLY}


class SupervisorPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _warm_environment(self) -> tuple[dict[str, str], dict[str, str]]:
        """The environment of this node's workers and template, and the python to run."""
        env = worker_environment(os.environ)
        env["ELASTICPP_NODE_ID"] = self.node_id
        env[WORKER_DEVICE_ENV] = self.cfg.device  # a CUDA worker initialises CUDA while warm
        if self.cfg.worker_threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(self.cfg.worker_threads))
        return env, ({"python": self.python} if self.python else {})

    def _spawn_warm(self) -> None:
        """Keep `slots` warm workers: spawned ahead, torch imported, waiting for work. They
        are forked from this node's worker template once it is ready (it imported torch
        once), and exec'd until then or if it cannot fork (elasticpp.train.forkserver)."""
        env, python = self._warm_environment()
        if self._worker_factory is None and not self._template_waited(env, python):
            return  # the template imports torch: the spares are forked from it in a moment
        while len(self.pool.spares()) < self.cfg.slots:
            name = f"{self.node_id}-w{uuid.uuid4().hex[:6]}"
            kwargs: dict[str, Any] = {"env": env, "name": name, "template": self._ss.template}
            kwargs.update(python)
            log_path = self.log_dir / f"{name}.log"
            if self._worker_factory is not None:  # a simulated worker (bench/scale.py)
                proc = self._worker_factory(log_path, env, name)
            else:
                proc = WorkerProcess(log_path, **kwargs)
                how = "fork" if proc.forked else "exec"
                self.metrics.warm_started_total.labels(**self.metrics.labels, how=how).inc()
            proc.listen(self.pool.deliver)
            self.pool.add_spare(proc)

    def _template_waited(self, env: dict[str, str], python: dict[str, str]) -> bool:
        """Whether spares may be spawned now: the node's worker template is ready (forks),
        or failed (exec). It is started with the first spares; they wait for it, as they
        would for their own imports, and it is held to their deadline: a template not
        ready within `ready_timeout_s` is given up and counts as a never-ready spare (the
        follower reports this node sick for it), and spares are exec'd."""
        now = self._clock.monotonic()
        if self._ss.template is None:
            self._start_template(env, python)
        assert self._ss.template is not None
        if not self._ss.template.loading():
            return True
        waited_s = now - self._ss.template_since_s
        if waited_s <= self.spec.ready_timeout_s:
            return False
        self._ss.template.give_up(f"not ready within {self.spec.ready_timeout_s:.0f} s")
        self.pool.note_never_ready(now)
        self.journal.write(
            "worker",
            f"worker template {self._ss.template.pid} not ready {waited_s:.0f} s after its start "
            f"(ready_timeout_s is {self.spec.ready_timeout_s:.0f}): spares start with exec",
        )
        return True

    def _start_template(self, env: dict[str, str], python: dict[str, str]) -> None:
        self._ss.template = WorkerTemplate(
            self.log_dir / f"{self.node_id}-template.log",
            env=env,
            on_ready=self._wake.set,
            **python,
        )
        self._ss.template_since_s = self._clock.monotonic()

    def _ping_template(self, pid: int) -> None:
        template = self._ss.template
        if template is not None and template.pid == pid:
            template.ping()

    def _replace_template(self, pid: int, why: str) -> None:
        """Kill the template `pid` with the workers it forked (they die with it, by their
        parent-death signal: killed here first, so that their exits are ours and not
        failures of theirs), report the generations of those that held ranks failed, this
        node being no culprit (a new template serves it again), and start another template
        if spares are wanted now (else the next spare starts it)."""
        old = self._ss.template
        if old is None or old.pid != pid:
            return  # already replaced
        forked = old.forked_pids()
        lost: dict[int, list[int]] = {}
        for w in self.pool.workers():
            if w.proc.pid not in forked:
                continue
            if w.state in (WorkerState.STARTING, WorkerState.RUNNING):
                lost.setdefault(w.generation, []).append(w.rank)
            if w.state not in (WorkerState.DONE, WorkerState.STOPPED, WorkerState.FAILED):
                self.pool.kill_worker(w)
        for spare in self.pool.spares():
            if spare.pid in forked:
                self.pool.drop_spare(spare, kill=True)
        old.give_up(why, quiet=True)  # SIGKILL of its process group; reaped
        self._ss.template = None
        for generation, ranks in sorted(lost.items()):
            self._report_failure(
                generation,
                f"rank(s) {sorted(ranks)} killed with their worker template {pid} ({why})",
            )
        if self._worker_factory is None and self._may_refill():
            self._start_template(*self._warm_environment())

    def _template_observation(self, now_s: float) -> TemplateObservation | None:
        t = self._ss.template
        if t is None:
            return None
        return TemplateObservation(
            pid=t.pid,
            usable=t.usable(),
            lost=t.lost(),
            why_not=t.why_not or "",
            unanswered_s=t.unanswered_s(),
            since_ping_s=t.since_ping_s(),
            age_s=now_s - self._ss.template_since_s,
            answer_timeout_s=t.answer_timeout_s,
        )

    def _supervise(self) -> None:
        """The supervisor's step on the clock: observe, decide (`supervisor_step`, pure),
        execute. Worker events are handed over by `_drain_worker_events`."""
        now = self._clock.monotonic()
        self._execute(
            supervisor_step(
                SupervisorObservation(
                    now_s=now,
                    running=tuple(
                        (w.proc.pid, w.rank, w.generation, w.last_progress_s, w.last_step >= 0)
                        for w in self.pool.workers()
                        if w.state is WorkerState.RUNNING
                    ),
                    overdue_spares=tuple(
                        (p.pid, waited_s)
                        for p, waited_s in self.pool.overdue_spares(now, self.spec.ready_timeout_s)
                    ),
                    spares=len(self.pool.spares()),
                    slots=self.cfg.slots,
                    may_refill=self._may_refill(),
                    hang_timeout_s=self.spec.hang_timeout_s,
                    ready_timeout_s=self.spec.ready_timeout_s,
                    first_step_timeout_s=self.spec.first_step_deadline_s,
                    template=self._template_observation(now),
                )
            )
        )

    def _rest_for_s(self, now_s: float) -> float | None:
        """How long the supervisor's step may wait: until its next deadline (a running
        worker's hang deadline, the next GPU check), or None while it polls (a spare not
        ready yet, or one to start)."""
        spares = self.pool.spares()
        if self.pool.ready_spares() < len(spares):
            return None
        if self._may_refill() and len(spares) < self.cfg.slots:
            return None
        rest_s = float("inf")
        for w in self.pool.workers():
            if w.state is WorkerState.RUNNING:
                timeout_s = hang_timeout_for(
                    w.last_step >= 0, self.spec.hang_timeout_s, self.spec.first_step_deadline_s
                )
                if timeout_s > 0:
                    rest_s = min(rest_s, w.last_progress_s + timeout_s - now_s)
        if self.cfg.device == "cuda":
            rest_s = min(rest_s, self._ss.gpu_checked_s + GPU_CHECK_INTERVAL_S - now_s)
        t = self._template_observation(now_s)
        if t is not None:  # its next ping, the deadline of the one sent, its replacement
            if t.usable and t.unanswered_s is not None:
                rest_s = min(rest_s, t.answer_timeout_s - t.unanswered_s)
            elif t.usable and t.since_ping_s is not None:
                rest_s = min(rest_s, TEMPLATE_PING_EVERY_S - t.since_ping_s)
            elif t.usable:
                rest_s = 0.0
            elif t.lost:
                rest_s = min(rest_s, TEMPLATE_RESTART_MIN_S - t.age_s)
        return rest_s

    def _may_refill(self) -> bool:
        """Spares are wanted, except while this node's ranks of the current generation are
        starting (spares import torch, and on a loaded node that would compete for the CPU
        with the ranks the recovery waits for; the pool is full again a moment after they
        run), while the agent leaves, and once the job is over."""
        gs = self._fs.gen
        return not (
            self._exit_requested() is not None
            or self.control.summary().draining
            or (gs is not None and gs.phase is Phase.STARTING)
            or self.control.summary().job_done
            or self._hs.job_end is not None
        )

    def _refill_warm(self) -> None:
        """Level-triggered: one spare short of the slots is started again at once (a spare
        that died), when spares are wanted (`_may_refill`)."""
        if self._may_refill() and len(self.pool.spares()) < self.cfg.slots:
            self._spawn_warm()

    def _take_warm(self, count: int) -> list[WorkerProcess] | None:
        return self.pool.take_ready(count)

    def _drain_worker_events(self) -> None:
        while True:
            item = self.pool.next_event()
            if item is None:
                return
            proc, event = item
            try:
                self._on_worker_event(proc, event)
            except TransitionError as exc:  # a late or reordered event must not end the agent
                log.warning("worker %d: event %s ignored: %s", proc.pid, event.get("event"), exc)
            except (OSError, ElasticppError, ValueError, KeyError, TypeError) as exc:
                # A malformed event, or a disk error (ENOSPC on metrics.jsonl or a manifest):
                # this event is lost, the loop and the other events are not.
                self.errors.survive("worker", exc)

    def _on_worker_event(self, proc: WorkerProcess, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "ready":
            self.pool.mark_ready(proc.pid)
            return
        w = self.pool.worker(proc.pid)
        if w is None:
            if kind == EXITED and self.pool.is_spare(proc):
                # A spare that dies (an OOM kill, a crash while importing torch) is replaced
                # at once (once this node's ranks run, if they are starting): the next
                # recovery on this node needs it.
                log.warning(
                    "warm worker %d exited with %s; starting a replacement",
                    proc.pid,
                    event.get("returncode"),
                )
                self.pool.drop_spare(proc)
                self.metrics.worker_failures_total.labels(**self.metrics.labels).inc()
                self._refill_warm()
            return
        w.last_progress_s = self._clock.monotonic()
        if kind == "started":
            if w.state is WorkerState.STARTING:  # a stop may already have been asked for
                w.move(WorkerState.RUNNING)
            self._on_started(event)
            log.info(
                "rank %d of generation %d started in %.2f s %s",
                w.rank,
                w.generation,
                float(event.get("setup_seconds") or 0.0),
                event.get("setup") or "",
            )
        elif kind == "step":
            w.last_step = int(event["step"])
            self._on_step(w, event)
        elif kind == "snapshot":
            self._on_snapshot(w, event)
        elif kind == "snapshot_failed":
            self._on_snapshot_failed(w, event)
        elif kind == "stopped":
            w.move(WorkerState.STOPPED)
        elif kind == "halted":
            w.move(WorkerState.STOPPED)
            self.pool.rank_halted(w.generation, str(event.get("message")))  # the follower acts
        elif kind == "done":
            w.move(WorkerState.DONE)
            self.pool.rank_done(w.generation, w.rank)
        elif kind == "error":
            log.warning("worker rank %d: %s", w.rank, event.get("message"))
        elif kind == EXITED:
            rc = event.get("returncode")
            if w.state not in (WorkerState.DONE, WorkerState.STOPPED, WorkerState.FAILED):
                w.move(WorkerState.FAILED)
                if not w.killed_by_us:
                    self._worker_failed_log(proc, w.generation, w.rank, rc)
                    self._report_failure(
                        w.generation, f"worker rank {w.rank} exited with code {rc}"
                    )
            self.pool.forget(proc.pid)
            log_path = getattr(proc, "log_path", None)
            if log_path is not None:
                self.worker_logs.forget(log_path)

    def _worker_failed_log(self, proc: WorkerProcess, generation: int, rank: int, rc: Any) -> None:
        """A worker that failed on its own: the tail of its log (its traceback) in the agent's
        log and in a failure event (`ctl events`), and its log kept beside the job's first
        failures (the root cause of a crash loop outlives the rotation)."""
        log_path = getattr(proc, "log_path", None)
        if log_path is None:
            return
        tail = self.worker_logs.failure_tail(log_path)
        kept = self.worker_logs.keep(log_path)
        where = f" (log: {kept})" if kept is not None else ""
        log.error(
            "worker rank %d of generation %d exited with code %s%s; its last lines:\n%s",
            rank,
            generation,
            rc,
            where,
            tail or "(nothing)",
        )
        self.journal.record(
            "worker",
            f"rank {rank} of generation {generation} exited with code {rc}{where}: "
            + (tail or "(no output)"),
            generation,
        )

    def _check_gpus(self) -> None:
        """Drop GPUs that NVML reports unhealthy from this node's slots, and have the leader
        re-plan around them."""
        now = self._clock.monotonic()
        if self.cfg.device != "cuda" or now - self._ss.gpu_checked_s < GPU_CHECK_INTERVAL_S:
            return
        self._ss.gpu_checked_s = now
        readings = read_gpu_health()
        if readings is None:
            return
        healthy = set(healthy_gpus(readings))
        lost = [g for g in self._ss.gpus if g not in healthy]
        if not lost:
            return
        self._ss.gpus = [g for g in self._ss.gpus if g in healthy]
        self.journal.write("worker", "unhealthy: " + "; ".join(describe_unhealthy(readings)))
        if self._registration is not None:
            with contextlib.suppress(ElasticppError):
                self._registration.update(self._member_info())
        gs = self._fs.gen
        if gs is not None:
            self._report_failure(gs.generation, f"GPU(s) {lost} unhealthy")
