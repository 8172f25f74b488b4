"""The agent's view of the cluster: members, the generation record, the leader and the
barriers of the current generation (the resume instruction; every node's arrivals,
`stopped-G`, `started-G` and `failed-G`, only on the leader: a follower reads none of them,
so a transition's N arrivals reach one node, not N), and the published safe step (at most
every `SAFE_EVERY_S`), which becomes the store's floor. The decision loop takes them (on a
watch event, and at least every second) from the job's watch-fed cache
(`elasticpp.cluster.cache`): in steady state the view sends etcd no request at all; it reads
a range again only when its watch lost events, and parses a record again only when it
changed (`ClusterClient` keeps what it derived from an unchanged cached answer).
What must be current is fenced where it is written (the generation's compare-and-swap, the
resume's and the safe step's transactions), so a view one watch delivery old is safe.
An unreachable etcd (or a watch that is down) keeps the last view (training goes on, changes
wait); an unreadable generation record keeps it too, since acting on a guess could break the
fencing; joins and losses are noted for the recovery timeline. When the job epoch
this agent joined is gone (the job's etcd state started afresh under it), the agent stops
(`_check_epoch`, exit status `EPOCH_ENDED_EXIT`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from elasticpp.agent.actions import Action, Event, SetFloor, UpdateGauges
from elasticpp.agent.limits import SAFE_EVERY_S
from elasticpp.cluster.errors import (
    ClusterDataError,
    ClusterUnavailableError,
)
from elasticpp.cluster.records import GenerationRecord, SafeStep

log = logging.getLogger("elasticpp.agent")


@dataclass
class ViewState:
    """What this agent knows of etcd: one object, written by the view's refresh only.
    Other parts ask for a fresh read by raising the agent's `refresh` signal."""

    # Every registered node while this agent leads (it caches the member keys); a follower
    # holds only its own record and the leader's (`members_complete` False): it reads the
    # others it needs by key (`MemberDirectory`), so a registration reaches one node, not N.
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    members_complete: bool = True
    leader_member: tuple[str | None, int, dict[str, dict[str, Any]]] = (None, -1, {})  # a
    # follower's read of the leader's record: (leader, its key's create revision, {leader:
    # record})
    record: GenerationRecord | None = None
    record_rev: int = 0
    leader: str | None = None
    barriers: dict[str, dict[str, Any]] = field(default_factory=dict)
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


class MemberDirectory:
    """The member records of the nodes a part needs (its fetch sources, its replication
    peers), for threads as well as the loop: from the view where it holds every member
    (the leader), else read by key once per generation and kept (a node that registers
    again under another incarnation is a new generation: the leader re-plans for it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = -1
        self._held: dict[str, dict[str, Any]] = {}

    def records(
        self,
        nodes: Iterable[str],
        view: ViewState,
        read: Callable[[list[str]], dict[str, dict[str, Any]]],
    ) -> dict[str, dict[str, Any]]:
        """The records of `nodes` that are registered; `read` reads missing ones by key."""
        members = view.members  # replaced whole by the view, never changed in place
        out = {n: members[n] for n in sorted(set(nodes)) if n in members}
        missing = sorted(set(nodes) - set(out))
        if not missing:
            return out
        generation = view.record.generation if view.record is not None else 0
        with self._lock:
            if generation != self._generation:
                self._generation, self._held = generation, {}
            out.update((n, self._held[n]) for n in missing if n in self._held)
        unread = [n for n in missing if n not in out]
        if unread:  # on the leader: not registered (a read by key says so again)
            found = read(unread)
            with self._lock:
                if generation == self._generation:
                    self._held.update(found)
            out.update(found)
        return out


# The exit status of an agent whose job epoch ended under it (EX_TEMPFAIL: start it again;
# a service manager's restart-on-failure does).
EPOCH_ENDED_EXIT = 75


@dataclass(frozen=True)
class EtcdRead:
    """One read of the job's etcd state by the view (typed at the cluster boundary)."""

    members: dict[str, dict[str, Any]]
    record: GenerationRecord | None
    record_rev: int
    leader: str | None
    barriers: dict[str, dict[str, Any]]
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


class ViewPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _etcd_down(self, exc: Exception) -> None:
        if self._vs.etcd_ok:
            self.journal.write(
                "decision", f"etcd unreachable ({exc}); training continues, changes wait"
            )
        self._vs.etcd_ok = False
        self._update_gauges()  # etcd_up to 0: by the control part, which keeps what it set

    def _count_skipped(self) -> None:
        new = self.cluster.skipped_values - self._vs.skipped_seen
        if new > 0:
            self._vs.skipped_seen += new
            self.metrics.of(self.metrics.etcd_values_skipped_total).inc(new)

    def _count_requests(self) -> None:
        """Bring `elasticpp_etcd_requests_total` up to the client's own counts."""
        for method, count in self.cluster.etcd_requests().items():
            new = count - self._vs.requests_seen.get(method, 0)
            if new > 0:
                self._vs.requests_seen[method] = count
                self.metrics.of(self.metrics.etcd_requests_total, method=method).inc(new)

    def _refresh(self) -> None:
        self._reread.take()
        self._vs.last_refresh_s = self._clock.monotonic()
        cluster = self.cluster
        try:
            # Only the leader caches the nodes' holdings digests and commit records (one read
            # each when its term starts, then their events); a follower knows its own
            # arrival from its write, and needs only the resume record.
            leading = self._ls.leadership is not None
            cluster.cache_for_leader(leading)
            cluster.sync_cache()  # reads a range again only if its watch lost events
            record, rev = cluster.read_generation(cached=True)
            leader, term = cluster.leader_term(cached=True)
            if leading:
                members = cluster.agent_members(cached=True).nodes
            else:
                members = self._follower_members(leader, term)
            barriers: dict[str, dict[str, Any]] = {}
            names = ["done", "timelines"]
            gen = record.generation if record else 0
            if gen:
                names.append(f"resume-{gen}")
                if self._ls.leadership is not None:  # every node's arrivals: the leader's
                    names += [f"{b}-{gen}" for b in ("stopped", "started", "failed")]
            for name in names:
                barriers[name], _ = cluster.barrier_state(name, cached=True)
            safe = None
            if self._clock.monotonic() - self._vs.safe_read_s >= SAFE_EVERY_S:
                self._vs.safe_read_s = self._clock.monotonic()
                safe, _ = cluster.read_safe(cached=True)
        except ClusterUnavailableError as exc:
            self._etcd_down(exc)
            return
        except ClusterDataError as exc:
            # The generation record itself is unreadable (corrupt, or a newer format): keep
            # the last view and keep training; acting on a guess could break the fencing.
            self.cluster.skip_value(self.cluster.keys.generation, exc)
            return
        finally:
            self._count_skipped()
            self._count_requests()
        read = EtcdRead(members, record, rev, leader, barriers, safe, complete=leading)
        dead = frozenset(self._lvs.dead_now(self._vs.members))
        now_s, wall_s = self._clock.monotonic(), self._clock.time()
        self._execute(view_step(self._vs, read, dead=dead, now_s=now_s, wall_s=wall_s))

    def _member_records(self, nodes: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The member records of `nodes` (registered ones), on any thread: see
        `MemberDirectory`."""

        def read(missing: list[str]) -> dict[str, dict[str, Any]]:
            return self.cluster.member_records(missing)

        return self._directory.records(nodes, self._vs, read)

    def _follower_members(self, leader: str | None, term: int) -> dict[str, dict[str, Any]]:
        """A follower's members: its own record (cached: its key is watched) and the
        leader's, read by key when the leader's term changes (a restarted leader elected
        again is a new term), or while it is missing. The same object while neither
        changed."""
        own = self.cluster.member_records([self.node_id])
        held_leader, held_term, held = self._vs.leader_member
        if leader is None or leader == self.node_id:
            held = {}
        elif (leader, term) != (held_leader, held_term) or not held:
            held = self.cluster.member_records([leader])
        self._vs.leader_member = (leader, term, held)
        members = {**held, **own}
        if not self._vs.members_complete and members == self._vs.members:
            return self._vs.members
        return members

    def _check_epoch(self) -> None:
        """The job's epoch key changed, or the generation record vanished: if the epoch this
        agent joined is gone (etcd wiped, the job's prefix deleted), its generation numbering
        is gone with it; stop, so that a restart joins the new epoch."""
        self._epoch_changed.take()
        try:
            current = self.cluster.epoch()
        except ClusterDataError as exc:
            self.cluster.skip_value(self.cluster.keys.epoch, exc)
            return
        if current is not None and current.epoch == self.store.epoch:
            return
        self.journal.write(
            "decision",
            f"the job's etcd state started afresh (epoch {self.store.epoch} is gone"
            + ("" if current is None else f", epoch {current.epoch} began")
            + "): stopping; started again, this agent joins the new epoch and the job "
            "resumes from the state the nodes hold",
        )
        self._vs.exit_code = EPOCH_ENDED_EXIT
