"""The durability part of the agent: what the workers hand over becomes committed state.

Steps are committed by (generation, step) into the node's `LocalStore` (a committed piece is
never rewritten), reported in the node's commit record with the anchor steps it holds (own
and replicas: the leader's safe step is computed from them), replicated to ring peers and
persisted to the checkpoint directory off the training path; resume state is fetched (local
pieces linked, remote ones streamed with checksums; piece names from etcd parsed before use).
An agent whose membership lease may have lapsed commits nothing (self-fencing). Local
leftovers (older resume directories, worker logs, metrics.jsonl) are bounded.

The worker events it handles are pure steps (elasticpp.agent.durabilitystep): the methods
here only observe (the event, this node's snapshot writers of the worker's plan, whether it
is fenced, the job's numbers, wall time) and hand the step's actions to the executor, which
records pieces, commits, drops a fenced node's old snapshots, writes metrics, and starts the
commit record, replication rounds and persistence (`_record_commit`, `_replicate_async`,
`_persist_async`), feeding the outcomes back to the step's functions.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticpp.agent.durabilitystep import (
    DurabilityState as DurabilityState,  # the part's state, composed by the agent (node)
)
from elasticpp.agent.durabilitystep import (
    SnapshotFailure,
    SnapshotObservation,
    StepObservation,
    durability_on_snapshot,
    durability_on_snapshot_failed,
    durability_on_step,
)
from elasticpp.agent.follower import _GenState, run_in_thread
from elasticpp.agent.limits import (
    FETCH_MIN_BYTES_PER_S,
    FETCH_PARALLEL,
    FETCH_PER_SOURCE,
    FETCH_STALL_S,
    METRICS_ROTATE_BYTES,
    WORKER_LOGS_KEPT,
)
from elasticpp.agent.pool import _Worker
from elasticpp.checkpoint.manifest import step_dirname
from elasticpp.cluster.records import GenerationRecord
from elasticpp.errors import StateUnavailableError
from elasticpp.plan import ModelSpec, Plan
from elasticpp.plan.flops import node_step_flops, slot_peak
from elasticpp.store.client import StateClient
from elasticpp.store.holdings import DISK_SOURCE
from elasticpp.store.instruction import node_fetches
from elasticpp.store.persist import Persister, copy_verified
from elasticpp.store.replicate import backup_origins, replicate_once
from elasticpp.store.resume import PieceTransfer, TransferProgress, fetch_pieces
from elasticpp.store.retention import ANCHORS_ABOVE_FLOOR
from elasticpp.train.snapshots import is_snapshot_writer

log = logging.getLogger("elasticpp.agent")


@dataclass(frozen=True)
class FetchOutcome:
    """What a state fetch came to, handed back to the loop."""

    done_at: float | None = None  # wall time the last piece was in place
    error: str | None = None
    disk_error: bool = False  # the error was this node's own disk (full, read-only, failing)


_RESUME_DIR = re.compile(r"gen-([0-9]{1,19})")  # resume/gen-<G>, see _resume_dir

# A commit record's value: (newest committed step, own anchors, replica anchors by origin).
CommitValue = tuple[int, tuple[int, ...], dict[str, tuple[int, ...]]]


def fetch_addresses(
    record: GenerationRecord, members: Mapping[str, Mapping[str, Any]]
) -> dict[str, str]:
    """Where each source of generation `record`'s state is served: the address in its member
    key (a source may lie outside the plan: a draining node hands its state over). Not a
    planned node registered again under another incarnation since: the agent there now is not
    the one whose holdings the resume instruction counted on."""
    moved = record.reregistered(members)
    return {n: str(i.get("address")) for n, i in members.items() if n not in moved}


def anchors_ran_ahead(written: CommitValue | None, newest: CommitValue) -> bool:
    """Whether a commit record must not wait for COMMIT_RECORD_EVERY_S: half of the anchors
    the store keeps above the safe step (per origin, ANCHORS_ABOVE_FLOOR) are newer than the
    record etcd has. The leader's safe step is one of the listed anchors, and a store drops the
    oldest above the cap: at fast steps, a record that lagged longer could name a safe step
    its node no longer holds when the step reaches it as the floor."""
    if written is None:
        return False  # the first record is put at once anyway
    half = ANCHORS_ABOVE_FLOOR // 2
    if len(set(newest[1]) - set(written[1])) >= half:
        return True
    return any(
        len(set(steps) - set(written[2].get(origin, ()))) >= half
        for origin, steps in newest[2].items()
    )


# Errors of this node's own disk: full (ENOSPC, EDQUOT), read-only, or failing (EIO).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def is_disk_error(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is an error of the local disk."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class DurabilityPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _on_step(self, w: _Worker, event: dict[str, Any]) -> None:
        """A step a worker reported: observed, decided (`durability_on_step`, pure), done.
        Its row carries the layout the worker trained it in: an old worker's last steps are
        drained after the node entered the next generation, in another layout."""
        plan = w.plan
        seconds = event.get("step_seconds")
        self._execute(
            durability_on_step(
                self._ds,
                StepObservation(
                    step=int(event["step"]),
                    generation=int(event.get("generation", w.generation)),
                    loss=float(event["loss"]),
                    lr=event.get("lr"),
                    grad_norm=event.get("grad_norm"),
                    step_seconds=None if seconds is None else float(seconds),
                    layout=str(plan.layout),
                    node_id=self.node_id,
                    wall_s=self._clock.time(),
                    samples=plan.global_batch,
                    tokens=plan.global_batch * plan.model.seq_len,
                    model_flops=node_step_flops(plan, self.node_id),
                    peak_flops=self._peak_flops(plan),
                ),
            )
        )

    def _peak_flops(self, plan: Plan) -> float | None:
        """The FLOP/s of this node's ranks of `plan` at their slots' peak, or None."""
        peak = self._ds.slot_peak_tflops
        return None if peak is None else peak * 1e12 * len(plan.ranks_on(self.node_id))

    def _on_started(self, event: dict[str, Any]) -> None:
        """A worker started: the device it reported (`torch.cuda.get_device_name`, or
        "cpu") decides the peak MFU is measured against; one line when that changes."""
        name = event.get("device_name")
        device = name if isinstance(name, str) else ""
        peak, reason = slot_peak(self.spec.peak_tflops, device, self.spec.train.precision)
        if reason != self._ds.peak_reason:
            log.info("MFU: %s", reason if peak is not None else f"not reported: {reason}")
        self._ds.slot_peak_tflops, self._ds.peak_reason = peak, reason

    def _on_snapshot(self, w: _Worker, event: dict[str, Any]) -> None:
        """A snapshot a worker wrote: recorded, then committed once every snapshot writer of
        this node reported (`durability_on_snapshot` and the feedback of its actions)."""
        plan, spec = w.plan, self.spec
        self._execute(
            durability_on_snapshot(
                self._ds,
                SnapshotObservation(
                    step=int(event["step"]),
                    generation=w.generation,
                    rank=w.rank,
                    pieces=event["pieces"],
                    writers=frozenset(
                        s.rank
                        for s in plan.ranks_on(self.node_id)
                        if is_snapshot_writer(plan, s.rank)
                    ),
                    fenced=self._fenced(),  # the registration: read now, on the loop
                    model=plan.model,
                    replication_copies=spec.replication_copies,
                    replication_every=spec.replication_every,
                    persist_every=spec.persist_every if spec.persist_dir else 0,
                    job_steps=spec.steps,
                ),
            )
        )

    def _on_snapshot_failed(self, w: _Worker, event: dict[str, Any]) -> None:
        """A snapshot the worker could not write (`durability_on_snapshot_failed`)."""
        self._execute(
            durability_on_snapshot_failed(
                self._ds, SnapshotFailure(event.get("step"), w.rank, event.get("message"))
            )
        )

    def _write_metrics_line(self, line: str) -> None:
        # Rotated, one old file kept: a job that runs for weeks must not fill the disk.
        with contextlib.suppress(FileNotFoundError):
            if self.metrics_path.stat().st_size > METRICS_ROTATE_BYTES:
                os.replace(self.metrics_path, self.metrics_path.with_name("metrics.jsonl.1"))
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def _record_commit(self, generation: int) -> None:
        """This node's commit record of `generation`: its newest committed step and the
        anchors of that generation it holds, own and replicas (what the leader's safe step
        is computed from). Called after a commit (the loop) and after a replication round
        (the replicate thread). Made now, put by the record's one writer off the loop, at
        most every COMMIT_RECORD_EVERY_S: a slow etcd never holds the loop, and a record made
        earlier never lands after a newer one (elasticpp.agent.latest)."""
        if self._closed:
            return
        self._commit_records.offer(generation, lambda: self._commit_record(generation))

    def _commit_record(self, generation: int) -> CommitValue:
        origins = {o for o, _ in self.store.holdings().steps}
        replicas = {o: self.store.anchors(o, generation) for o in origins if o != self.node_id}
        return (
            self._ds.last_commit_step,
            tuple(self.store.anchors(self.node_id, generation)),
            {o: tuple(steps) for o, steps in replicas.items() if steps},
        )

    def _put_commit_record(self, generation: int, value: CommitValue) -> None:
        """The writer thread's put (errors are the writer's: it keeps the value, retries)."""
        if self._closed:
            return
        step, anchors, replicas = value
        self.cluster.record_commit(
            generation, self.node_id, step, anchors, replicas, lease_id=self._member_lease()
        )

    def _fenced(self) -> bool:
        reg = self._registration
        return reg is not None and bool(reg.may_have_lapsed())

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

    def _persist_async(self, step: int, model: ModelSpec) -> None:
        """Copy this node's pieces of `step` into the (shared) checkpoint directory; the
        last node to contribute writes the manifest. Off the training path, on one thread
        with a bounded queue: a newer checkpoint supersedes one that is still waiting."""
        assert self.spec.persist_dir is not None
        if self._ds.persister is None:
            self._ds.persister = Persister(self.store, Path(self.spec.persist_dir), keep=2)
        self._ds.persister.submit(step, model)

    def _replicate_async(self) -> None:
        """A replication round (the executor's, for `Replicate`: one at a time is the
        step's rule, `durability_committed`)."""
        gs = self._fs.gen
        if gs is None:
            return
        # The plan's nodes with ranks, as the leader's safe step computes it: a member that
        # is not planned (yet) changes nobody's replica holders.
        ring = sorted({s.node_id for s in gs.plan.placement})
        generation = gs.generation
        copies = self.spec.replication_copies

        def run() -> None:
            try:
                # The nodes this one backs up, by key on a follower (once a generation).
                origins = backup_origins(ring, self.node_id, copies)
                addresses = {
                    n: str(i.get("address")) for n, i in self.view.member_records(origins).items()
                }
                results = replicate_once(
                    self.store,
                    addresses,
                    ring,
                    copies,
                    generation,
                    every=self.spec.replication_every,
                    client_factory=lambda address: StateClient(address, dialer=self._dialer),
                )
                if any(r.copied for r in results) and not self._fenced():
                    self._record_commit(generation)  # the replicas it holds now (a queue)
            except Exception as exc:  # replication is best effort; the next round retries
                log.warning("replication failed: %s", exc)

        # The round's thread writes nothing of the agent's: the loop sees it end through
        # the future; the commit record goes to its one writer's queue.
        self._ds.replication = run_in_thread("replicate", run)
        self._ds.replication.add_done_callback(lambda _: self._wake.set())

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
