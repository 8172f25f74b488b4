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
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elasticpp.agent.actions import AssignRanks
from elasticpp.agent.decide import WorkerState
from elasticpp.agent.limits import (
    FETCH_MIN_BYTES_PER_S,
    FETCH_PARALLEL,
    FETCH_PER_SOURCE,
    FETCH_STALL_S,
    WORKER_LOGS_KEPT,
)
from elasticpp.agent.phases import (
    STEPS_PER_TICK,
    AssignOutcome,
    FetchOutcome,
    FetchStatus,
    FollowerObservation,
    FollowerState,
    OldWorker,
    _GenState,
    fetch_addresses,
    follower_step,
    is_disk_error,
)
from elasticpp.agent.pool import _Worker
from elasticpp.checkpoint.manifest import step_dirname
from elasticpp.cluster.arrivals import RESUME_MEMBER
from elasticpp.cluster.barriers import RESUME_WAIT_MEMBER
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.errors import ConfigError, ElasticppError, StateUnavailableError
from elasticpp.store.client import StateClient
from elasticpp.store.holdings import DISK_SOURCE
from elasticpp.store.instruction import node_fetches
from elasticpp.store.persist import copy_verified
from elasticpp.store.resume import PieceTransfer, TransferProgress, fetch_pieces
from elasticpp.train.procs import WorkerProcess

log = logging.getLogger("elasticpp.agent")

_RESUME_DIR = re.compile(r"gen-([0-9]{1,19})")  # resume/gen-<G>, see _resume_dir

__all__ = ["FollowerPart", "FollowerState", "_GenState"]


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

    def _init_path(self) -> str | None:
        return None if self._init_dir is None else str(self._init_dir)

    def _resume_dir(self, gs: _GenState) -> Path:
        return self.cfg.state_dir / "resume" / f"gen-{gs.generation:06d}"

    def _fetch_addresses(self, gs: _GenState, sources: Iterable[str]) -> dict[str, str]:
        return fetch_addresses(gs.record, self.view.member_records(sources))

    def _fetch(
        self,
        gs: _GenState,
        resume: dict[str, Any],
        progress: TransferProgress | None = None,
        addresses: dict[str, str] | None = None,
    ) -> FetchOutcome:
        """Fetch this node's state of generation `gs` into its resume directory. Runs on a
        thread of its own: it writes nothing of the agent's; its outcome is returned (to the
        loop, through a future) and its bytes are counted in `progress`."""
        progress = progress if progress is not None else TransferProgress()
        try:
            step = int(resume["step"])
            target = self._resume_dir(gs)
            target.mkdir(parents=True, exist_ok=True)
            plan = gs.plan
            # Piece names are built from the plan, node names checked: nothing from etcd
            # becomes a path unchecked.
            wanted = {
                f.piece_name: (f.origin_node, f.source_node, f.sha256, f.size)
                for f in node_fetches(resume, plan, self.node_id)
            }
            local = [(o, step, n) for n, (o, src, _, _) in wanted.items() if src == self.node_id]
            self.store.materialize(target, local)
            for name, (_o, source, sha, size) in sorted(wanted.items()):
                if source == DISK_SOURCE:  # the persistent checkpoint, for whole-cluster loss
                    assert self.spec.persist_dir is not None
                    src = Path(self.spec.persist_dir) / step_dirname(step) / name
                    copy_verified(src, target / name, sha, size)
                    progress.add(size)
            transfers = [
                PieceTransfer(name, origin, source, sha, size)
                for name, (origin, source, sha, size) in sorted(wanted.items())
                if source not in (self.node_id, DISK_SOURCE)
            ]
            if addresses is None:  # a follower reads its sources' member keys here
                addresses = self._fetch_addresses(gs, {t.source for t in transfers})
            unknown = sorted({t.source for t in transfers} - set(addresses))
            if unknown:
                raise StateUnavailableError(
                    f"generation {gs.generation}: no address of source(s) {', '.join(unknown)} "
                    "(not registered, or registered again under another incarnation)"
                )
            # In parallel with bounds; stalled transfers fail (the follower's MOVING clock
            # is held only while bytes arrive: gs.fetch_progress).
            fetch_pieces(
                transfers,
                target,
                addresses,
                step,
                gs.generation,
                per_source=FETCH_PER_SOURCE,
                parallel=FETCH_PARALLEL,
                progress=progress,
                stall_s=FETCH_STALL_S,
                min_bytes_per_s=FETCH_MIN_BYTES_PER_S,
                client_factory=lambda address: StateClient(
                    address, timeout_s=60, dialer=self._dialer
                ),
                epoch=self.store.epoch,
            )
            return FetchOutcome(done_at=self._clock.time())
        except Exception as exc:  # reported to the loop, which reports it to the leader
            return FetchOutcome(error=f"{type(exc).__name__}: {exc}", disk_error=is_disk_error(exc))

    def _clean_resume(self, generation: int) -> None:
        """Delete the resume directories of generations older than `generation`: called once
        this node's workers of those generations are gone (no reader is left), so a re-plan
        storm leaves at most the directory of the generation that runs and of one that
        failed, not one with fetched bytes per failed generation. Numbers compare as
        integers: `gen-%06d` names sort wrongly from generation 1,000,000 on."""
        resume_root = self.cfg.state_dir / "resume"
        if not resume_root.is_dir():
            return
        for d in resume_root.iterdir():
            m = _RESUME_DIR.fullmatch(d.name)
            if m is not None and int(m.group(1)) < generation:
                shutil.rmtree(d, ignore_errors=True)

    def _clean_local(self, generation: int) -> None:
        """Bounded disk use for weeks of uptime: resume directories of older generations
        (their workers are gone) and all but the newest worker logs."""
        self._clean_resume(generation)
        if self.log_dir.is_dir():
            logs = sorted(self.log_dir.glob("*.log"), key=lambda p: p.stat().st_mtime)
            for old in logs[:-WORKER_LOGS_KEPT]:
                old.unlink(missing_ok=True)
