"""The durability part of the agent: what the workers hand over becomes committed state.

Steps are committed by (generation, step) into the node's `LocalStore` (a committed piece is
never rewritten), reported in the node's commit record with the anchor steps it holds (own
and replicas: the leader's safe step is computed from them), replicated to ring peers and
persisted to the checkpoint directory off the training path. An agent whose membership
lease may have lapsed commits nothing (self-fencing). metrics.jsonl is rotated.

The worker events it handles are pure steps (`step`): `Durability` only observes (the
event, this node's snapshot writers of the worker's plan, whether it is fenced, the job's
numbers, wall time) and returns the step's actions; the handlers it registers on the
executor record pieces, commit, drop a fenced node's old snapshots, write metrics, and start
the commit record, replication rounds and persistence, feeding the outcomes back to the
step's functions. The commit records have one writer (off the loop, paced:
elasticpp.agent.durability.latest); a replication round and the persister run on threads of
their own and hand back through a future, which this shell holds (the state is plain).

It is built with its ports: the store, the clock, the metrics, where commit records go,
the member records (the peers' addresses), the TLS dialer, whether the node is fenced and
the lease its writes go on, and the plan this node follows now.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from elasticpp.agent.actions import (
    Action,
    Commit,
    CountSnapshotFailure,
    DropUncommitted,
    Persist,
    RecordCommit,
    RecordPieces,
    Replicate,
    StepMetrics,
    WriteMetricsLine,
)
from elasticpp.agent.durability.latest import LatestWriter
from elasticpp.agent.durability.step import (
    CommitValue,
    DurabilityState,
    SnapshotFailure,
    SnapshotObservation,
    StepObservation,
    anchors_ran_ahead,
    durability_committed,
    durability_dropped,
    durability_on_snapshot,
    durability_on_snapshot_failed,
    durability_on_step,
    durability_recorded,
)
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.limits import COMMIT_RECORD_EVERY_S, METRICS_ROTATE_BYTES
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.pool import Worker
from elasticpp.agent.kernel.records import JSONValue, Record, integer, number
from elasticpp.agent.kernel.summaries import DurabilitySummary
from elasticpp.agent.kernel.threads import run_in_thread
from elasticpp.errors import CheckpointError
from elasticpp.plan import ModelSpec, Plan
from elasticpp.plan.flops import node_step_flops, slot_peak
from elasticpp.store.client import StateClient
from elasticpp.store.local import LocalStore
from elasticpp.store.persist import Persister
from elasticpp.store.replicate import backup_origins, replicate_once
from elasticpp.train.worker.snapshots import is_snapshot_writer
from elasticpp.transport import Dialer

log = logging.getLogger("elasticpp.agent")


class CommitRecords(Protocol):
    """Where this node's commit records go (elasticpp.cluster.commits.Commits, a
    `ClusterClient`'s `commits`)."""

    def record_commit(
        self,
        generation: int,
        node_id: str,
        step: int,
        anchors: Sequence[int] = (),
        replicas: Mapping[str, Sequence[int]] | None = None,
        *,
        lease_id: int | None = None,
    ) -> None: ...


@dataclass(frozen=True)
class DurabilityConfig:
    node_id: str
    metrics_path: Path  # metrics.jsonl: one line per step
    steps: int  # the job's
    precision: str  # the job's training precision (the slots' peak depends on it)
    peak_tflops: float | None  # the job spec's override of a slot's peak
    replication_copies: int
    replication_every: int
    persist_dir: str | None  # the shared checkpoint directory, if the job has one
    persist_every: int
    model: ModelSpec | None = None  # the job spec's: a commit from before a restart is its


class Durability:
    """The durability part: commits, the commit records, replication and persistence."""

    def __init__(
        self,
        config: DurabilityConfig,
        *,
        clock: Clock,
        store: LocalStore,
        metrics: AgentMetrics,
        records: CommitRecords,
        member_records: Callable[[Iterable[str]], Mapping[str, Record]],
        dialer: Dialer,
        fenced: Callable[[], bool],
        member_lease: Callable[[], int | None],
        current_plan: Callable[[], tuple[int, Plan] | None],
        wake: Callable[[], None],
    ) -> None:
        self.config = config
        self.state = DurabilityState()
        self._clock = clock
        self._store = store
        self._metrics = metrics
        self._records = records
        self._member_records = member_records
        self._dialer = dialer
        self._fenced = fenced  # read on the loop (a snapshot's commit) and by the rounds
        self._member_lease = member_lease
        self._current_plan = current_plan  # (generation, plan) this node follows, if any
        self._wake = wake
        self._closed = False
        self._replication: Future[Any] | None = None  # the round in flight
        self._persister: Persister | None = None  # started with the first checkpoint
        # The one writer of this node's commit records (loop and replicate thread feed it).
        self._commit_records: LatestWriter[CommitValue] = LatestWriter(
            self._put_commit_record,
            every_s=COMMIT_RECORD_EVERY_S,
            name="commit record",
            due_now=anchors_ran_ahead,
        )

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only this part emits."""
        executor.register(StepMetrics, self._step_metrics)
        executor.register(WriteMetricsLine, lambda a: self._write_metrics_line(a.line))
        executor.register(CountSnapshotFailure, lambda _: self._count_snapshot_failure())
        executor.register(RecordPieces, self._record_pieces)
        executor.register(Commit, self._commit)
        executor.register(DropUncommitted, self._drop_uncommitted)
        executor.register(RecordCommit, lambda a: self.record_commit(a.generation))
        executor.register(Replicate, lambda _: self._replicate())
        executor.register(Persist, lambda a: self._persist(a.step, a.model))

    def close(self, *, flush: bool) -> None:
        """Stop the persister (what it copies now is finished, within 10 s) and, with
        `flush` (etcd is still this agent's), put the newest commit record; no record is
        made after."""
        if self._persister is not None:
            self._persister.close(timeout_s=10.0)
        if flush:
            self._commit_records.close(timeout_s=5.0)
        self._closed = True

    def flush_records(self, timeout_s: float) -> bool:
        """Put the commit record that waits now, without its pace (`LatestWriter.flush`)."""
        return self._commit_records.flush(timeout_s)

    # ------------------------------------------------------------------ worker events
    def on_started(self, event: dict[str, JSONValue]) -> list[Action]:
        """A worker started: the device it reported (`torch.cuda.get_device_name`, or
        "cpu") decides the peak MFU is measured against; one line when that changes."""
        name = event.get("device_name")
        device = name if isinstance(name, str) else ""
        cfg, state = self.config, self.state
        peak, reason = slot_peak(cfg.peak_tflops, device, cfg.precision)
        if reason != state.peak_reason:
            log.info("MFU: %s", reason if peak is not None else f"not reported: {reason}")
        state.slot_peak_tflops, state.peak_reason = peak, reason
        return []

    def on_step(self, w: Worker, event: dict[str, JSONValue]) -> list[Action]:
        """A step a worker reported: observed, decided (`durability_on_step`, pure). Its row
        carries the layout the worker trained it in: an old worker's last steps are drained
        after the node entered the next generation, in another layout."""
        plan, node_id = w.plan, self.config.node_id
        seconds = event.get("step_seconds")
        return durability_on_step(
            self.state,
            StepObservation(
                step=integer(event, "step"),
                generation=integer(event, "generation", w.generation),
                loss=number(event, "loss"),
                lr=event.get("lr"),
                grad_norm=event.get("grad_norm"),
                step_seconds=None if seconds is None else number(event, "step_seconds"),
                layout=str(plan.layout),
                node_id=node_id,
                wall_s=self._clock.time(),
                samples=plan.global_batch,
                tokens=plan.global_batch * plan.model.seq_len,
                model_flops=node_step_flops(plan, node_id),
                peak_flops=self._peak_flops(plan),
            ),
        )

    def _peak_flops(self, plan: Plan) -> float | None:
        """The FLOP/s of this node's ranks of `plan` at their slots' peak, or None."""
        peak = self.state.slot_peak_tflops
        return None if peak is None else peak * 1e12 * len(plan.ranks_on(self.config.node_id))

    def on_snapshot(self, w: Worker, event: dict[str, JSONValue]) -> list[Action]:
        """A snapshot a worker wrote: recorded, then committed once every snapshot writer of
        this node reported (`durability_on_snapshot` and the feedback of its actions)."""
        plan, cfg = w.plan, self.config
        return durability_on_snapshot(
            self.state,
            SnapshotObservation(
                step=integer(event, "step"),
                generation=w.generation,
                rank=w.rank,
                pieces=event["pieces"],
                writers=frozenset(
                    s.rank for s in plan.ranks_on(cfg.node_id) if is_snapshot_writer(plan, s.rank)
                ),
                fenced=self._fenced(),  # the registration: read now, on the loop
                model=plan.model,
                replication_copies=cfg.replication_copies,
                replication_every=cfg.replication_every,
                persist_every=cfg.persist_every if cfg.persist_dir else 0,
                job_steps=cfg.steps,
            ),
        )

    def on_snapshot_failed(self, w: Worker, event: dict[str, JSONValue]) -> list[Action]:
        """A snapshot the worker could not write (`durability_on_snapshot_failed`)."""
        return durability_on_snapshot_failed(
            self.state, SnapshotFailure(event.get("step"), w.rank, event.get("message"))
        )

    # ------------------------------------------------------------------ the handlers
    def _step_metrics(self, action: StepMetrics) -> None:
        m = self._metrics
        m.of(m.step).set(action.step)
        m.of(m.loss).set(action.loss)
        m.of(m.steps_total).inc()
        if action.step_seconds is not None:
            m.of(m.step_seconds).observe(action.step_seconds)
        if action.lr is not None:
            m.of(m.learning_rate).set(action.lr)
        if action.grad_norm is not None:
            m.of(m.grad_norm).set(action.grad_norm)
        m.of(m.samples_total).inc(action.samples)
        m.of(m.tokens_total).inc(action.tokens)
        if action.model_tflops is not None:
            m.of(m.model_tflops).set(action.model_tflops)
        if action.mfu is not None:
            m.of(m.mfu).set(action.mfu)

    def _count_snapshot_failure(self) -> None:
        self._metrics.snapshot_failures_total.labels(**self._metrics.labels).inc()

    def _write_metrics_line(self, line: str) -> None:
        # Rotated, one old file kept: a job that runs for weeks must not fill the disk.
        path = self.config.metrics_path
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size > METRICS_ROTATE_BYTES:
                os.replace(path, path.with_name("metrics.jsonl.1"))
        with path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def _record_pieces(self, action: RecordPieces) -> list[Action]:
        error = None
        try:
            self._store.record_pieces(action.step, _piece_list(action.pieces), action.generation)
        except CheckpointError as exc:
            error = str(exc)
            log.info(
                "snapshot of step %d from rank %d not recorded: %s", action.step, action.rank, exc
            )
        return durability_recorded(self.state, action, error)

    def _commit(self, action: Commit) -> list[Action]:
        ok = True
        try:
            self._store.commit(action.step, action.model.units, action.generation)
        except CheckpointError as exc:
            ok = False
            log.warning("step %d not committed: %s", action.step, exc)
        replicating = self._replication is not None and not self._replication.done()
        return durability_committed(self.state, action, ok, replicating)

    def _drop_uncommitted(self, action: DropUncommitted) -> list[Action]:
        dropped = self._store.drop_uncommitted(action.keep)
        return durability_dropped(self.state, dropped, self._store.epoch)

    # ------------------------------------------------------------------ commit records
    def record_commit(self, generation: int) -> None:
        """This node's commit record of `generation`: its newest committed step and the
        anchors of that generation it holds, own and replicas (what the leader's safe step
        is computed from). Called after a commit (the loop) and after a replication round
        (the replicate thread). Made now, put by the record's one writer off the loop, at
        most every COMMIT_RECORD_EVERY_S: a slow etcd never holds the loop, and a record made
        earlier never lands after a newer one (elasticpp.agent.durability.latest)."""
        if self._closed:
            return
        self._commit_records.offer(generation, lambda: self._commit_record(generation))

    def _commit_record(self, generation: int) -> CommitValue:
        store, node_id = self._store, self.config.node_id
        origins = {o for o, _ in store.holdings().steps}
        replicas = {o: store.anchors(o, generation) for o in origins if o != node_id}
        return (
            self.state.last_commit_step,
            tuple(store.anchors(node_id, generation)),
            {o: tuple(steps) for o, steps in replicas.items() if steps},
        )

    def _put_commit_record(self, generation: int, value: CommitValue) -> None:
        """The writer thread's put (errors are the writer's: it keeps the value, retries)."""
        if self._closed:
            return
        step, anchors, replicas = value
        self._records.record_commit(
            generation,
            self.config.node_id,
            step,
            anchors,
            replicas,
            lease_id=self._member_lease(),
        )

    # ------------------------------------------------------------------ off the loop
    def _persist(self, step: int, model: ModelSpec) -> None:
        """Copy this node's pieces of `step` into the (shared) checkpoint directory; the
        last node to contribute writes the manifest. Off the training path, on one thread
        with a bounded queue: a newer checkpoint supersedes one that is still waiting."""
        persist_dir = self.config.persist_dir
        assert persist_dir is not None
        if self._persister is None:
            self._persister = Persister(self._store, Path(persist_dir), keep=2)
        self._persister.submit(step, model)

    def summary(self) -> DurabilitySummary:
        st = self.state
        return DurabilitySummary(st.last_step, st.last_loss, st.next_step_committed)

    def persist_outcome(self, step: int) -> str:
        """Where this node's pieces of `step` stand in the persistent checkpoint directory:
        `off` (the job has none), `persisted`, `pending`, `failed: <why>` or `unknown` (not
        submitted: `persist_now`)."""
        if not self.config.persist_dir:
            return "off"
        return "unknown" if self._persister is None else self._persister.outcome(step)

    def persist_now(self, step: int) -> bool:
        """Persist this node's pieces of its committed `step` now (a stopped job's final
        checkpoint, an operator's checkpoint now); False, with nothing submitted, if the job
        has no persist_dir, the model is not known yet or `step` is no commit held here."""
        # A commit this agent made, or one a run before its restart left in the store.
        model = self.state.last_commit_model or self.config.model
        if (
            not self.config.persist_dir
            or model is None
            or step not in self._store.committed_steps(self.config.node_id)
        ):
            return False
        self._persist(step, model)
        return True

    def _replicate(self) -> None:
        """A replication round (one at a time is the step's rule, `durability_committed`)."""
        current = self._current_plan()
        if current is None:
            return
        generation, plan = current
        # The plan's nodes with ranks, as the leader's safe step computes it: a member that
        # is not planned (yet) changes nobody's replica holders.
        ring = sorted({s.node_id for s in plan.placement})
        cfg = self.config

        def run() -> None:
            try:
                # The nodes this one backs up, by key on a follower (once a generation).
                origins = backup_origins(ring, cfg.node_id, cfg.replication_copies)
                addresses = {
                    n: str(i.get("address")) for n, i in self._member_records(origins).items()
                }
                results = replicate_once(
                    self._store,
                    addresses,
                    ring,
                    cfg.replication_copies,
                    generation,
                    every=cfg.replication_every,
                    client_factory=lambda address: StateClient(address, dialer=self._dialer),
                )
                if any(r.copied for r in results) and not self._fenced():
                    self.record_commit(generation)  # the replicas it holds now (a queue)
            except Exception as exc:  # replication is best effort; the next round retries
                log.warning("replication failed: %s", exc)

        # The round's thread writes nothing of the part's state: the loop sees it end
        # through the future; the commit record goes to its one writer's queue.
        self._replication = run_in_thread("replicate", run)
        self._replication.add_done_callback(lambda _: self._wake())


def _piece_list(pieces: JSONValue) -> list[Record]:
    """A worker's reported pieces as a list of JSON objects (the store checks each)."""
    if not isinstance(pieces, list):
        raise CheckpointError(f"pieces: expected a list, got {type(pieces).__name__}")
    out: list[Record] = []
    for i, piece in enumerate(pieces):
        if not isinstance(piece, dict):
            raise CheckpointError(f"pieces[{i}]: expected an object, got {type(piece).__name__}")
        out.append(piece)
    return out
