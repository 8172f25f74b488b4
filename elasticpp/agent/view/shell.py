"""The agent's view of the cluster: members, the generation record, the leader and the
barriers of the current generation (the resume instruction; every node's arrivals,
`stopped-G`, `started-G`, `stepped-G` and `failed-G`, only on the leader: a follower reads
none of them, so a transition's N arrivals reach one node, not N), and the published safe
step (at most every `SAFE_EVERY_S`), which becomes the store's floor. The decision loop
takes them (on a watch event, and at least every second) from the job's watch-fed cache
(`elasticpp.cluster.cache`): in steady state the view sends etcd no request at all; it reads
a range again only when its watch lost events, and parses a record again only when it
changed (`ClusterClient` keeps what it derived from an unchanged cached answer).
What must be current is fenced where it is written (the generation's compare-and-swap, the
resume's and the safe step's transactions), so a view one watch delivery old is safe.
An unreachable etcd (or a watch that is down) keeps the last view (training goes on, changes
wait); an unreadable generation record keeps it too, since acting on a guess could break the
fencing; joins and losses are noted for the recovery timeline. When the job epoch
this agent joined is gone (the job's etcd state started afresh under it), the agent stops
(`View.check_epoch`, exit status `EPOCH_ENDED_EXIT`).

The view is an object built with its ports: the job's etcd client (`ViewCluster`: the reads
it makes), the clock, the journal and the metrics. Its decisions are `view.step.view_step`'s;
other parts read what it knows through `View.snapshot` (frozen) and `View.summary`, and ask
for a fresh read by raising `View.reread`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from types import MappingProxyType
from typing import Protocol

from elasticpp.agent.actions import Action, Reread, SetFloor, UpdateGauges
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.inbox import Signal
from elasticpp.agent.kernel.journal import Journal
from elasticpp.agent.kernel.limits import SAFE_EVERY_S
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.records import Record
from elasticpp.agent.kernel.summaries import ViewSummary
from elasticpp.agent.view.step import (
    EPOCH_ENDED_EXIT,
    EtcdRead,
    ViewSnapshot,
    ViewState,
    view_step,
)
from elasticpp.cluster.barriers import resume_barrier
from elasticpp.cluster.errors import ClusterDataError, ClusterUnavailableError
from elasticpp.cluster.keys import JobKeys
from elasticpp.cluster.records import GenerationRecord, JobEpoch, Members, SafeStep

log = logging.getLogger("elasticpp.agent")


class BarrierReads(Protocol):
    """Who arrived at a barrier (elasticpp.cluster.arrivals.Arrivals)."""

    def barrier_state(self, name: str, *, cached: bool = ...) -> tuple[Record, int]: ...


class SafeReads(Protocol):
    """The job's safe step (elasticpp.cluster.commits.Commits)."""

    def read_safe(self, *, cached: bool = ...) -> tuple[SafeStep | None, int]: ...


class ViewCluster(Protocol):
    """The etcd operations the view makes (elasticpp.cluster.ClusterClient has them)."""

    @property
    def keys(self) -> JobKeys: ...
    @property
    def skipped_values(self) -> int: ...
    @property
    def arrivals(self) -> BarrierReads: ...
    @property
    def commits(self) -> SafeReads: ...
    def cache_for_leader(self, leading: bool) -> None: ...
    def sync_cache(self) -> None: ...
    def read_generation(self, *, cached: bool = ...) -> tuple[GenerationRecord | None, int]: ...
    def leader_term(self, *, cached: bool = ...) -> tuple[str | None, int]: ...
    def agent_members(self, *, cached: bool = ...) -> Members: ...
    def member_records(self, nodes: list[str]) -> Mapping[str, Record]: ...
    def skip_value(self, key: str, exc: Exception) -> None: ...
    def etcd_requests(self) -> dict[str, int]: ...
    def epoch(self) -> JobEpoch | None: ...


class MemberDirectory:
    """The member records of the nodes a part needs (its fetch sources, its replication
    peers), for threads as well as the loop: from the view where it holds every member
    (the leader), else read by key once per generation and kept (a node that registers
    again under another incarnation is a new generation: the leader re-plans for it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = -1
        self._held: dict[str, Record] = {}

    def records(
        self,
        nodes: Iterable[str],
        view: ViewState,
        read: Callable[[list[str]], Mapping[str, Record]],
    ) -> Mapping[str, Record]:
        """The records of `nodes` that are registered; `read` reads missing ones by key."""
        members = view.members  # replaced whole by the view, never changed in place
        out: dict[str, Record] = {n: members[n] for n in sorted(set(nodes)) if n in members}
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


class View:
    """The view part: what this agent knows of etcd, read on the loop."""

    def __init__(
        self,
        node_id: str,
        *,
        cluster: ViewCluster,
        clock: Clock,
        journal: Journal,
        metrics: AgentMetrics,
        epoch: Callable[[], int | None],
        set_floor: Callable[[int, int], object] = lambda step, generation: None,
    ) -> None:
        self.node_id = node_id
        self._set_floor = set_floor  # the store's: anchors below the safe step may go
        self.state = ViewState(last_join_s=clock.monotonic())
        self.reread = Signal(raised=True)  # read etcd again (watches, other parts raise it)
        self.epoch_changed = Signal()  # the job's epoch key changed
        self._cluster = cluster
        self._clock = clock
        self._journal = journal
        self._metrics = metrics
        self._epoch = epoch  # the epoch this agent's store commits in (set at join)
        self._directory = MemberDirectory()  # the members a follower reads by key

    def register(self, executor: Executor) -> None:
        """The handlers of the actions the view carries out: a read of etcd again (any part
        may ask: a deposed leader, a node on a newer generation), and the safe step handed
        to the store."""
        executor.register(Reread, lambda _: self.reread.raise_())
        executor.register(SetFloor, self._floor)

    def _floor(self, action: SetFloor) -> None:
        self._set_floor(action.step, action.generation)

    # ------------------------------------------------------------------ what others read
    @property
    def snapshot(self) -> ViewSnapshot:
        s = self.state
        return ViewSnapshot(
            members=s.members,
            members_complete=s.members_complete,
            record=s.record,
            record_rev=s.record_rev,
            leader=s.leader,
            barriers=s.barriers,
            etcd_ok=s.etcd_ok,
            last_refresh_s=s.last_refresh_s,
            last_join_s=s.last_join_s,
            detected=MappingProxyType(s.detected),  # read-only, not a copy: taken often
            exit_code=s.exit_code,
        )

    def summary(self) -> ViewSummary:
        s = self.state
        # A leader reads every member; a follower, which reads only its own and the
        # leader's, says the current generation's nodes.
        members: Collection[str] = (
            s.members.keys() if s.members_complete or s.record is None else s.record.planned_nodes
        )
        return ViewSummary(
            etcd_ok=s.etcd_ok,
            leader=s.leader,
            members=members,
            done=s.barriers.get("done", {}),
            timelines=s.barriers.get("timelines", {}),
        )

    def member_records(self, nodes: Iterable[str]) -> Mapping[str, Record]:
        """The member records of `nodes` (registered ones), on any thread: see
        `MemberDirectory`."""
        return self._directory.records(nodes, self.state, self._cluster.member_records)

    # ------------------------------------------------------------------ the loop's
    def etcd_down(self, exc: Exception) -> list[Action]:
        if self.state.etcd_ok:
            self._journal.write(
                "decision", f"etcd unreachable ({exc}); training continues, changes wait"
            )
        self.state.etcd_ok = False
        return [UpdateGauges()]  # etcd_up to 0: by the control part, which keeps what it set

    def _count_skipped(self) -> None:
        new = self._cluster.skipped_values - self.state.skipped_seen
        if new > 0:
            self.state.skipped_seen += new
            self._metrics.of(self._metrics.etcd_values_skipped_total).inc(new)

    def _count_requests(self) -> None:
        """Bring `elasticpp_etcd_requests_total` up to the client's own counts."""
        for method, count in self._cluster.etcd_requests().items():
            new = count - self.state.requests_seen.get(method, 0)
            if new > 0:
                self.state.requests_seen[method] = count
                self._metrics.of(self._metrics.etcd_requests_total, method=method).inc(new)

    def refresh(
        self, leading: bool, dead_now: Callable[[Mapping[str, Record]], set[str]]
    ) -> list[Action]:
        """Read the job's etcd state (from the watch-fed cache) and take it (`view_step`):
        the actions to execute. `leading`: this node leads (it reads every member and the
        arrivals); `dead_now`: the members the liveness part found dead."""
        self.reread.take()
        self.state.last_refresh_s = self._clock.monotonic()
        cluster = self._cluster
        try:
            # Only the leader caches the nodes' holdings digests and commit records (one read
            # each when its term starts, then their events); a follower knows its own
            # arrival from its write, and needs only the resume record.
            cluster.cache_for_leader(leading)
            cluster.sync_cache()  # reads a range again only if its watch lost events
            record, rev = cluster.read_generation(cached=True)
            leader, term = cluster.leader_term(cached=True)
            members: Mapping[str, Record] = (
                cluster.agent_members(cached=True).nodes
                if leading
                else self._follower_members(leader, term)
            )
            barriers: dict[str, Record] = {}
            names = ["done", "timelines"]
            gen = record.generation if record else 0
            if gen:
                names.append(resume_barrier(gen))
                if leading:  # every node's arrivals: the leader's
                    names += [f"{b}-{gen}" for b in ("stopped", "started", "stepped", "failed")]
            for name in names:
                barriers[name], _ = cluster.arrivals.barrier_state(name, cached=True)
            safe = None
            if self._clock.monotonic() - self.state.safe_read_s >= SAFE_EVERY_S:
                self.state.safe_read_s = self._clock.monotonic()
                safe, _ = cluster.commits.read_safe(cached=True)
        except ClusterUnavailableError as exc:
            return self.etcd_down(exc)
        except ClusterDataError as exc:
            # The generation record itself is unreadable (corrupt, or a newer format): keep
            # the last view and keep training; acting on a guess could break the fencing.
            self._cluster.skip_value(self._cluster.keys.generation, exc)
            return []
        finally:
            self._count_skipped()
            self._count_requests()
        read = EtcdRead(members, record, rev, leader, barriers, safe, complete=leading)
        dead = frozenset(dead_now(self.state.members))
        now_s, wall_s = self._clock.monotonic(), self._clock.time()
        return view_step(self.state, read, dead=dead, now_s=now_s, wall_s=wall_s)

    def _follower_members(self, leader: str | None, term: int) -> Mapping[str, Record]:
        """A follower's members: its own record (cached: its key is watched) and the
        leader's, read by key when the leader's term changes (a restarted leader elected
        again is a new term), or while it is missing. The same object while neither
        changed."""
        own = self._cluster.member_records([self.node_id])
        held_leader, held_term, held = self.state.leader_member
        if leader is None or leader == self.node_id:
            held = {}
        elif (leader, term) != (held_leader, held_term) or not held:
            held = self._cluster.member_records([leader])
        self.state.leader_member = (leader, term, held)
        members = {**held, **own}
        if not self.state.members_complete and members == self.state.members:
            return self.state.members
        return members

    def check_epoch(self) -> None:
        """The job's epoch key changed, or the generation record vanished: if the epoch this
        agent joined is gone (etcd wiped, the job's prefix deleted), its generation numbering
        is gone with it; stop, so that a restart joins the new epoch."""
        self.epoch_changed.take()
        try:
            current = self._cluster.epoch()
        except ClusterDataError as exc:
            self._cluster.skip_value(self._cluster.keys.epoch, exc)
            return
        if current is not None and current.epoch == self._epoch():
            return
        self._journal.write(
            "decision",
            f"the job's etcd state started afresh (epoch {self._epoch()} is gone"
            + ("" if current is None else f", epoch {current.epoch} began")
            + "): stopping; started again, this agent joins the new epoch and the job "
            "resumes from the state the nodes hold",
        )
        self.state.exit_code = EPOCH_ENDED_EXIT
