"""What a part publishes for the others to read: a small frozen summary per part, taken once
a turn (Patroni's one load of the DCS a cycle). A part reads another's summary, never its
fields; a summary holds values, not handles."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.kernel.records import Record, integer, number
from elasticpp.cluster.records import GenerationRecord, QuarantineRecord
from elasticpp.plan import Coord, Plan


@dataclass(frozen=True)
class FollowerSummary:
    """The generation this node follows (generation 0: none yet)."""

    generation: int = 0
    record: GenerationRecord | None = None  # the generation's record
    plan: Plan | None = None  # with this node's model
    planned: frozenset[str] | None = None  # the nodes of its plan
    phase: Phase | None = None
    waiting: str = ""  # the leader's wait for state (why), while this node waits with it


@dataclass(frozen=True)
class ViewSummary:
    """What this agent knows of etcd, as of its last read."""

    etcd_ok: bool = True
    leader: str | None = None
    members: Collection[str] = ()  # every registered node (a leader), else the plan's
    done: Record = field(default_factory=dict)  # barrier `done`: node -> its arrival
    timelines: Record = field(default_factory=dict)  # by gen-G


@dataclass(frozen=True)
class HealthSummary:
    """Quarantines and the job's end, as this agent knows them."""

    ended: tuple[str, str] | None = None  # (status, reason) once the job ended unfinished
    quarantined: Mapping[str, QuarantineRecord] = field(default_factory=dict)
    cordoned: frozenset[str] = frozenset()  # nodes an operator cordoned (`job cordon`)
    readmitted_s: float = 0.0  # monotonic: a node was last re-admitted (planned again)
    exit_code: int | None = None  # the job ended and this agent is to exit with it


@dataclass(frozen=True)
class ProgressSummary:
    """The newest step this node's ranks committed, and the store's floor."""

    last_step: int = -1
    last_loss: float = float("nan")
    safe_step: int = -1  # the store's floor: the newest step every holder keeps


@dataclass(frozen=True)
class DurabilitySummary:
    """What this node's ranks trained and committed, as the durability part saw it."""

    last_step: int = -1  # the newest step its ranks trained
    last_loss: float = float("nan")
    next_step_committed: int = 0  # steps applied, as last seen from its workers


@dataclass(frozen=True)
class ControlSummary:
    draining: bool = False
    job_done: bool = False  # the job trained every step
    exit_code: int | None = None


@dataclass(frozen=True)
class WorkerSeen:
    """One of the supervisor's workers with a rank, as other parts see it."""

    rank: int
    pid: int
    state: str
    last_step: int
    generation: int


@dataclass(frozen=True)
class LivenessSummary:
    """What the liveness part found, as the other parts read it."""

    dead: Mapping[str, str]  # node -> incarnation confirmed dead
    unhealthy: Mapping[str, str]  # node -> incarnation that answered NOT_SERVING
    revived_s: float  # monotonic: a node found dead last answered again
    suspecting: bool  # a follower suspects the leader of a failure it reported


@dataclass(frozen=True)
class LeaderSummary:
    """The leader part, as the other parts read it."""

    leading: bool = False  # this agent holds the leader's term (it acts only while it
    # also is the leader the view reads and is not fenced: `Leader.acting`)
    generation: int = 0  # the generation its term last looked at
    timeline_written: bool = False  # ... and whether that generation's transition is over
    campaign_at_s: float | None = None  # monotonic: this node's campaign is due then


# ---------------------------------------------------------------------- the agent's status
@dataclass(frozen=True)
class WorkerStatus:
    """One worker with a rank, as `ctl status` shows it."""

    rank: int
    pid: int
    state: str
    last_step: int
    generation: int
    coord: Coord | None  # its place in the followed generation's layout (None: an older one)


@dataclass(frozen=True)
class RecoveryStatus:
    """One generation's transition, as its timeline records it (`ctl status`)."""

    generation: int
    reason: str
    layout_before: str
    layout_after: str
    resume_step: int
    steps_recomputed: int
    planned_s: float  # seconds from the detection to each phase's end
    stopped_s: float
    moved_s: float
    resumed_s: float

    @classmethod
    def of(cls, timeline: Record) -> RecoveryStatus:
        """A timeline read from etcd; raises TypeError or ValueError on one that is not."""
        return cls(
            generation=integer(timeline, "generation", 0),
            reason=str(timeline.get("reason", "")),
            layout_before=str(timeline.get("layout_before", "")),
            layout_after=str(timeline.get("layout_after", "")),
            resume_step=integer(timeline, "resume_step", 0),
            steps_recomputed=integer(timeline, "steps_recomputed", 0),
            planned_s=number(timeline, "planned_s", 0.0),
            stopped_s=number(timeline, "stopped_s", 0.0),
            moved_s=number(timeline, "moved_s", 0.0),
            resumed_s=number(timeline, "resumed_s", 0.0),
        )


@dataclass(frozen=True)
class AgentStatus:
    """What the control RPCs read (`GetStatus`): published by the loop, a value."""

    node_id: str
    job: str
    generation: int = 0
    leader: str = ""
    phase: str = "waiting"
    ended: str = ""  # "status: reason" once the job ended unfinished
    waiting: str = ""  # the leader's wait for state (why)
    quarantined: Mapping[str, QuarantineRecord] = field(default_factory=dict)
    layout: str = ""
    last_step: int = -1
    last_loss: float = float("nan")
    members: tuple[str, ...] = ()
    workers: tuple[WorkerStatus, ...] = ()
    recoveries: tuple[RecoveryStatus, ...] = ()
