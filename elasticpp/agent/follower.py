"""The follower part of the agent: this node's way through each plan generation.

Phases (`decide.Phase`, transitions written down there): stopping -> moving -> starting ->
running (or idle for a spare, done at the end, failed). Every phase that waits on someone
else has a deadline (`decide.phase_deadline_s`); past it the node reports the generation
failed so that the leader re-plans. Failure reports are level-triggered: pending until etcd
has them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from elasticpp.agent.decide import (
    Phase,
    WorkerState,
    may_enter,
    phase_deadline_s,
    phase_transition,
)
from elasticpp.agent.limits import FETCH_STALL_S, STOP_GRACE_S
from elasticpp.agent.pool import _Worker
from elasticpp.cluster.client import RESUME_MEMBER
from elasticpp.cluster.errors import (
    ClusterUnavailableError,
)
from elasticpp.cluster.records import GenerationRecord
from elasticpp.errors import ConfigError, ElasticppError
from elasticpp.plan import Plan
from elasticpp.store.resume import TransferProgress
from elasticpp.train.procs import WorkerProcess

log = logging.getLogger("elasticpp.agent")


def run_in_thread(name: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run `fn(*args)` on a daemon thread of its own; its result (or error) comes back
    through the future, which the loop polls: the thread itself writes no agent state."""
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the loop, which decides what it means
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future


@dataclass
class _GenState:
    """This agent's progress through one generation."""

    record: GenerationRecord
    phase: Phase = Phase.STOPPING
    phase_since_s: float = field(default_factory=time.monotonic)
    stop_sent: bool = False
    stop_began_s: float = field(default_factory=time.monotonic)
    killed_at_s: float | None = None  # when the old workers were first sent SIGKILL
    # The state fetch runs on a thread of its own that writes nothing here: its outcome
    # comes back through this future, its bytes through `fetch_progress` (thread-safe).
    fetch: Future[Any] | None = None
    fetch_progress: TransferProgress | None = None
    fetch_done_at: float | None = None
    resume: dict[str, Any] | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)  # the agent's

    @property
    def generation(self) -> int:
        return self.record.generation

    def enter(self, phase: Phase) -> bool:
        """Move to `phase`; a transition not written down (a late or reordered
        observation) is ignored and reported as False, never raised in the loop."""
        if not may_enter(self.phase, phase):
            log.info(
                "generation %d: %s -> %s ignored (not a transition of a generation)",
                self.generation,
                self.phase.value,
                phase.value,
            )
            return False
        self.phase = phase_transition(self.phase, phase)
        self.phase_since_s = self.clock()
        return True

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


@dataclass
class FollowerState:
    """The follower part's state: one object, written by this module's code on the loop
    (the fetch thread hands its outcome back through a future)."""

    gen: _GenState | None = None  # this node's way through the newest generation it follows
    pending_failures: dict[int, dict[str, Any]] = field(default_factory=dict)  # gen -> report
    failures_held: set[int] = field(default_factory=set)  # reports etcd refused (logged once)
    detected: dict[int, float] = field(default_factory=dict)  # generation -> wall time a
    # failure here that calls for it was first seen (the recovery timeline)


class FollowerPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _report_failure(
        self, generation: int, reason: str, *, culprit: bool = False, severe: bool = False
    ) -> None:
        """Report generation `generation` failed here. `culprit`: this node is the cause (its
        disk, its spares, its workers), not a victim of a peer's failure; `severe`: the
        leader quarantines it at once (elasticpp.agent.sick)."""
        self._event("worker", f"failure in generation {generation}: {reason}")
        self.metrics.worker_failures_total.labels(**self.metrics.labels).inc()
        self._fs.detected.setdefault(generation + 1, self._clock.time())
        # Level-triggered: the report stays pending until etcd has it, so a failure seen
        # while etcd is down is published when it returns instead of being lost.
        self._fs.pending_failures.setdefault(
            generation,
            {"reason": reason, "at": self._clock.time(), "culprit": culprit, "severe": severe},
        )
        self._publish_failures()

    def _publish_failures(self) -> None:
        for generation in sorted(self._fs.pending_failures):
            if self._fs.gen is not None and generation < self._fs.gen.generation:
                del self._fs.pending_failures[generation]  # a newer plan already replaced it
                self._fs.failures_held.discard(generation)
                continue
            if self.cluster is None:
                return
            try:
                self.cluster.arrive(
                    f"failed-{generation}", self.node_id, self._fs.pending_failures[generation]
                )
            except ClusterUnavailableError as exc:
                if generation not in self._fs.failures_held:
                    self._fs.failures_held.add(generation)
                    log.warning(
                        "failure report of generation %d held until etcd is back: %s",
                        generation,
                        exc,
                    )
                self._etcd_down(exc)
                return
            del self._fs.pending_failures[generation]
            self._fs.failures_held.discard(generation)

    def _follow_generation(self) -> None:
        rec = self._vs.record
        if rec is not None and rec.generation > self.generation:
            self._enter_generation(rec)
        gs = self._fs.gen
        if gs is None:
            return
        if gs.phase is Phase.STOPPING:
            self._stop_old_workers(gs)
        if gs.phase is Phase.MOVING:
            self._move_state(gs)
        if gs.phase is Phase.STARTING:
            self._check_started(gs)
        self._check_halted(gs)
        self._check_finished(gs)
        self._check_phase_deadline(gs)

    def _check_halted(self, gs: _GenState) -> None:
        """A rank's step had a non-finite loss or gradient norm. The workers wrote nothing
        from it on; the job holds at the last finite state instead of replicating poison to
        every copy or re-planning into the same step again."""
        message = self.pool.halted(gs.generation)
        if message is None or gs.phase is Phase.HALTED or not gs.enter(Phase.HALTED):
            return
        self.metrics.halted.labels(**self.metrics.labels).set(1)
        own = self.store.committed_steps(self.node_id)
        newest = f"step {own[-1]}" if own else "none"
        with contextlib.suppress(ClusterUnavailableError):
            self._record_halt(message)  # held and retried by the loop
        self._event(
            "decision",
            f"training halted: {message}. Nothing after the last finite state "
            f"is committed (the newest committed step here: {newest}); fix the job (learning "
            "rate, data) and start it again from that step",
        )

    def _check_finished(self, gs: _GenState) -> None:
        """Every rank of this node trained the job's last step."""
        mine = {s.rank for s in gs.plan.ranks_on(self.node_id)}
        if not mine or not mine <= self.pool.done_ranks(gs.generation):
            return
        if gs.phase is Phase.DONE or not gs.enter(Phase.DONE):
            return  # e.g. halted: the halt, not a finish, is this job's end
        assert self.cluster is not None
        self.cluster.arrive(
            "done", self.node_id, {"step": self.spec.steps, "at": self._clock.time()}
        )
        self._event("decision", f"job finished all {self.spec.steps} steps")

    def _check_phase_deadline(self, gs: _GenState) -> None:
        """Every phase that waits on someone else has a deadline; past it, the agent reports
        the generation failed so that the leader re-plans, instead of waiting for good."""
        progress = gs.fetch_progress
        if (
            gs.phase is Phase.MOVING
            and gs.fetch is not None
            and not gs.fetch.done()
            and (progress is None or progress.idle_s(time.monotonic()) <= FETCH_STALL_S)
        ):
            # Held only while bytes arrive: a stalled or trickling fetch runs out of time.
            gs.phase_since_s = self._clock.monotonic()
            return
        deadline = gs.overdue(self._clock.monotonic(), self.spec.hang_timeout_s)
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
        try:
            plan = Plan.from_dict(rec.plan)
        except (ElasticppError, KeyError, TypeError, ValueError) as exc:
            # A plan this build cannot read (a newer leader in a rolling upgrade): following
            # a guess could break the fencing. Keep the current generation, count the value.
            assert self.cluster is not None
            self.cluster.skip_value(self.cluster.keys.generation, exc)
            return
        old = self._fs.gen
        now = self._clock.monotonic()
        self._fs.gen = _GenState(
            rec, phase_since_s=now, stop_began_s=now, clock=self._clock.monotonic
        )
        # Detection times of generations up to this one are of no use now (the leader drops
        # them when it writes a generation; every agent drops them here).
        for g in [g for g in self._fs.detected if g <= rec.generation]:
            del self._fs.detected[g]
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
        return self.pool.older_than(gs.generation)

    def _stop_old_workers(self, gs: _GenState) -> None:
        old = [w for w in self._old_workers(gs) if w.proc.alive()]
        active = [
            w
            for w in old
            if w.state in (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.STOPPING)
        ]
        if gs.graceful and active and not gs.stop_sent:
            for w in active:
                self.pool.ask_stop(w)
            gs.stop_sent = True
        elif (not gs.graceful or self._clock.monotonic() - gs.stop_began_s > STOP_GRACE_S) and old:
            if gs.killed_at_s is None:
                gs.killed_at_s = self._clock.monotonic()
            for w in old:
                self.pool.kill_worker(w)  # never blocks the loop on a process that will not go
        alive = [w for w in self._old_workers(gs) if w.proc.alive()]
        if alive:
            stuck_s = self._clock.monotonic() - (gs.killed_at_s or self._clock.monotonic())
            if stuck_s > self.spec.stop_timeout_s:
                pids = ", ".join(str(w.proc.pid) for w in alive)
                self._report_failure(
                    gs.generation,
                    f"old worker(s) {pids} still alive {stuck_s:.0f} s after SIGKILL "
                    "(uninterruptible sleep: a driver or file system hang?); this node "
                    "cannot take ranks until they are gone",
                    culprit=True,
                    severe=True,
                )
                gs.enter(Phase.FAILED)
            return
        self._drain_worker_events()
        # Old workers are gone: no one reads an older generation's resume directory now.
        self._clean_resume(gs.generation)
        # Exits are processed; old workers are gone. Report what this node holds.
        assert self.cluster is not None
        holdings = self.store.holdings()
        self.cluster.arrive(
            f"stopped-{gs.generation}",
            self.node_id,
            {
                "holdings": holdings.to_dict(),
                "next_step": self._ds.next_step_committed,
                "at": self._clock.time(),
            },
        )
        gs.enter(Phase.MOVING)
        log.info("generation %d: old workers stopped; holdings reported", gs.generation)

    def _move_state(self, gs: _GenState) -> None:
        # Whoever leads now may have written it (a leader elected mid-transition takes over
        # the one written by the leader of the record, or writes it if none exists).
        resume = self._vs.barriers.get(f"resume-{gs.generation}", {}).get(RESUME_MEMBER)
        if resume is None:
            return
        plan = gs.plan
        mine = plan.ranks_on(self.node_id)
        if not mine:
            gs.enter(Phase.IDLE)
            self._event("decision", f"generation {gs.generation}: no ranks on this node (spare)")
            self._arrive_started(gs, moved_s=0.0)
            return
        if gs.fetch is None:
            gs.resume = resume
            gs.fetch_progress = TransferProgress()
            gs.fetch = run_in_thread(
                "fetch-state",
                self._fetch,
                gs,
                resume,
                gs.fetch_progress,
                self._fetch_addresses(gs),
            )
            return
        if not gs.fetch.done():
            return
        outcome = gs.fetch.result()
        gs.fetch_done_at = outcome.done_at
        if outcome.error is not None:
            self._event(
                "decision", f"generation {gs.generation}: state fetch failed: {outcome.error}"
            )
            # This node's own disk (full, read-only, failing) cannot hold its state: it is
            # the cause, and a re-plan onto it would fail the same way.
            self._report_failure(
                gs.generation,
                f"state fetch failed: {outcome.error}",
                culprit=outcome.disk_error,
                severe=outcome.disk_error,
            )
            gs.enter(Phase.FAILED)
            # No worker was given it and the fetch is over: what it fetched is of no use.
            shutil.rmtree(self._resume_dir(gs), ignore_errors=True)
            return
        workers = self._take_warm(len(mine))
        if workers is None:
            if self.pool.replaced_since(gs.stop_began_s):
                # A spare this node needs did not become ready within ready_timeout_s.
                self._report_failure(
                    gs.generation,
                    f"warm worker(s) not ready within {self.spec.ready_timeout_s:.0f} s "
                    "(replaced, but this node's ranks cannot start)",
                    culprit=True,
                    severe=True,
                )
                gs.enter(Phase.FAILED)
            return  # warm workers still importing torch
        try:
            self._assign(gs, resume, mine, workers)
        except (ElasticppError, ValueError, KeyError, TypeError) as exc:
            # All or nothing: no rank of this generation runs here, so a re-plan never meets
            # a rank started twice (before, a part-way failure left some ranks assigned and
            # the next tick assigned them again with fresh spares).
            self._report_failure(gs.generation, f"ranks could not be handed to workers: {exc}")
            gs.enter(Phase.FAILED)
            return
        gs.enter(Phase.STARTING)  # the pool is refilled once they run (_refill_warm)

    def _assign(
        self, gs: _GenState, resume: dict[str, Any], mine: list[Any], workers: list[WorkerProcess]
    ) -> None:
        """Hand this node's ranks to `workers`, all or none: every assignment is built
        before the first is sent; if one cannot be sent (its spare died in the meantime),
        the workers already assigned are killed and the untouched ones go back to the pool."""
        step = int(resume["step"])
        host, _, port = (gs.record.store_address or "").rpartition(":")
        if not host or not port.isdigit():
            self.pool.give_back(workers)
            raise ConfigError(
                f"generation {gs.generation}: no rendezvous store address in the record "
                f"({gs.record.store_address!r})"
            )
        job = self.spec.train_config().to_dict()
        assignments = []
        for slot in mine:
            assignments.append(
                {
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
                    "gpu_index": self._ss.gpus[slot.local_rank]
                    if self.cfg.device == "cuda"
                    else None,
                }
            )
        sent: list[WorkerProcess] = []
        try:
            for slot, proc, assignment in zip(mine, workers, assignments, strict=True):
                sent.append(proc)
                proc.assign(assignment)
                self.pool.add_worker(
                    _Worker(proc=proc, rank=slot.rank, generation=gs.generation, plan=gs.plan)
                )
        except Exception:
            for proc in sent:
                self.pool.abandon(proc)
            self.pool.give_back(p for p in workers if p not in sent)
            raise
        self._event(
            "decision",
            f"generation {gs.generation}: started ranks {[s.rank for s in mine]} at step {step}",
        )

    def _check_started(self, gs: _GenState) -> None:
        mine = self.pool.of_generation(gs.generation)
        if mine and all(w.state is not WorkerState.STARTING for w in mine):
            moved = gs.fetch_done_at or self._clock.time()
            self._arrive_started(gs, moved_s=moved)
            gs.enter(Phase.RUNNING)
            self._clean_local(gs.generation)

    def _arrive_started(self, gs: _GenState, moved_s: float) -> None:
        assert self.cluster is not None
        self.cluster.arrive(
            f"started-{gs.generation}",
            self.node_id,
            {"moved_at": moved_s, "at": self._clock.time()},
        )
