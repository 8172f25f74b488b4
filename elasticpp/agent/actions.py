"""What a part's pure step asks the executor to do: actions as data, the parts' shared
vocabulary.

Every part's decisions are pure steps: `control.step.control_step`, `health.step.job_end_step`,
`supervisor.step.supervisor_step`, `liveness.step.leader_watch_step`, `view.step.view_step`,
`follower.step.follower_step`, the durability part's worker events
(`durability.step.durability_on_step`, `durability_on_snapshot`,
`durability_on_snapshot_failed`) and `leader.step.leader_step` (the leader). Each reads an
immutable observation and its own state and returns a list of these; it does no I/O. The
agent's one executor (elasticpp.agent.kernel.executor) applies them in order, in the error
boundary of the part that asked, each with the handler the part that carries it out
registered. An action whose outcome matters (an etcd write that may be refused, a commit, a
fetch, a probe) has it fed back to a pure function of the part that asked
(`follower.step.follower_arrived`, `durability.step.durability_committed`,
`leader.step.leader_generation_written`, `liveness.step.leader_probed`, ...), which returns the
next actions: a state change that depends on a write happens only there, after it succeeded.
Adding an action means registering its handler beside the step that emits it (a test checks
every member of `Action` has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elasticpp.agent.kernel.records import JSONValue, Record
from elasticpp.agent.sick import Action as SickAction
from elasticpp.cluster.records import GenerationRecord, SafeStep
from elasticpp.plan import ModelSpec, Plan
from elasticpp.store.digest import HoldingsDigest
from elasticpp.store.holdings import NodeHoldings


@dataclass(frozen=True)
class Event:
    """Log a decision or an observation (`ctl events`, and the log)."""

    kind: str
    message: str


@dataclass(frozen=True)
class PublishMemberInfo:
    """Write this node's member key again (what changed: draining, slots)."""


@dataclass(frozen=True)
class StepDown:
    """Resign the leadership, if this node holds it."""

    why: str


@dataclass(frozen=True)
class ReleaseSpares:
    """Stop the warm workers: nothing will be assigned to them any more."""


@dataclass(frozen=True)
class StopWorkers:
    """Kill every worker still alive (without waiting) and stop the warm ones."""


@dataclass(frozen=True)
class JobEndedGauge:
    """Show the job's end in the metrics (`elasticpp_job_ended{status}`)."""

    status: str


@dataclass(frozen=True)
class KillWorker:
    """SIGKILL one worker (by pid) without waiting; its reader thread reports the exit."""

    pid: int


@dataclass(frozen=True)
class ReplaceSpare:
    """Kill a warm worker that never became ready and drop it from the pool (counted)."""

    pid: int


@dataclass(frozen=True)
class PingTemplate:
    """Ask the node's worker template (by pid) to answer; it does between forks."""

    pid: int


@dataclass(frozen=True)
class ReplaceTemplate:
    """Kill the node's worker template (by pid: stopped, hung, or gone after it served)
    with the workers it forked, report the generation of those that held ranks failed
    (this node is not the cause), and start another template."""

    pid: int
    why: str


@dataclass(frozen=True)
class SpawnWarm:
    """Start warm workers until the pool holds one per slot."""


@dataclass(frozen=True)
class ReportFailure:
    """Report a generation failed on this node (the follower publishes it, level-triggered).
    `culprit`: this node is the cause, not a victim of a peer's failure; `severe`: the leader
    quarantines it at once (elasticpp.agent.sick)."""

    generation: int
    reason: str
    culprit: bool = False
    severe: bool = False


@dataclass(frozen=True)
class ProbeLeader:
    """Probe the leader's agent; the result goes back to the liveness part
    (`liveness.leader_probed`)."""

    leader: str
    address: str
    incarnation: str


@dataclass(frozen=True)
class DeposeLeader:
    """Delete the leader key of `leader`'s term (a follower's verdict after a failed probe);
    whether it was deleted goes back to the liveness part (`liveness.leader_deposed`)."""

    leader: str
    why: str
    dead_incarnation: str | None  # the leader's incarnation if the probe found it dead


@dataclass(frozen=True)
class Reread:
    """Read etcd again on the next tick (the view)."""


@dataclass(frozen=True)
class SetFloor:
    """The published safe step: the store keeps anchors at or above it (it only rises)."""

    step: int
    generation: int


@dataclass(frozen=True)
class UpdateGauges:
    """Set the agent's gauges from the parts' state (members, leader, generation, workers)."""


# --- the durability part's actions


@dataclass(frozen=True)
class StepMetrics:
    """Show a step the workers reported in the metrics (step, loss, steps, step time)."""

    step: int
    loss: float
    step_seconds: float | None
    lr: float | None = None
    grad_norm: float | None = None
    samples: int = 0  # the step's global batch
    tokens: int = 0  # its samples x seq_len
    model_tflops: float | None = None  # this node's, over its newest steps (None: unknown)
    mfu: float | None = None  # model_tflops over the node's peak (None: no peak known)


@dataclass(frozen=True)
class WriteMetricsLine:
    """Append one line to the node's metrics.jsonl (rotated past METRICS_ROTATE_BYTES)."""

    line: str


@dataclass(frozen=True)
class CountSnapshotFailure:
    """Count a snapshot a worker could not write (`elasticpp_snapshot_failures_total`)."""


@dataclass(frozen=True)
class Commit:
    """Commit this node's step `step` of `generation` in its store; whether it was committed
    goes back to the durability part (`durability.durability_committed`), which then has the
    commit record written and, as decided here, a replication round and a persistent
    checkpoint started."""

    step: int
    generation: int
    model: ModelSpec
    replicate: bool  # a step replication rounds are made on
    persist: bool  # a step persistent checkpoints are made of


@dataclass(frozen=True)
class RecordPieces:
    """Record the pieces rank `rank` of `generation` reported for `step` in the store;
    whether they were recorded (a late or malformed report is refused) goes back to the
    durability part (`durability.durability_recorded`), which commits once every snapshot
    writer of this node (`writers`) reported, unless the node is `fenced`."""

    step: int
    generation: int
    rank: int
    pieces: JSONValue  # as the worker reported them: the store checks them
    writers: frozenset[int]
    fenced: bool
    commit: Commit  # the commit to make once every writer reported


@dataclass(frozen=True)
class DropUncommitted:
    """Delete this node's uncommitted snapshots but the newest `keep` (a fenced node commits
    nothing, so nothing is pruned); what was dropped goes back to the durability part
    (`durability.durability_dropped`)."""

    keep: int


@dataclass(frozen=True)
class RecordCommit:
    """Offer this node's commit record of `generation` to its writer (off the loop)."""

    generation: int


@dataclass(frozen=True)
class Replicate:
    """Start a replication round of the current generation's ring on its own thread."""


@dataclass(frozen=True)
class Persist:
    """Queue this node's pieces of `step` for the persistent checkpoint directory."""

    step: int
    model: ModelSpec


# --- the leader's actions
@dataclass(frozen=True)
class WriteGeneration:
    """Compare-and-swap generation `record` against the record's revision read
    (`expected_rev`), fenced by the term; whether it was written goes back to the leader
    (`leader.step.leader_generation_written`), which only then counts it for the backoff."""

    record: GenerationRecord
    expected_rev: int
    graceful: bool
    decided_s: float  # monotonic: the backoff counts from here
    message: str  # the decision's sentence, told once the write succeeded


@dataclass(frozen=True)
class ConfirmDead:
    """Probe the suspects `nodes` (`liveness.shell.Liveness.confirm_dead`); the verdicts reach the
    leader through the next view (`ClusterView.dead`)."""

    nodes: tuple[str, ...]


@dataclass(frozen=True)
class SetAside:
    """Carry out the leader's health decisions (quarantines of nodes that did not arrive at
    `stopped-G` in time: etcd writes fenced by the term, `health.shell.Health.carry_out`)."""

    decisions: tuple[SickAction, ...]


@dataclass(frozen=True)
class PullHoldings:
    """Pull, on a thread of its own, the holdings detail the resume of `generation` needs
    from the nodes whose digests say they may be a source (elasticpp.agent.leader.pull); the future
    goes back to `leader.step.leader_pull_started`, its result to the step as an observation."""

    generation: int
    units: tuple[str, ...]  # the plan's model's
    digests: Mapping[str, HoldingsDigest]  # what the nodes resumed from published at stopped-G
    known: Mapping[str, NodeHoldings]  # holdings that arrived in full (the previous release)
    live_nodes: tuple[str, ...]
    persist_dir: str | None


@dataclass(frozen=True)
class ResolveResume:
    """Read what the persistent checkpoint in `persist_dir` holds (a filesystem read; none
    when `persist_dir` is None: `disk` is what a pull read), and hand it to
    `leader.step.leader_resume_resolved`, which resolves the resume step."""

    generation: int
    plan: Plan
    holdings: Mapping[str, NodeHoldings]  # the detail pulled (or arrived in full) per node
    live_nodes: tuple[str, ...]
    next_steps: tuple[int, ...]  # the steps the stopped workers would have run next
    persist_dir: str | None
    wall_s: float
    disk: NodeHoldings | None = None  # the checkpoint's holdings, read by the pull
    held: bool = False  # a node's digest says it holds committed steps (maybe not pulled)


@dataclass(frozen=True)
class CheckNeverCommitted:
    """Read whether the job ever committed a step (`cluster.ever_committed`); the answer goes
    to `leader.step.leader_fresh_checked`: a job that never did starts at step 0."""

    resolve: ResolveResume
    why: str  # why no step resolved


@dataclass(frozen=True)
class WriteResume:
    """Publish the resume instruction of `generation` once, fenced by the term; whether it
    was written goes back to `leader.step.leader_resume_written`."""

    generation: int
    value: Record


@dataclass(frozen=True)
class PublishResumeWait:
    """Say in etcd that `generation` cannot resume yet, and why (fenced by the term, only
    while no instruction is written): its followers wait for state instead of failing it."""

    generation: int
    why: str


@dataclass(frozen=True)
class RecordTimeline:
    """Publish the recovery timeline of `generation`, fenced by the term; whether it was
    written goes back to `leader.step.leader_timeline_recorded`."""

    generation: int
    timeline: Record
    recovery: bool  # a generation that replaced a running layout (counted as a recovery)


@dataclass(frozen=True)
class Housekeep:
    """Remove what generations before `generation` left in etcd (bounded growth)."""

    generation: int


@dataclass(frozen=True)
class CompactHistory:
    """Compact etcd's history to the revision read at the previous compaction (fenced by
    the term; `ClusterClient.compact_history`)."""


@dataclass(frozen=True)
class CleanRendezvous:
    """Delete the rendezvous store's keys of generations before `generation`."""

    generation: int


@dataclass(frozen=True)
class CountRecovery:
    """Count a recovery and its duration in the metrics."""

    seconds: float


@dataclass(frozen=True)
class ReadCommitRecords:
    """Read the commit records of `generation`; they go to `leader.step.leader_safe_step`,
    which computes the safe step of `ring` with `copies` replicas."""

    generation: int
    ring: tuple[str, ...]
    copies: int


@dataclass(frozen=True)
class ReadSafe:
    """Read the published safe step; it goes to `leader.step.leader_safe_read`, which writes
    `safe` only if it is higher."""

    safe: SafeStep
    copies: int


@dataclass(frozen=True)
class WriteSafe:
    """Publish `safe`, fenced by the term and the revision read (`expected_rev`); the
    outcome goes to `leader.step.leader_safe_written`."""

    safe: SafeStep
    expected_rev: int
    copies: int
    was: SafeStep | None


# --- the follower's actions
@dataclass(frozen=True)
class SkipRecord:
    """Count a generation record whose plan this build cannot read (it is not followed)."""

    generation: int
    error: str


@dataclass(frozen=True)
class AskStop:
    """Ask old workers (by pid) to stop at the next step boundary."""

    pids: tuple[int, ...]


@dataclass(frozen=True)
class KillOld:
    """SIGKILL old workers (by pid) without waiting; their reader threads report the exits."""

    pids: tuple[int, ...]


@dataclass(frozen=True)
class DrainWorkerEvents:
    """Hand the queued worker events to the supervisor now (the old workers' last steps and
    exits), before what this node holds is reported."""


@dataclass(frozen=True)
class CleanResume:
    """Delete the resume directories of generations older than `generation`."""

    generation: int


@dataclass(frozen=True)
class CleanLocal:
    """Bound local leftovers: older resume directories and all but the newest worker logs."""

    generation: int


@dataclass(frozen=True)
class RemoveResumeDir:
    """Delete `generation`'s own resume directory (its fetch failed; no worker reads it)."""

    generation: int


@dataclass(frozen=True)
class ArriveStopped:
    """Arrive at `stopped-G` with a digest of the store's holdings and the next step
    committed here; the result goes back to the follower (`follower.follower_arrived`)."""

    generation: int
    at_s: float  # wall time


@dataclass(frozen=True)
class StartFetch:
    """Fetch this node's state of `generation` on a thread of its own; its future goes back
    to the follower (`follower.follower_fetch_started`)."""

    generation: int
    resume: dict[str, JSONValue]


@dataclass(frozen=True)
class AssignRanks:
    """Hand this node's ranks of `generation` to ready warm workers, all or none; the
    outcome goes back to the follower (`follower.follower_assigned`)."""

    generation: int
    resume: dict[str, JSONValue]


@dataclass(frozen=True)
class ArriveStarted:
    """Arrive at `started-G` (every rank here left STARTING, or none is here: `spare`); the
    result goes back to the follower (`follower.follower_arrived`)."""

    generation: int
    moved_s: float  # wall time this node's state was in place (0 for a spare)
    at_s: float
    spare: bool = False


@dataclass(frozen=True)
class ArriveStepped:
    """Arrive at `stepped-G`: every rank of the generation here completed a step in it (the
    leader clears this node's strikes only then: started is not trained); the result goes
    back to the follower (`follower.follower_arrived`)."""

    generation: int
    step: int  # the step every rank here completed
    at_s: float


@dataclass(frozen=True)
class ArriveDone:
    """Arrive at `done`: this node's ranks trained every step; the result goes back to the
    follower (`follower.follower_arrived`)."""

    generation: int
    step: int
    at_s: float


@dataclass(frozen=True)
class RecordHalt:
    """Record the job's halt in etcd (held and retried by the health part), show it in the
    metrics and say what is committed."""

    message: str


# --- a job's stop (elasticpp.agent.stop)
@dataclass(frozen=True)
class PersistFinal:
    """Persist this node's newest commit, `step`, now: a stopped job's final checkpoint."""

    step: int


@dataclass(frozen=True)
class ArriveStop:
    """Tell the leader (barrier `stop`) that this node's workers are gone, the step it
    committed last (-1: none) and where its final checkpoint stands."""

    step: int
    checkpoint: str


@dataclass(frozen=True)
class EndStopped:
    """End the job as `stopped` (the leader, once every node arrived at `stop`)."""

    reason: str
    step: int


# --- a checkpoint now (elasticpp.agent.checkpoint)
@dataclass(frozen=True)
class ReportHeld:
    """Tell `job checkpoint` (barrier `checkpoint`) which committed steps this node holds."""

    request: str  # the request's id
    held: tuple[int, ...]  # newest first


@dataclass(frozen=True)
class PersistStep:
    """Persist this node's pieces of its committed `step` now (an operator's checkpoint)."""

    request: str
    step: int


@dataclass(frozen=True)
class ReportCheckpoint:
    """Tell `job checkpoint` where this node's pieces of `step` stand: persisted, or why not."""

    request: str
    step: int
    outcome: str


Action = (
    Event
    | PublishMemberInfo
    | StepDown
    | ReleaseSpares
    | StopWorkers
    | JobEndedGauge
    | KillWorker
    | ReplaceSpare
    | PingTemplate
    | ReplaceTemplate
    | SpawnWarm
    | ReportFailure
    | ProbeLeader
    | DeposeLeader
    | Reread
    | SetFloor
    | UpdateGauges
    | StepMetrics
    | WriteMetricsLine
    | CountSnapshotFailure
    | Commit
    | RecordPieces
    | DropUncommitted
    | RecordCommit
    | Replicate
    | Persist
    | WriteGeneration
    | ConfirmDead
    | SetAside
    | PullHoldings
    | ResolveResume
    | CheckNeverCommitted
    | WriteResume
    | PublishResumeWait
    | RecordTimeline
    | Housekeep
    | CleanRendezvous
    | CompactHistory
    | CountRecovery
    | ReadCommitRecords
    | ReadSafe
    | WriteSafe
    | SkipRecord
    | AskStop
    | KillOld
    | DrainWorkerEvents
    | CleanResume
    | CleanLocal
    | RemoveResumeDir
    | ArriveStopped
    | StartFetch
    | AssignRanks
    | ArriveStarted
    | ArriveStepped
    | ArriveDone
    | RecordHalt
    | PersistFinal
    | ArriveStop
    | EndStopped
    | ReportHeld
    | PersistStep
    | ReportCheckpoint
)
