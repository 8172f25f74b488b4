"""The durability part's pure steps: what the workers hand over, decided.

A worker's step (`durability_on_step`), snapshot (`durability_on_snapshot`) and failed snapshot
(`durability_on_snapshot_failed`) are decided from an immutable observation and the part's own
state (`DurabilityState`), with no I/O and no clock (wall time comes in the observation); the
decisions are actions (elasticpp.agent.actions) that the part's shell applies: StepMetrics and
WriteMetricsLine per step, RecordPieces per report, Commit once every snapshot writer of the
node reported, DropUncommitted while fenced, then RecordCommit, Replicate and Persist. The
outcomes that matter come back to the functions here: `durability_recorded` (a refused report
changes nothing), `durability_committed` (only a successful commit prunes the reports, moves
`last_commit_step` and starts the commit record, replication and persistence, a round only
when none is in flight) and `durability_dropped` (dropped snapshots forget their reports).
When a commit record must not wait for its pace is `anchors_ran_ahead`'s to say.

Invariants: memory is bounded over weeks of steps (`written_steps` keeps the newest
WRITTEN_GENERATIONS_KEPT generations; reports are pruned at each commit and, while fenced, with
the snapshots dropped); a fenced node commits nothing; one replication round at a time.

Model TFLOP/s is this node's model FLOPs (`elasticpp.plan.flops.node_step_flops`) over the
steps' time, summed over the newest THROUGHPUT_STEPS steps of the generation (a new layout
starts afresh: its FLOPs per node differ); MFU is that over the node's peak, and is absent
(not 0) where no peak is known (a CPU slot without the job spec's `peak_tflops`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from elasticpp.agent.actions import (
    Action,
    Commit,
    CountSnapshotFailure,
    DropUncommitted,
    Event,
    Persist,
    RecordCommit,
    RecordPieces,
    Replicate,
    StepMetrics,
    WriteMetricsLine,
)
from elasticpp.agent.kernel.limits import FENCED_SNAPSHOTS_KEPT
from elasticpp.agent.kernel.records import JSONValue
from elasticpp.plan import ModelSpec
from elasticpp.store.retention import ANCHORS_ABOVE_FLOOR


@dataclass
class DurabilityState:
    """The durability part's state, plain data: written on the loop by the steps here (the
    `Durability` shell holds the replication round's future and the persister)."""

    last_commit_step: int = -1  # this node's newest own commit (its commit records say it)
    last_commit_model: ModelSpec | None = None  # the model of that commit (a final persist)
    snap_reports: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    snap_failures: int = 0  # snapshot writes failed since the last commit
    fence_logged: bool = False
    written_steps: dict[int, int] = field(default_factory=dict)  # generation -> newest step
    next_step_committed: int = 0  # steps applied, as last seen from this node's workers
    last_step: int = -1
    last_loss: float = float("nan")
    # (generation, model FLOPs, seconds) of this node's newest steps, THROUGHPUT_STEPS at most
    recent_work: list[tuple[int, float, float]] = field(default_factory=list)
    # The peak TFLOP/s of one of this node's slots (None: MFU not reported), and why
    slot_peak_tflops: float | None = None
    peak_reason: str = ""


THROUGHPUT_STEPS = 10  # steps model TFLOP/s is averaged over


@dataclass(frozen=True)
class StepObservation:
    """A step a worker reported, as the durability part's step sees it."""

    step: int
    generation: int
    loss: float
    lr: object  # as reported (metrics.jsonl only)
    grad_norm: object
    step_seconds: float | None
    layout: str  # of the current generation's plan ("" before any)
    node_id: str
    wall_s: float
    samples: int = 0  # the plan's global batch
    tokens: int = 0  # samples x seq_len
    model_flops: float = 0.0  # the model FLOPs of this node's ranks in the step
    peak_flops: float | None = None  # FLOP/s of this node's ranks at their peak; None: no MFU


def _number(value: object) -> float | None:
    """A reported lr or gradient norm as a float, or None (absent or not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass(frozen=True)
class SnapshotObservation:
    """A snapshot a worker wrote, and what deciding its commit takes: this node's snapshot
    writers of the worker's plan, whether the node is fenced, and the job's numbers."""

    step: int
    generation: int  # the worker's
    rank: int
    pieces: JSONValue  # as reported: the store checks them (RecordPieces)
    writers: frozenset[int]
    fenced: bool  # the membership lease may have lapsed
    model: ModelSpec
    replication_copies: int
    replication_every: int
    persist_every: int  # 0: no persistent checkpoints
    job_steps: int


@dataclass(frozen=True)
class SnapshotFailure:
    """A snapshot a worker could not write (a full disk, an I/O error)."""

    step: object  # as reported (the message only)
    rank: int
    message: object


WRITTEN_GENERATIONS_KEPT = 4  # generations whose newest written step is remembered


def durability_on_step(state: DurabilityState, obs: StepObservation) -> list[Action]:
    """Each step once in the metrics and metrics.jsonl. Workers of one generation report each
    step once per rank, in step order: the newest step written per generation is all it
    takes to write each step once (bounded memory for weeks of steps: only the newest
    WRITTEN_GENERATIONS_KEPT generations are kept)."""
    state.last_step = max(state.last_step, obs.step)
    state.next_step_committed = max(state.next_step_committed, obs.step + 1)
    state.last_loss = obs.loss
    if obs.step <= state.written_steps.get(obs.generation, -1):
        return []
    state.written_steps[obs.generation] = obs.step
    for old in sorted(state.written_steps)[:-WRITTEN_GENERATIONS_KEPT]:
        del state.written_steps[old]
    line = {
        "step": obs.step,
        "loss": obs.loss,
        "generation": obs.generation,
        "layout": obs.layout,
        "time": obs.wall_s,
        "node": obs.node_id,
        "lr": obs.lr,
        "grad_norm": obs.grad_norm,
        "step_seconds": obs.step_seconds,
    }
    tflops, mfu = _throughput(state, obs)
    metrics = StepMetrics(
        obs.step,
        obs.loss,
        obs.step_seconds,
        lr=_number(obs.lr),
        grad_norm=_number(obs.grad_norm),
        samples=obs.samples,
        tokens=obs.tokens,
        model_tflops=tflops,
        mfu=mfu,
    )
    return [metrics, WriteMetricsLine(json.dumps(line))]


def _throughput(state: DurabilityState, obs: StepObservation) -> tuple[float | None, float | None]:
    """This node's model TFLOP/s over its newest steps, and its MFU where a peak is known."""
    seconds = obs.step_seconds
    if seconds is None or not seconds > 0 or not obs.model_flops > 0:
        return None, None
    work = [w for w in state.recent_work if w[0] == obs.generation]
    work.append((obs.generation, obs.model_flops, seconds))
    state.recent_work = work[-THROUGHPUT_STEPS:]
    flops_per_s = sum(w[1] for w in state.recent_work) / sum(w[2] for w in state.recent_work)
    if obs.peak_flops is None or not obs.peak_flops > 0:
        return flops_per_s / 1e12, None
    return flops_per_s / 1e12, flops_per_s / obs.peak_flops


def durability_on_snapshot(state: DurabilityState, obs: SnapshotObservation) -> list[Action]:
    """Record the report (its outcome goes to `durability_recorded`), with the commit it
    completes decided now: replication rounds on every `replication_every`-th step (with
    copies), persistent checkpoints on every `persist_every`-th step and on the job's last."""
    del state  # written only once the store took the report
    commit = Commit(
        step=obs.step,
        generation=obs.generation,
        model=obs.model,
        replicate=bool(obs.replication_copies) and obs.step % obs.replication_every == 0,
        persist=bool(obs.persist_every)
        and (obs.step % obs.persist_every == 0 or obs.step == obs.job_steps),
    )
    return [
        RecordPieces(
            obs.step, obs.generation, obs.rank, obs.pieces, obs.writers, obs.fenced, commit
        )
    ]


def durability_recorded(
    state: DurabilityState, recorded: RecordPieces, error: str | None
) -> list[Action]:
    """The store took the report (`error` None) or refused it (late: its generation already
    committed the step; or malformed): a refused report changes nothing. Once every writer
    reported, the step is committed, unless the node is fenced: then nothing is committed,
    so nothing is pruned, and all but the newest FENCED_SNAPSHOTS_KEPT uncommitted
    snapshots are dropped (a long etcd outage must not fill the disk)."""
    if error is not None:
        return []
    reports = state.snap_reports.setdefault((recorded.generation, recorded.step), set())
    reports.add(recorded.rank)
    if not recorded.writers <= reports:
        return []
    if not recorded.fenced:
        return [recorded.commit]
    actions: list[Action] = []
    if not state.fence_logged:
        # Self-fencing: the job may have re-planned without this node; what it computes
        # now must not become state that others resume from.
        state.fence_logged = True
        actions.append(
            Event(
                "decision",
                f"membership lease may have lapsed: step {recorded.step} and later are not "
                "committed, replicated or persisted until it is renewed",
            )
        )
    return [*actions, DropUncommitted(FENCED_SNAPSHOTS_KEPT)]


def durability_dropped(
    state: DurabilityState, dropped: list[tuple[int, int, int]], epoch: int
) -> list[Action]:
    """Uncommitted snapshots (epoch, generation, step) deleted: their reports are forgotten
    (those of the store's current `epoch`: the reports are keyed by generation and step)."""
    for dropped_epoch, generation, step in dropped:
        if dropped_epoch == epoch:
            state.snap_reports.pop((generation, step), None)
    return []


def durability_committed(
    state: DurabilityState, commit: Commit, ok: bool, replicating: bool = False
) -> list[Action]:
    """A failed commit changes nothing (the next step's commit tries again). A step committed
    prunes the reports up to it and becomes this node's newest commit; then the commit
    record (the job's high-water mark: a job that ever committed a step never silently
    starts over from step 0; it also reports the anchors), a replication round (one at a
    time: none while a round is in flight, `replicating`; the next commit starts the next)
    and a persistent checkpoint, as the step decided."""
    if not ok:
        return []
    for old in [k for k in state.snap_reports if k[1] <= commit.step]:
        del state.snap_reports[old]
    state.last_commit_step = commit.step
    state.last_commit_model = commit.model
    actions: list[Action] = []
    if state.snap_failures:
        state.snap_failures = 0
        actions.append(
            Event("worker", f"snapshots are written again: step {commit.step} committed")
        )
    if state.fence_logged:
        state.fence_logged = False
        actions.append(Event("decision", "membership lease renewed: committing again"))
    actions.append(RecordCommit(commit.generation))
    if commit.replicate and not replicating:
        actions.append(Replicate())
    if commit.persist:
        actions.append(Persist(commit.step, commit.model))
    return actions


def durability_on_snapshot_failed(state: DurabilityState, obs: SnapshotFailure) -> list[Action]:
    """Training goes on, the step is never committed here. Logged once per run of failures
    (until a commit succeeds again), counted each time."""
    state.snap_failures += 1
    actions: list[Action] = [CountSnapshotFailure()]
    if state.snap_failures == 1:
        actions.append(
            Event(
                "worker",
                f"rank {obs.rank} could not write the snapshot of step {obs.step}: "
                f"{obs.message}; training goes on, steps are not committed here "
                "until snapshots can be written again",
            )
        )
    return actions


# A commit record's value: (newest committed step, own anchors, replica anchors by origin).
CommitValue = tuple[int, tuple[int, ...], dict[str, tuple[int, ...]]]


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
