"""The follower part of the agent: this node's way through each plan generation.

Phases (`decide.Phase`, transitions written down there): stopping -> moving -> starting ->
running (or idle for a spare, done at the end, failed). Every phase that waits on someone
else has a deadline (`decide.phase_deadline_s`); past it the node reports the generation
failed so that the leader re-plans. Failure reports are level-triggered: pending until etcd
has them.

The decisions are a pure step (`step.follower_step`, its state `FollowerState` and its
feedback functions, with their invariants); `Follower` is its shell: `step` builds the
observation from the view, the worker pool and the fetch, and hands the step's actions to
the executor, whose handlers (registered here) write the arrivals, fetch this node's
resume state (local pieces linked, remote ones streamed with checksums; piece names from
etcd parsed before use), hand the ranks to warm workers and clean what older generations
left, feeding the outcomes back to the step's functions. It also keeps the pending failure
reports.

It is built with its ports: the job spec, the clock, the journal, the metrics, the etcd
calls it makes (`FollowerCluster`), the view's snapshot and member records, the worker
pool, the supervisor's warm workers and GPUs, the store, the dialer, the worker logs, and
the executor that applies actions. The fetch's future and byte count are its shell's: the
state is plain.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from elasticpp.agent.actions import (
    Action,
    ArriveDone,
    ArriveStarted,
    ArriveStepped,
    ArriveStopped,
    AskStop,
    AssignRanks,
    CleanLocal,
    CleanResume,
    DrainWorkerEvents,
    KillOld,
    RemoveResumeDir,
    ReportFailure,
    SkipRecord,
    StartFetch,
)
from elasticpp.agent.follower.step import (
    STEPS_PER_TICK,
    AssignOutcome,
    FetchOutcome,
    FetchStatus,
    FollowerObservation,
    FollowerState,
    GenerationProgress,
    OldWorker,
    fetch_addresses,
    follower_arrived,
    follower_assigned,
    follower_fetch_started,
    follower_step,
    is_disk_error,
)
from elasticpp.agent.jobspec import JobSpec
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.decide import WorkerState
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.journal import Journal
from elasticpp.agent.kernel.limits import (
    FETCH_MIN_BYTES_PER_S,
    FETCH_PARALLEL,
    FETCH_PER_SOURCE,
    FETCH_STALL_S,
    WORKER_LOGS_KEPT,
)
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.pool import Worker, WorkerPool
from elasticpp.agent.kernel.records import JSONValue, Record, fields, integer
from elasticpp.agent.kernel.summaries import FollowerSummary
from elasticpp.agent.kernel.threads import run_in_thread
from elasticpp.agent.kernel.worklogs import WorkerLogs
from elasticpp.agent.view.step import ViewSnapshot
from elasticpp.checkpoint.manifest import step_dirname
from elasticpp.cluster.barriers import (
    RESUME_MEMBER,
    RESUME_WAIT_MEMBER,
    failed_barrier,
    resume_barrier,
    started_barrier,
    stepped_barrier,
    stopped_barrier,
)
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.keys import JobKeys
from elasticpp.errors import ConfigError, ElasticppError, StateUnavailableError
from elasticpp.plan import WorkerSlot
from elasticpp.store.client import StateClient
from elasticpp.store.digest import digest_of
from elasticpp.store.holdings import DISK_SOURCE
from elasticpp.store.instruction import node_fetches
from elasticpp.store.local import LocalStore
from elasticpp.store.persist import copy_verified
from elasticpp.store.resume import PieceTransfer, TransferProgress, fetch_pieces
from elasticpp.train.worker.assignment import Assignment
from elasticpp.train.worker.procs import WorkerProcess
from elasticpp.transport import Dialer

log = logging.getLogger("elasticpp.agent")

_RESUME_DIR = re.compile(r"gen-([0-9]{1,19})")  # resume/gen-<G>, see resume_dir


class Arriving(Protocol):
    """A node's arrival at a barrier (elasticpp.cluster.arrivals.Arrivals)."""

    def arrive(
        self, barrier: str, node_id: str, value: JSONValue = None, *, lease_id: int | None = None
    ) -> None: ...


class FollowerCluster(Protocol):
    """The etcd calls of the follower (elasticpp.cluster.ClusterClient has them)."""

    @property
    def keys(self) -> JobKeys: ...
    @property
    def arrivals(self) -> Arriving: ...
    def skip_value(self, key: str, exc: Exception) -> None: ...


@dataclass(frozen=True)
class FollowerConfig:
    node_id: str
    state_dir: Path  # resume/ lives here
    log_dir: Path  # the worker logs, bounded here
    backend: str
    device: str
    worker_threads: int | None = None


@dataclass(frozen=True)
class FollowerPorts:
    """What the follower asks of the other parts: the view's snapshot and member records,
    the view told that etcd is down, the supervisor's warm workers, GPUs and worker events,
    this node's address and newest committed step, the initial weights' directory, the
    lease its writes go on, and the executor that applies actions."""

    view: Callable[[], ViewSnapshot]
    member_records: Callable[[Iterable[str]], Mapping[str, Record]]
    etcd_down: Callable[[Exception], None]
    take_warm: Callable[[int], list[WorkerProcess] | None]
    gpus: Callable[[], Sequence[int]]
    drain: Callable[[], None]
    address: Callable[[], str]
    next_step: Callable[[], int]
    init_dir: Callable[[], Path | None]
    member_lease: Callable[[], int | None]
    execute: Callable[[Sequence[Action]], None]


class Follower:
    """The follower part: the phases of each generation, arrivals, fetch, assignment."""

    def __init__(
        self,
        config: FollowerConfig,
        *,
        spec: JobSpec,
        clock: Clock,
        journal: Journal,
        metrics: AgentMetrics,
        cluster: FollowerCluster,
        pool: WorkerPool,
        store: LocalStore,
        dialer: Dialer,
        logs: WorkerLogs,
        ports: FollowerPorts,
        wake: Callable[[], None],
    ) -> None:
        self.config = config
        self.state = FollowerState()
        self._spec = spec
        self._clock = clock
        self._journal = journal
        self._metrics = metrics
        self._cluster = cluster
        self._pool = pool
        self._store = store
        self._dialer = dialer
        self._logs = logs
        self._ports = ports
        self._wake = wake
        self._closed = False
        # The followed generation's fetch: its thread's future and byte count.
        self._fetch: tuple[int, Future[FetchOutcome], TransferProgress] | None = None

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only this part emits."""
        executor.register(ReportFailure, self._report)
        executor.register(SkipRecord, self._skip_record)
        executor.register(AskStop, self._ask_stop)
        executor.register(KillOld, self._kill_old)
        executor.register(DrainWorkerEvents, lambda _: self._ports.drain())
        executor.register(CleanResume, lambda a: self.clean_resume(a.generation))
        executor.register(CleanLocal, lambda a: self.clean_local(a.generation))
        executor.register(RemoveResumeDir, self._remove_resume_dir)
        executor.register(ArriveStopped, self._arrive)
        executor.register(ArriveStarted, self._arrive)
        executor.register(ArriveStepped, self._arrive)
        executor.register(ArriveDone, self._arrive)
        executor.register(StartFetch, self._start_fetch)
        executor.register(AssignRanks, self._assign_ranks)

    def close(self) -> None:
        """Write nothing more (the agent's etcd client is closing)."""
        self._closed = True

    @property
    def generation(self) -> int:
        gs = self.state.gen
        return gs.generation if gs else 0

    def summary(self) -> FollowerSummary:
        gs = self.state.gen
        if gs is None:
            return FollowerSummary()
        return FollowerSummary(
            generation=gs.generation,
            record=gs.record,
            plan=gs.plan,
            planned=gs.record.planned_set,
            phase=gs.phase,
            waiting=gs.waiting_said,
        )

    def followed(self) -> GenerationProgress | None:
        """The generation this node follows (the leader's observation reads its record and
        plan; read, never write)."""
        return self.state.gen

    def detected(self) -> Mapping[int, float]:
        """Generation -> the wall time a failure here that calls for it was first seen (the
        recovery timeline's): read-only."""
        return MappingProxyType(self.state.detected)

    def reported_failed(self, generation: int) -> bool:
        """Whether this node reported `generation` failed itself (etcd has it, or it waits)."""
        fs = self.state
        return fs.reported == generation or generation in fs.pending_failures

    def settled(self, current: int) -> bool:
        """No failure report waits for etcd, and none of generation `current` was made."""
        fs = self.state
        return not fs.pending_failures and (current == 0 or fs.reported != current)

    # ------------------------------------------------------------------ failures
    def report_failure(
        self,
        generation: int,
        reason: str,
        followed_a_peer: bool = False,
        *,
        culprit: bool = False,
        severe: bool = False,
    ) -> None:
        """Report generation `generation` failed here. `followed_a_peer`: a worker here
        failed because a peer went away (a victim, blamed only if no report names a cause);
        `culprit`: this node is the cause (its disk, its spares, its workers), not a victim
        of a peer's failure; `severe`: the leader quarantines it at once
        (elasticpp.agent.sick)."""
        self._journal.write("worker", f"failure in generation {generation}: {reason}")
        self._metrics.worker_failures_total.labels(**self._metrics.labels).inc()
        fs = self.state
        fs.detected.setdefault(generation + 1, self._clock.time())
        # Level-triggered: the report stays pending until etcd has it, so a failure seen
        # while etcd is down is published when it returns instead of being lost.
        fs.pending_failures.setdefault(
            generation,
            {
                "reason": reason,
                "at": self._clock.time(),
                "culprit": culprit,
                "severe": severe,
                "peer": followed_a_peer,
            },
        )
        self.publish_failures()

    def _report(self, action: ReportFailure) -> None:
        self.report_failure(
            action.generation, action.reason, culprit=action.culprit, severe=action.severe
        )

    def publish_failures(self) -> None:
        fs = self.state
        for generation in sorted(fs.pending_failures):
            if fs.gen is not None and generation < fs.gen.generation:
                del fs.pending_failures[generation]  # a newer plan already replaced it
                fs.failures_held.discard(generation)
                continue
            if self._closed:
                return
            try:
                self._cluster.arrivals.arrive(
                    failed_barrier(generation),
                    self.config.node_id,
                    fs.pending_failures[generation],
                    lease_id=self._ports.member_lease(),
                )
            except ClusterUnavailableError as exc:
                if generation not in fs.failures_held:
                    fs.failures_held.add(generation)
                    log.warning(
                        "failure report of generation %d held until etcd is back: %s",
                        generation,
                        exc,
                    )
                self._ports.etcd_down(exc)
                return
            del fs.pending_failures[generation]
            fs.failures_held.discard(generation)
            fs.reported = max(fs.reported, generation)

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        """The follower's step on the clock: observe, decide (`follower_step`, pure),
        execute. A step whose actions moved the phase is followed by another on a fresh
        observation, so that a tick goes as far through the phases as it can."""
        for _ in range(STEPS_PER_TICK):
            gs = self.state.gen
            before = (gs.generation, gs.phase) if gs else None
            self._ports.execute(follower_step(self.state, self._observation()))
            gs = self.state.gen
            if gs is None or (gs.generation, gs.phase) == before:
                return

    def _observation(self) -> FollowerObservation:
        """What the follower's step sees, read here, before the step: the view, the worker
        pool (and whether its old processes are alive) and the fetch. Writes, and reads that
        belong to one (the holdings for `stopped-G`), are the handlers'."""
        now_s, wall_s = self._clock.monotonic(), self._clock.time()
        view, spec, pool = self._ports.view(), self._spec, self._pool
        rec = view.record
        record = rec if rec is not None and rec.generation > self.generation else None
        plan, plan_error = None, None
        if record is not None:
            try:
                # The model is this node's job spec's, never the record's: a record made for
                # another model is skipped and counted, and nothing it names is built.
                plan = spec.plan_of(record.plan)
            except (ElasticppError, KeyError, TypeError, ValueError) as exc:
                plan_error = str(exc)
        gs = self.state.gen
        if gs is None or (record is not None and plan is not None):
            # The step enters the new generation first.
            return FollowerObservation(now_s, wall_s, self.config.node_id, record, plan, plan_error)
        g = gs.generation
        mine = pool.of_generation(g)
        active = (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.STOPPING)
        resume = view.barriers.get(resume_barrier(g), {})
        # One construction (a copy with `dataclasses.replace` cost ~30 us a step).
        return FollowerObservation(
            now_s,
            wall_s,
            self.config.node_id,
            record,
            plan,
            plan_error,
            old_workers=tuple(
                OldWorker(w.proc.pid, w.proc.alive(), w.state in active) for w in pool.older_than(g)
            ),
            resume=_instruction(resume.get(RESUME_MEMBER)),
            resume_wait=str(fields(resume.get(RESUME_WAIT_MEMBER)).get("why", "")) or None,
            fetch=self._fetch_status(g),
            ready_spares=pool.ready_spares(),
            spare_replaced=pool.replaced_since(gs.stop_began_s) > 0,
            all_started=bool(mine) and all(w.state is not WorkerState.STARTING for w in mine),
            stepped=min((w.last_step for w in mine), default=-1),
            halted=pool.halted(g),
            done_ranks=pool.done_ranks(g),
            steps=spec.steps,
            hang_timeout_s=spec.hang_timeout_s,
            stop_timeout_s=spec.stop_timeout_s,
            ready_timeout_s=spec.ready_timeout_s,
        )

    def _fetch_status(self, generation: int) -> FetchStatus:
        fetch = self._fetch
        if fetch is None or fetch[0] != generation:
            return FetchStatus()
        _, future, progress = fetch
        if future.done():
            return FetchStatus(started=True, outcome=future.result())
        # On the real clock on purpose: the fetch's thread times its bytes on it.
        return FetchStatus(started=True, idle_s=progress.idle_s(time.monotonic()))

    # ------------------------------------------------------------------ the handlers
    def _skip_record(self, action: SkipRecord) -> None:
        self._cluster.skip_value(self._cluster.keys.generation, ValueError(action.error))

    def _ask_stop(self, action: AskStop) -> None:
        for pid in action.pids:
            w = self._pool.worker(pid)
            if w is not None:
                self._pool.ask_stop(w)

    def _kill_old(self, action: KillOld) -> None:
        for pid in action.pids:
            w = self._pool.worker(pid)
            if w is not None:
                self._pool.kill_worker(w)  # never blocks on a process that will not go

    def _remove_resume_dir(self, action: RemoveResumeDir) -> None:
        gs = self.state.gen
        if gs is not None and gs.generation == action.generation:
            shutil.rmtree(self.resume_dir(gs), ignore_errors=True)

    def _arrive(self, action: ArriveStopped | ArriveStarted | ArriveStepped | ArriveDone) -> None:
        """Write a follower's arrival and feed the result back; a write etcd refuses leaves
        the phase as it was (the error still ends the tick's etcd half)."""
        value: dict[str, JSONValue]
        if isinstance(action, ArriveStopped):
            # Read now, after the old workers' events were drained: what this node holds,
            # as a digest; the leader pulls the detail it needs from this node's server.
            barrier, value = (
                stopped_barrier(action.generation),
                {
                    "digest": digest_of(self._store.holdings(), self._ports.address()).to_dict(),
                    "next_step": self._ports.next_step(),
                    "at": action.at_s,
                },
            )
        elif isinstance(action, ArriveStarted):
            barrier = started_barrier(action.generation)
            value = {"moved_at": action.moved_s, "at": action.at_s}
        elif isinstance(action, ArriveStepped):
            barrier = stepped_barrier(action.generation)
            value = {"step": action.step, "at": action.at_s}
        else:
            barrier, value = "done", {"step": action.step, "at": action.at_s}
        execute, now = self._ports.execute, self._clock.monotonic
        try:
            self._cluster.arrivals.arrive(
                barrier, self.config.node_id, value, lease_id=self._ports.member_lease()
            )
        except ClusterUnavailableError:
            execute(follower_arrived(self.state, action, False, now()))
            raise
        execute(follower_arrived(self.state, action, True, now()))

    def _start_fetch(self, action: StartFetch) -> None:
        if not follower_fetch_started(self.state, action):
            return
        gs = self.state.gen
        assert gs is not None
        progress = TransferProgress()
        args = (gs, action.resume, progress)  # addresses: read on its thread
        future: Future[FetchOutcome] = run_in_thread("fetch-state", self.fetch, *args)
        future.add_done_callback(lambda _: self._wake())
        self.track_fetch(gs.generation, future, progress)

    def track_fetch(
        self, generation: int, future: Future[FetchOutcome], progress: TransferProgress
    ) -> None:
        """The fetch of `generation` runs: its outcome comes through `future`, its bytes
        through `progress` (what the step sees of it, `FetchStatus`)."""
        self._fetch = (generation, future, progress)

    def fetch_in_flight(self) -> tuple[int, Future[FetchOutcome], TransferProgress] | None:
        """The newest fetch started (its generation, future and byte count), if any."""
        return self._fetch

    def _assign_ranks(self, action: AssignRanks) -> list[Action]:
        outcome = self._take_and_assign(action)
        return follower_assigned(self.state, action, outcome, self._clock.monotonic())

    def _take_and_assign(self, action: AssignRanks) -> AssignOutcome:
        """Take ready spares and hand them the ranks."""
        gs = self.state.gen
        if gs is None or gs.generation != action.generation:
            return AssignOutcome(assigned=False)
        mine = gs.plan.ranks_on(self.config.node_id)
        workers = self._ports.take_warm(len(mine))
        if workers is None:
            return AssignOutcome(assigned=False)
        try:
            self.assign(gs, action.resume, mine, workers)
        except (ElasticppError, ValueError, KeyError, TypeError) as exc:
            # All or nothing: no rank of this generation runs here (before, a part-way
            # failure left some ranks assigned and the next tick assigned them again).
            return AssignOutcome(assigned=False, error=str(exc))
        return AssignOutcome(assigned=True)

    def assign(
        self,
        gs: GenerationProgress,
        resume: Record,
        mine: list[WorkerSlot],
        workers: list[WorkerProcess],
    ) -> None:
        """Hand this node's ranks to `workers`, all or none: every assignment is built
        before the first is sent; if one cannot be sent (its spare died in the meantime),
        the workers already assigned are killed and the untouched ones go back to the pool."""
        cfg, spec, pool = self.config, self._spec, self._pool
        step = integer(resume, "step")
        host, _, port = (gs.record.store_address or "").rpartition(":")
        if not host or not port.isdigit():
            pool.give_back(workers)
            raise ConfigError(
                f"generation {gs.generation}: no rendezvous store address in the record "
                f"({gs.record.store_address!r})"
            )
        gpus = self._ports.gpus()
        init_dir = self._ports.init_dir()
        start_dir = self.resume_dir(gs) if step > 0 else init_dir
        try:
            assignments = [
                Assignment(
                    plan=gs.plan,  # the model of this node's spec (`JobSpec.plan_of`)
                    rank=slot.rank,
                    store_host=host,
                    store_port=int(port),
                    store_prefix=gs.record.rendezvous_prefix,
                    job=spec.worker_train,
                    start_step=step,
                    resume_dir=None if start_dir is None else str(start_dir),
                    snapshot_dir=str(self._store.snapshot_dir(gs.generation)),
                    **spec.worker_snapshots(),
                    snapshot_when_busy=spec.snapshot_when_busy,
                    backend=cfg.backend,
                    device=cfg.device,
                    num_threads=cfg.worker_threads,
                    gpu_index=gpus[slot.local_rank] if cfg.device == "cuda" else None,
                ).to_dict()
                for slot in mine
            ]
        except Exception:
            pool.give_back(workers)  # none was sent one
            raise
        sent: list[WorkerProcess] = []
        try:
            for slot, proc, assignment in zip(mine, workers, assignments, strict=True):
                sent.append(proc)
                proc.assign(assignment)
                log_path = getattr(proc, "log_path", None)  # a simulated worker has none
                if log_path is not None:
                    self._logs.follow(log_path, gs.generation, slot.rank)
                pool.add_worker(
                    Worker(proc=proc, rank=slot.rank, generation=gs.generation, plan=gs.plan)
                )
        except Exception:
            for proc in sent:
                pool.abandon(proc)
            pool.give_back(p for p in workers if p not in sent)
            raise
        self._journal.write(
            "decision",
            f"generation {gs.generation}: started ranks {[s.rank for s in mine]} at step {step}",
        )

    # ------------------------------------------------------------------ resume state
    def resume_dir(self, gs: GenerationProgress) -> Path:
        return self.config.state_dir / "resume" / f"gen-{gs.generation:06d}"

    def fetch(
        self,
        gs: GenerationProgress,
        resume: Record,
        progress: TransferProgress | None = None,
        addresses: dict[str, str] | None = None,
    ) -> FetchOutcome:
        """Fetch this node's state of generation `gs` into its resume directory. Runs on a
        thread of its own: it writes nothing of the part's state; its outcome is returned
        (to the loop, through a future) and its bytes are counted in `progress`."""
        progress = progress if progress is not None else TransferProgress()
        node_id, spec, store = self.config.node_id, self._spec, self._store
        try:
            step = integer(resume, "step")
            target = self.resume_dir(gs)
            target.mkdir(parents=True, exist_ok=True)
            plan = gs.plan
            # Piece names are built from the plan, node names checked: nothing from etcd
            # becomes a path unchecked.
            wanted = {
                f.piece_name: (f.origin_node, f.source_node, f.sha256, f.size)
                for f in node_fetches(resume, plan, node_id)
            }
            local = [(o, step, n) for n, (o, src, _, _) in wanted.items() if src == node_id]
            store.materialize(target, local)
            for name, (_o, source, sha, size) in sorted(wanted.items()):
                if source == DISK_SOURCE:  # the persistent checkpoint, for whole-cluster loss
                    assert spec.persist_dir is not None
                    src = Path(spec.persist_dir) / step_dirname(step) / name
                    copy_verified(src, target / name, sha, size)
                    progress.add(size)
            transfers = [
                PieceTransfer(name, origin, source, sha, size)
                for name, (origin, source, sha, size) in sorted(wanted.items())
                if source not in (node_id, DISK_SOURCE)
            ]
            if addresses is None:  # a follower reads its sources' member keys here
                sources = {t.source for t in transfers}
                addresses = fetch_addresses(gs.record, self._ports.member_records(sources))
            unknown = sorted({t.source for t in transfers} - set(addresses))
            if unknown:
                raise StateUnavailableError(
                    f"generation {gs.generation}: no address of source(s) {', '.join(unknown)} "
                    "(not registered, or registered again under another incarnation)"
                )
            # In parallel with bounds; stalled transfers fail (the follower's MOVING clock
            # is held only while bytes arrive: the fetch's progress).
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
                epoch=store.epoch,
            )
            return FetchOutcome(done_at=self._clock.time())
        except Exception as exc:  # reported to the loop, which reports it to the leader
            return FetchOutcome(error=f"{type(exc).__name__}: {exc}", disk_error=is_disk_error(exc))

    def clean_resume(self, generation: int) -> None:
        """Delete the resume directories of generations older than `generation`: called once
        this node's workers of those generations are gone (no reader is left), so a re-plan
        storm leaves at most the directory of the generation that runs and of one that
        failed, not one with fetched bytes per failed generation. Numbers compare as
        integers: `gen-%06d` names sort wrongly from generation 1,000,000 on."""
        resume_root = self.config.state_dir / "resume"
        if not resume_root.is_dir():
            return
        for d in resume_root.iterdir():
            m = _RESUME_DIR.fullmatch(d.name)
            if m is not None and int(m.group(1)) < generation:
                shutil.rmtree(d, ignore_errors=True)

    def clean_local(self, generation: int) -> None:
        """Bounded disk use for weeks of uptime: resume directories of older generations
        (their workers are gone) and all but the newest worker logs."""
        self.clean_resume(generation)
        log_dir = self.config.log_dir
        if log_dir.is_dir():
            logs = sorted(log_dir.glob("*.log"), key=lambda p: p.stat().st_mtime)
            for old in logs[:-WORKER_LOGS_KEPT]:
                old.unlink(missing_ok=True)


def _instruction(value: JSONValue) -> dict[str, JSONValue] | None:
    """The resume instruction as the barrier holds it: an object (checked at its read,
    `cluster.barriers.check_arrival`), or none yet."""
    return value if isinstance(value, dict) else None
