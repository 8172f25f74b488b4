"""The view's decisions: how a read of the job's etcd state becomes what this agent knows
(pure: no I/O; `view_step` writes only the state it is given). See `view.shell` for how
the reads are made."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticpp.agent.actions import Action, Event, SetFloor, UpdateGauges
from elasticpp.agent.kernel.records import Record
from elasticpp.cluster.records import GenerationRecord, SafeStep


@dataclass
class ViewState:
    """What this agent knows of etcd, plain data: written by `view_step` and the view's
    shell only. Other parts read its `ViewSnapshot` and ask for a fresh read by raising the
    view's `reread` signal."""

    # Every registered node while this agent leads (it caches the member keys); a follower
    # holds only its own record and the leader's (`members_complete` False): it reads the
    # others it needs by key (`MemberDirectory`), so a registration reaches one node, not N.
    members: Mapping[str, Record] = field(default_factory=dict)
    members_complete: bool = True
    leader_member: tuple[str | None, int, Mapping[str, Record]] = (None, -1, {})  # a
    # follower's read of the leader's record: (leader, its key's create revision, {leader:
    # record})
    record: GenerationRecord | None = None
    record_rev: int = 0
    leader: str | None = None
    barriers: Mapping[str, Record] = field(default_factory=dict)
    etcd_ok: bool = True
    last_refresh_s: float = 0.0  # monotonic
    safe_read_s: float = 0.0  # monotonic: when the published safe step was last read
    skipped_seen: int = 0  # unreadable etcd values already counted in the metrics
    requests_seen: dict[str, int] = field(default_factory=dict)  # etcd requests counted so
    # far in the metrics, by method
    last_join_s: float = field(default_factory=time.monotonic)  # a member (re)registered
    detected: dict[int, float] = field(default_factory=dict)  # generation -> wall time a
    # join or a lease lapse that calls for it was first seen (the recovery timeline)
    exit_code: int | None = None  # EPOCH_ENDED_EXIT once the job's epoch is gone


# The exit status of an agent whose job epoch ended under it (EX_TEMPFAIL: start it again;
# a service manager's restart-on-failure does).
EPOCH_ENDED_EXIT = 75


@dataclass(frozen=True)
class EtcdRead:
    """One read of the job's etcd state by the view (typed at the cluster boundary)."""

    members: Mapping[str, Record]
    record: GenerationRecord | None
    record_rev: int
    leader: str | None
    barriers: Mapping[str, Record]
    safe: SafeStep | None  # read at most every SAFE_EVERY_S; None when not read this time
    complete: bool = True  # `members` is every registered node (the leader's read)


def view_step(
    state: ViewState, read: EtcdRead, *, dead: frozenset[str], now_s: float, wall_s: float
) -> list[Action]:
    """Take a successful read as the view: note joins (a member with a new incarnation) and
    departures for the recovery timeline (a lease lapse counts as the detection only for a
    node of the plan not already found dead by probe), and publish the safe step to the
    store. Writes only `state`; no I/O."""
    actions: list[Action] = []
    if not state.etcd_ok:
        actions.append(Event("decision", "etcd reachable again"))
        state.etcd_ok = True
    joined: list[str] = []
    left: list[str] = []
    # An unchanged cached read is the same object (ClusterClient): nothing joined or left,
    # and comparing every member on every refresh is O(N) a second per node. Joins and
    # departures are the leader's to see: a follower's members are itself and the leader.
    # A new leader's first complete read has no earlier one to compare with: the members
    # the generation record does not plan count as joined (all of them when there is no
    # record yet, as a job starts), so that it lets joins settle as the leader before did.
    if read.members is not state.members and read.complete and state.members_complete:
        joined = sorted(
            n
            for n, info in read.members.items()
            if state.members.get(n, {}).get("incarnation") != info.get("incarnation")
        )
        left = sorted(set(state.members) - set(read.members))
    elif read.complete and not state.members_complete:
        planned = set(read.record.planned_nodes) if read.record else set()
        joined = sorted(set(read.members) - planned)
    next_gen = (read.record.generation if read.record else 0) + 1
    if joined:
        state.last_join_s = now_s
        state.detected.setdefault(next_gen, wall_s)
        actions.append(Event("membership", f"member(s) joined: {', '.join(joined)}"))
    if left:
        actions.append(Event("membership", f"member(s) left: {', '.join(left)}"))
        planned = set(read.record.planned_nodes) if read.record else set()
        if planned & (set(left) - dead):
            state.detected.setdefault(next_gen, wall_s)
    state.members, state.members_complete = read.members, read.complete
    state.record, state.record_rev = read.record, read.record_rev
    # Detection times of generations up to the record's are of no use now.
    for g in [g for g in state.detected if g < next_gen]:
        del state.detected[g]
    state.leader = read.leader
    state.barriers = read.barriers
    if read.safe is not None:
        actions.append(SetFloor(read.safe.step, read.safe.generation))
    actions.append(UpdateGauges())
    return actions


@dataclass(frozen=True)
class ViewSnapshot:
    """What the view knows, as other parts read it (frozen; the dicts are the view's, which
    it replaces whole on each read and never changes in place: read them, never write)."""

    members: Mapping[str, Record]
    members_complete: bool
    record: GenerationRecord | None
    record_rev: int
    leader: str | None
    barriers: Mapping[str, Record]
    etcd_ok: bool
    last_refresh_s: float
    last_join_s: float
    detected: Mapping[int, float]
    exit_code: int | None
