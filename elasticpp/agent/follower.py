"""The follower part of the agent: this node's way through each plan generation.

Phases (`decide.Phase`, transitions written down there): stopping -> moving -> starting ->
running (or idle for a spare, done at the end, failed). Every phase that waits on someone
else has a deadline (`decide.phase_deadline_s`); past it the node reports the generation
failed so that the leader re-plans. Failure reports are level-triggered: pending until etcd
has them.

The decisions are a pure step (`phases.follower_step`, its state `FollowerState` and its
feedback functions, with their invariants); this module is its shell: `_follow_generation`
builds the observation from the view, the worker pool and the fetch's future, and hands
the step's actions to the executor, which feeds the results of arrivals, the fetch and the
assignment back to the step's functions. It also keeps the pending failure reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from elasticpp.agent.actions import AssignRanks
from elasticpp.agent.decide import WorkerState
from elasticpp.agent.phases import (
    STEPS_PER_TICK,
    AssignOutcome,
    FetchStatus,
    FollowerObservation,
    FollowerState,
    OldWorker,
    _GenState,
    follower_step,
)
from elasticpp.agent.pool import _Worker
from elasticpp.cluster.arrivals import RESUME_MEMBER
from elasticpp.cluster.barriers import RESUME_WAIT_MEMBER
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.errors import ConfigError, ElasticppError
from elasticpp.train.procs import WorkerProcess

log = logging.getLogger("elasticpp.agent")

__all__ = ["FollowerPart", "FollowerState", "_GenState", "run_in_thread"]


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


class FollowerPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _report_failure(
        self, generation: int, reason: str, *, culprit: bool = False, severe: bool = False
    ) -> None:
        """Report generation `generation` failed here. `culprit`: this node is the cause (its
        disk, its spares, its workers), not a victim of a peer's failure; `severe`: the
        leader quarantines it at once (elasticpp.agent.sick)."""
        self.journal.write("worker", f"failure in generation {generation}: {reason}")
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
            if self._closed:
                return
            try:
                self.cluster.arrive(
                    f"failed-{generation}",
                    self.node_id,
                    self._fs.pending_failures[generation],
                    lease_id=self._member_lease(),
                )
            except ClusterUnavailableError as exc:
                if generation not in self._fs.failures_held:
                    self._fs.failures_held.add(generation)
                    log.warning(
                        "failure report of generation %d held until etcd is back: %s",
                        generation,
                        exc,
                    )
                self._execute(self.view.etcd_down(exc))
                return
            del self._fs.pending_failures[generation]
            self._fs.failures_held.discard(generation)
            self._fs.reported = max(self._fs.reported, generation)

    def _follow_generation(self) -> None:
        """The follower's step on the clock: observe, decide (`follower_step`, pure),
        execute. A step whose actions moved the phase is followed by another on a fresh
        observation, so that a tick goes as far through the phases as it can."""
        for _ in range(STEPS_PER_TICK):
            gs = self._fs.gen
            before = (gs.generation, gs.phase) if gs else None
            self._execute(follower_step(self._fs, self._follower_observation()))
            gs = self._fs.gen
            if gs is None or (gs.generation, gs.phase) == before:
                return

    def _follower_observation(self) -> FollowerObservation:
        """What the follower's step sees, read here, before the step: the view, the worker
        pool (and whether its old processes are alive) and the fetch's future. Writes, and
        reads that belong to one (the holdings for `stopped-G`), are the executor's."""
        now_s, wall_s = self._clock.monotonic(), self._clock.time()
        rec = self.view.snapshot.record
        record = rec if rec is not None and rec.generation > self.generation else None
        plan, plan_error = None, None
        if record is not None:
            try:
                # The model is this node's job spec's, never the record's: a record made for
                # another model is skipped and counted, and nothing it names is built.
                plan = self.spec.plan_of(record.plan)
            except (ElasticppError, KeyError, TypeError, ValueError) as exc:
                plan_error = str(exc)
        gs = self._fs.gen
        seen: dict[str, Any] = {
            "now_s": now_s,
            "wall_s": wall_s,
            "node_id": self.node_id,
            "record": record,
            "plan": plan,
            "plan_error": plan_error,
        }
        if gs is None or (record is not None and plan is not None):
            return FollowerObservation(**seen)  # the step enters the new generation first
        g = gs.generation
        mine = self.pool.of_generation(g)
        active = (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.STOPPING)
        resume = self.view.snapshot.barriers.get(f"resume-{g}", {})
        # One construction (a copy with `dataclasses.replace` cost ~30 us a step).
        return FollowerObservation(
            **seen,
            old_workers=tuple(
                OldWorker(w.proc.pid, w.proc.alive(), w.state in active)
                for w in self.pool.older_than(g)
            ),
            resume=resume.get(RESUME_MEMBER),
            resume_wait=str((resume.get(RESUME_WAIT_MEMBER) or {}).get("why", "")) or None,
            fetch=self._fetch_status(gs),
            ready_spares=self.pool.ready_spares(),
            spare_replaced=self.pool.replaced_since(gs.stop_began_s) > 0,
            all_started=bool(mine) and all(w.state is not WorkerState.STARTING for w in mine),
            halted=self.pool.halted(g),
            done_ranks=self.pool.done_ranks(g),
            steps=self.spec.steps,
            hang_timeout_s=self.spec.hang_timeout_s,
            stop_timeout_s=self.spec.stop_timeout_s,
            ready_timeout_s=self.spec.ready_timeout_s,
        )

    def _fetch_status(self, gs: _GenState) -> FetchStatus:
        if gs.fetch is None:
            return FetchStatus()
        if gs.fetch.done():
            return FetchStatus(started=True, outcome=gs.fetch.result())
        progress = gs.fetch_progress
        # On the real clock on purpose: the fetch's thread times its bytes on it.
        idle_s = None if progress is None else progress.idle_s(time.monotonic())
        return FetchStatus(started=True, idle_s=idle_s)

    def _assign_ranks(self, action: AssignRanks) -> AssignOutcome:
        """The executor's part of AssignRanks: take ready spares and hand them the ranks."""
        gs = self._fs.gen
        if gs is None or gs.generation != action.generation:
            return AssignOutcome(assigned=False)
        mine = gs.plan.ranks_on(self.node_id)
        workers = self.supervisor.take_warm(len(mine))
        if workers is None:
            return AssignOutcome(assigned=False)
        try:
            self._assign(gs, action.resume, mine, workers)
        except (ElasticppError, ValueError, KeyError, TypeError) as exc:
            # All or nothing: no rank of this generation runs here (before, a part-way
            # failure left some ranks assigned and the next tick assigned them again).
            return AssignOutcome(assigned=False, error=str(exc))
        return AssignOutcome(assigned=True)

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
        job = self.spec.worker_settings
        plan = gs.plan.shared_dict  # the model of this node's spec (`JobSpec.plan_of`)
        assignments = []
        for slot in mine:
            assignments.append(
                {
                    "format_version": 1,
                    "plan": plan,
                    "rank": slot.rank,
                    "store_host": host,
                    "store_port": int(port),
                    "store_prefix": gs.record.rendezvous_prefix,
                    "job": job,
                    "start_step": step,
                    "resume_dir": str(self._resume_dir(gs)) if step > 0 else self._init_path(),
                    "snapshot_dir": str(self.store.snapshot_dir(gs.generation)),
                    **self.spec.worker_snapshots(),
                    "snapshot_when_busy": self.spec.snapshot_when_busy,
                    "backend": self.cfg.backend,
                    "device": self.cfg.device,
                    "num_threads": self.cfg.worker_threads,
                    "gpu_index": self.supervisor.gpus[slot.local_rank]
                    if self.cfg.device == "cuda"
                    else None,
                }
            )
        sent: list[WorkerProcess] = []
        try:
            for slot, proc, assignment in zip(mine, workers, assignments, strict=True):
                sent.append(proc)
                proc.assign(assignment)
                log_path = getattr(proc, "log_path", None)  # a simulated worker has none
                if log_path is not None:
                    self.worker_logs.follow(log_path, gs.generation, slot.rank)
                self.pool.add_worker(
                    _Worker(proc=proc, rank=slot.rank, generation=gs.generation, plan=gs.plan)
                )
        except Exception:
            for proc in sent:
                self.pool.abandon(proc)
            self.pool.give_back(p for p in workers if p not in sent)
            raise
        self.journal.write(
            "decision",
            f"generation {gs.generation}: started ranks {[s.rank for s in mine]} at step {step}",
        )
