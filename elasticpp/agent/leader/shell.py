"""The leader part of the agent: one agent plans for the job.

It acts only while its term holds (`Leadership.is_held()` and the leader key still names it).
`Leader` is the shell: campaigning and stepping down (I/O), the rendezvous store the term
hosts, and `lead`, which has suspects probed, judges the nodes' health (`_judge_health`: the
health part carries the decisions out), builds a `LeaderObservation` and hands the actions
of the pure step (`step.leader_step`) to the executor. The handlers of those actions are
registered here, one method per action: each writes the leader's records by compare-and-swap
under its term (or reads what its step asked for), starts the holdings pull (`pull`, on a
thread of its own), resolves where resume state comes from, and feeds the outcome back to
the step functions. The step writes each generation by compare-and-swap, resolves where
the resume state comes from and publishes it once as a fenced record any later leader reads,
records the recovery timeline, has what older generations left in etcd removed, and
publishes the safe step (fenced, only when it rises) from the running generation's commit
records; its invariants are in step.py.

`Leader` is built with its ports: the etcd calls it makes (`LeaderCluster`), the clock, the
journal, the metrics, the dialer its pull connects with, and what it reads of the other parts
(`LeaderPorts`: the view's snapshot, the summaries, liveness's probes of suspects, the
follower's detection times). Its state is a plain `LeaderState`, a new one a term; the term's
handle, the rendezvous store, the pull's future and the memos of its view are held here.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import secrets
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from elasticpp.agent.actions import (
    Action,
    CheckNeverCommitted,
    CleanRendezvous,
    CompactHistory,
    CountRecovery,
    Housekeep,
    PublishResumeWait,
    PullHoldings,
    ReadCommitRecords,
    ReadSafe,
    RecordTimeline,
    ResolveResume,
    SetAside,
    StepDown,
    WriteGeneration,
    WriteResume,
    WriteSafe,
)
from elasticpp.agent.health.step import as_quarantined, report_of
from elasticpp.agent.jobspec import JobSpec
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.decide import ClusterView, NodeLists, lost_nodes, node_lists
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.journal import Journal
from elasticpp.agent.kernel.limits import PULL_NODE_TIMEOUT_S, PULL_PARALLEL
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.records import Record
from elasticpp.agent.kernel.summaries import (
    ControlSummary,
    FollowerSummary,
    HealthSummary,
    LeaderSummary,
    LivenessSummary,
)
from elasticpp.agent.kernel.threads import run_in_thread
from elasticpp.agent.leader.deadlines import pull_deadline_s
from elasticpp.agent.leader.pull import pull_holdings
from elasticpp.agent.leader.state import (
    LeaderState,
    PulledHoldings,
    campaign_delay_s,
    campaign_spread_s,
)
from elasticpp.agent.leader.step import (
    LeaderObservation,
    leader_fresh_checked,
    leader_generation_written,
    leader_pull_started,
    leader_resume_resolved,
    leader_resume_wait_published,
    leader_resume_written,
    leader_safe_read,
    leader_safe_step,
    leader_safe_written,
    leader_step,
    leader_timeline_recorded,
)
from elasticpp.agent.sick import SickNodes
from elasticpp.agent.view.step import ViewSnapshot
from elasticpp.checkpoint.manifest import JobIdentity
from elasticpp.cluster.barriers import failed_barrier
from elasticpp.cluster.leases import Leadership, ProgressGate
from elasticpp.cluster.records import (
    CommitRecord,
    GenerationRecord,
    QuarantineRecord,
    SafeStep,
)
from elasticpp.errors import ElasticppError
from elasticpp.store.checkpoints import checkpoint_holdings
from elasticpp.store.client import StateClient
from elasticpp.transport import Dialer

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

log = logging.getLogger("elasticpp.agent")

# A key of the rendezvous store: workers of generation G use the prefix `gen<G>-<token>`
# (`GenerationRecord.rendezvous_prefix`; `gen<G>` in records of earlier releases).
_GEN_KEY = re.compile(r"gen([0-9]{1,19})(?:-[0-9a-f]{32})?/")


class LeaderCluster(Protocol):
    """The etcd calls of the leader part (elasticpp.cluster.client.ClusterClient has them)."""

    def campaign(
        self,
        node_id: str,
        ttl_s: float = ...,
        on_lost: Callable[[], None] | None = ...,
        gate: ProgressGate | None = ...,
    ) -> Leadership | None: ...
    def write_generation(
        self, record: GenerationRecord, expected_mod_revision: int, leader: Leadership | str
    ) -> bool: ...
    def cache_for_leader(self, on: bool) -> None: ...
    @property
    def arrivals(self) -> ResumeWrites: ...
    @property
    def commits(self) -> LeaderCommits: ...


class ResumeWrites(Protocol):
    """The leader's resume instructions (elasticpp.cluster.arrivals.Arrivals)."""

    def write_resume(self, generation: int, value: Record, leader: Leadership) -> bool: ...
    def write_resume_wait(self, generation: int, why: str, leader: Leadership) -> bool: ...


class LeaderCommits(Protocol):
    """The commit records, safe step, history and timelines the leader reads and writes
    (elasticpp.cluster.commits.Commits)."""

    def record_timeline(self, generation: int, timeline: Record, leader: Leadership) -> bool: ...
    def housekeep(
        self, generation: int, *, keep_history: int = ..., leader: Leadership | None = ...
    ) -> int: ...
    def compact_history(self, leader: Leadership) -> int | None: ...
    def ever_committed(self) -> bool: ...
    def commit_records(self, generation: int, *, cached: bool = ...) -> dict[str, CommitRecord]: ...
    def read_safe(self, *, cached: bool = ...) -> tuple[SafeStep | None, int]: ...
    def write_safe(
        self, safe: SafeStep, expected_mod_revision: int, leader: Leadership
    ) -> bool: ...


@dataclass(frozen=True)
class LeaderConfig:
    node_id: str
    advertise_host: str  # the rendezvous store listens there
    job: JobIdentity | None  # the job the store's and the checkpoint's pieces are of


@dataclass(frozen=True)
class LeaderPorts:
    """What the leader reads of the other parts, and asks of them."""

    view: Callable[[], ViewSnapshot]  # this turn's snapshot of what etcd holds
    reread: Callable[[], None]  # the view reads etcd again now
    follower: Callable[[], FollowerSummary]  # the generation this node follows
    detected: Callable[[], Mapping[int, float]]  # the follower's detection times
    control: Callable[[], ControlSummary]
    health: Callable[[], HealthSummary]
    quarantines: Callable[[], Mapping[str, QuarantineRecord]]
    liveness: Callable[[], LivenessSummary]
    dead_now: Callable[[Mapping[str, Record]], set[str]]  # liveness's verdicts
    settle_probes: Callable[[], None]  # liveness takes the verdicts of finished probes
    confirm_suspects: Callable[[int, Iterable[str]], bool]  # True: wait for the verdicts
    fenced: Callable[[], bool]  # this node's registration may have lapsed
    leaving: Callable[[], bool]  # the agent is to exit (no campaign)
    torch_ready: Callable[[], bool]  # the rendezvous store can be hosted
    lease_gate: Callable[[], ProgressGate]  # a term's lease is renewed only through it
    epoch: Callable[[], int]  # the job's epoch as this node's store knows it
    execute: Callable[[Sequence[Action]], None]
    wake: Callable[[], None]


def _listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on `host` (an address or a name), a free port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(address)
    sock.listen(1024)
    return sock


class RendezvousStore:
    """The workers' rendezvous store a term hosts (torch's TCPStore), with the socket it
    listens on, kept open for the term."""

    def __init__(self, store: TCPStore, address: str, sock: socket.socket | None = None) -> None:
        self.store = store
        self.address = address  # host:port, as the generation record names it
        self._socket = sock

    @classmethod
    def start(cls, host: str) -> RendezvousStore:
        """A store listening on `host` alone: given a host, torch's store still binds every
        interface, so the socket is made here and handed over."""
        from torch._C._distributed_c10d import TCPStore

        sock = _listening_socket(host)
        store = TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
            master_listen_fd=sock.fileno(),
        )
        return cls(store, f"{host}:{store.port}", sock)

    def clean(self, generation: int) -> None:
        """Delete the rendezvous keys of generations before `generation` (prefix `gen<G>/`):
        no worker of an older one meets there again, and the store of a term that lasts
        weeks must not keep every generation's."""
        try:
            for key in self.store.list_keys():
                m = _GEN_KEY.match(key)
                if m is not None and int(m.group(1)) < generation:
                    self.store.delete_key(key)
        except RuntimeError as exc:  # best effort: the keys go with the next generation
            log.warning("leader: rendezvous keys of old generations not deleted: %s", exc)


class Leader:
    """The leader part: campaigns, leads the generations of its term, steps down."""

    def __init__(
        self,
        config: LeaderConfig,
        *,
        spec: JobSpec,
        clock: Clock,
        journal: Journal,
        metrics: AgentMetrics,
        cluster: LeaderCluster,
        dialer: Dialer,
        ports: LeaderPorts,
    ) -> None:
        self.config = config
        self.state = LeaderState(SickNodes(spec.sick_policy()))  # a new term starts a new one
        self._spec = spec
        self._clock = clock
        self._journal = journal
        self._metrics = metrics
        self._cluster = cluster
        self._dialer = dialer
        self._ports = ports
        self._leadership: Leadership | None = None  # the term, while this node holds it
        self._rendezvous: RendezvousStore | None = None  # the workers' store of the term
        self._pull: Future[PulledHoldings] | None = None  # the holdings pull, once asked
        # The steady leader's view, remembered while its inputs are the same objects (a
        # cached read that did not change is the same object): (record, members, restarted
        # nodes) and (members, incarnations). Recomputing them cost every tick O(N) hashes
        # and dicts. (members, dead, quarantined, their `decide.NodeLists`): sorting every
        # member and looking at each was ~4 ms of every leader turn at 2,048 nodes.
        self._restarted_memo: (
            tuple[GenerationRecord, Mapping[str, Record], frozenset[str]] | None
        ) = None
        self._incarnations_memo: tuple[Mapping[str, Record], dict[str, str]] | None = None
        self._lists_memo: (
            tuple[
                Mapping[str, Record],
                tuple[frozenset[str], frozenset[str], frozenset[str]],
                NodeLists,
            ]
            | None
        ) = None

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only the leader's steps emit, and the step-down."""
        executor.register(WriteGeneration, self._write_generation)
        executor.register(PullHoldings, self._start_pull)
        executor.register(ResolveResume, self._resolve_resume)
        executor.register(CheckNeverCommitted, self._check_never_committed)
        executor.register(WriteResume, self._write_resume)
        executor.register(PublishResumeWait, self._publish_resume_wait)
        executor.register(RecordTimeline, self._record_timeline)
        executor.register(Housekeep, self._housekeep)
        executor.register(CleanRendezvous, lambda a: self._clean_rendezvous(a.generation))
        executor.register(CompactHistory, self._compact_history)
        executor.register(CountRecovery, self._count_recovery)
        executor.register(ReadCommitRecords, self._read_commit_records)
        executor.register(ReadSafe, self._read_safe)
        executor.register(WriteSafe, self._write_safe)
        executor.register(StepDown, lambda a: self.step_down(a.why))

    # ------------------------------------------------------------------ what others read
    def summary(self) -> LeaderSummary:
        ls = self.state
        return LeaderSummary(
            leading=self._leadership is not None,
            generation=ls.generation,
            timeline_written=ls.timeline_written,
            campaign_at_s=ls.campaign_at_s,
        )

    @property
    def leadership(self) -> Leadership | None:
        """The term's handle while this node holds it (the health part's fenced writes go
        under it): read it, never resign it."""
        return self._leadership

    def acting(self) -> bool:
        """Whether this node acts as the leader now. Only while the term is held: a loop that
        stalled past the lease TTL, or whose keep-alive failed, must not write on the
        strength of what it read before. Nor while its own membership is lost or not yet
        seen again: it would re-plan without itself, then again when its key is back (two
        generations for one blip)."""
        view = self._ports.view()
        node_id = self.config.node_id
        return (
            self._leadership is not None
            and self._leadership.is_held()
            and view.leader == node_id
            and node_id in view.members
            and not self._ports.fenced()
        )

    # ------------------------------------------------------------------ the term
    def campaign(self) -> None:
        """Deposed (the key deleted or taken) or lapsed: the old term is resigned before any
        new campaign, so no keep-alive thread or lease outlives its term. Without a leader,
        campaign when this node's turn in the spread comes."""
        view, ls = self._ports.view(), self.state
        deposed = view.leader != self.config.node_id
        if self._leadership is not None and (deposed or not self._leadership.is_held()):
            self.step_down("lost the leadership")
            return
        if self._leadership is not None:
            return  # won; the view reads the leader key on the next refresh
        if view.leader is not None or self._ports.control().draining or self._ports.leaving():
            ls.campaign_at_s = None  # a leader is known: the next loss draws afresh
            return
        if not self._ports.torch_ready():
            return  # the leader hosts the rendezvous store; wait until torch is imported
        now_s = self._clock.monotonic()
        record = view.record
        nodes = len(record.planned_nodes) if record is not None else 1
        if ls.campaign_at_s is None:  # spread over the nodes that see no leader
            ls.campaign_at_s = now_s + campaign_delay_s(nodes, random.random())
        if now_s < ls.campaign_at_s:
            return
        leadership = self._cluster.campaign(
            self.config.node_id, ttl_s=self._spec.lease_ttl_s, gate=self._ports.lease_gate()
        )
        if leadership is None:
            # Lost: another node holds the key, which the view will show; until it does,
            # no new campaign (it would lose again): a leader that lapses meanwhile is
            # campaigned for after a full spread.
            ls.campaign_at_s = now_s + campaign_spread_s(nodes)
            return
        try:
            rendezvous = RendezvousStore.start(self.config.advertise_host)
        except BaseException:
            with contextlib.suppress(ElasticppError):
                leadership.resign()  # a term without its store is no term: the next one
            raise
        self.begin_term(leadership, rendezvous)

    def begin_term(self, leadership: Leadership, rendezvous: RendezvousStore | None) -> None:
        """A won campaign's term begins, hosting `rendezvous` (None: no worker of this node's
        job meets there, as in the simulation). The leader's state starts afresh, the failure
        budget too; strikes go on from the newest record, quarantines and what each
        generation's transition has written are read from etcd."""
        record = self._ports.view().record
        sick = SickNodes(self._spec.sick_policy())
        if record is not None:
            sick.seed(record.extra.get("strikes"))
        # A secret of the term's: each generation's rendezvous prefix is derived from it.
        self.state = LeaderState(sick, rendezvous_secret=secrets.token_hex(16))
        self._leadership = leadership
        self._rendezvous = rendezvous
        self._pull = None
        self._ports.reread()  # the view (the one writer of `leader`) reads the key now
        self._journal.write("decision", f"node {self.config.node_id} is the leader")

    def step_down(self, why: str) -> None:
        """End this node's term (resign: its lease is revoked, so a successor can win at
        once). The leader the view knows is the view's to write: it reads the key again."""
        if self._leadership is None:
            return
        self._journal.write("decision", f"node {self.config.node_id} {why}: leadership resigned")
        with contextlib.suppress(ElasticppError):
            self._leadership.resign()
        self._leadership = None
        self._ports.reread()

    def close(self) -> None:
        """Resign the term, if this node holds one (the agent is stopping)."""
        if self._leadership is not None:
            with contextlib.suppress(ElasticppError):
                self._leadership.resign()

    def _clean_rendezvous(self, generation: int) -> None:
        """Once every rank of `generation` has started: the older generations' keys go."""
        if self._rendezvous is not None:
            self._rendezvous.clean(generation)

    # ------------------------------------------------------------------ the view it leads by
    def _restarted(
        self, rec: GenerationRecord | None, members: Mapping[str, Record]
    ) -> frozenset[str]:
        """The planned nodes whose agent restarted, computed again only when the record or
        the members changed (both are replaced, never changed in place, on a new read)."""
        if rec is None:
            return frozenset()
        memo = self._restarted_memo
        if memo is not None and memo[0] is rec and memo[1] is members:
            return memo[2]
        restarted = frozenset(rec.reregistered(members))
        self._restarted_memo = (rec, members, restarted)
        return restarted

    def cluster_view(self) -> ClusterView:
        """The cluster as the leader decides on it: the view's members, liveness's dead
        nodes, the quarantines, the newest joins."""
        snap = self._ports.view()
        rec = snap.record
        current = rec.planned_sorted if rec else None
        failed = set(snap.barriers.get(failed_barrier(rec.generation), {})) if rec else set()
        members = snap.members
        dead = frozenset(n for n in self._ports.dead_now(members) if n in members)
        restarted = self._restarted(rec, members)
        quarantined = frozenset(self._ports.quarantines())
        health = self._ports.health()
        cordoned = health.cordoned
        return ClusterView(
            members=members,
            dead=dead,
            current_nodes=current,
            failed=failed,
            now_s=self._clock.monotonic(),
            # planned again after the settle window: a join, a revived node, a re-admission
            last_join_s=max(
                snap.last_join_s, self._ports.liveness().revived_s, health.readmitted_s
            ),
            job_done=self._ports.control().job_done or health.ended is not None,
            restarted=restarted,
            quarantined=quarantined,
            cordoned=cordoned,
            lists=self._node_lists(members, dead, quarantined, cordoned),
        )

    def _node_lists(
        self,
        members: Mapping[str, Record],
        dead: frozenset[str],
        quarantined: frozenset[str],
        cordoned: frozenset[str],
    ) -> NodeLists:
        """The view's live nodes and candidates (`decide.node_lists`), computed again only
        when the members (replaced, never changed in place, on a new read), the dead, the
        quarantined or the cordoned nodes changed."""
        memo = self._lists_memo
        if memo is not None and memo[0] is members and memo[1] == (dead, quarantined, cordoned):
            return memo[2]
        lists = node_lists(members, dead, quarantined, cordoned)
        self._lists_memo = (members, (dead, quarantined, cordoned), lists)
        return lists

    # ------------------------------------------------------------------ the leader's cycle
    def lead(self) -> None:
        """The leader's cycle: probes and health decisions first (their results are in the
        view the step sees), then the pure step (`step.leader_step`), whose actions the
        executor applies, feeding the outcomes of writes and reads back to it."""
        self._ports.settle_probes()  # the verdicts of the probes finished since the last cycle
        rec = self._ports.view().record
        view = self.cluster_view()
        if rec is not None and view.failed and not (view.dead & set(view.current_nodes or ())):
            # Suspicion (a worker failure) is confirmed by probing before the TTL lapses;
            # results are kept for DEAD_RECHECK_S (live answers of a large round longer,
            # `liveness.paced_keep_s`), so a failure that waits is no probe storm.
            if self._ports.confirm_suspects(rec.generation, view.current_nodes or ()):
                return  # re-planned once the first round's verdicts are in
            view = self.cluster_view()
        view = self.judge_health(view)
        if self._ports.health().ended is not None:
            return
        self._ports.execute(leader_step(self.state, self.observation(view)))

    def observation(self, view: ClusterView) -> LeaderObservation:
        """What the leader's step sees now: `view`, and what the view and the follower
        know (read, not copied: the step writes none of it)."""
        snap = self._ports.view()
        followed = self._ports.follower()
        return LeaderObservation(
            now_s=self._clock.monotonic(),
            wall_s=self._clock.time(),
            node_id=self.config.node_id,
            view=view,
            record=snap.record,
            record_rev=snap.record_rev,
            members=snap.members,
            barriers=snap.barriers,
            detected=(snap.detected, self._ports.detected()),
            followed=followed.record,
            followed_plan=followed.plan,
            spec=self._spec,
            store_address=self._rendezvous.address if self._rendezvous else None,
            pulled=self._pulled(),
            refused=self._refused(snap.record, followed),
        )

    def _refused(self, rec: GenerationRecord | None, followed: FollowerSummary) -> str | None:
        """Why the newest record's plan cannot be followed here (made for another model, or
        unreadable), if this node's follower did not enter it; None when it is followed."""
        if rec is None or (followed.record is not None and followed.generation >= rec.generation):
            return None
        try:
            self._spec.plan_of(rec.plan)  # shared: the follower's read of the same record
        except (ElasticppError, KeyError, TypeError, ValueError) as exc:
            return str(exc)
        return None

    def judge_health(self, view: ClusterView) -> ClusterView:
        """Judge the current generation's failure (once), re-admit nodes whose quarantine
        is over; returns the view with the quarantines applied."""
        sick = self.state.sick
        published = {n: as_quarantined(r) for n, r in self._ports.quarantines().items()}
        if published != sick.quarantined:
            for n in set(sick.quarantined) - set(published):
                sick.lifted(n)  # an operator lifted it, or a new term reads etcd
            sick.load(published)
        snap = self._ports.view()
        members = snap.members
        memo = self._incarnations_memo
        if memo is not None and memo[0] is members:
            incarnations = memo[1]
        else:
            incarnations = {n: str(i.get("incarnation", "")) for n, i in members.items()}
            self._incarnations_memo = (members, incarnations)
        now = self._clock.time()
        actions = sick.expire(incarnations, now)
        rec = snap.record
        if rec is not None and view.current_nodes is not None:
            current = set(view.current_nodes)
            lost = lost_nodes(view)
            failed = snap.barriers.get(failed_barrier(rec.generation), {})
            reports = [report_of(n, v) for n, v in failed.items() if n in current]
            if lost or reports:
                actions += sick.judge(rec.generation, reports, incarnations, now, lost=lost)
            # A node of the generation that answered a probe NOT_SERVING has a stalled
            # decision loop (elasticpp.agent.liveness): it would fail every plan it is in.
            unhealthy = self._ports.liveness().unhealthy
            for node in sorted(current & set(unhealthy)):
                if unhealthy[node] == incarnations.get(node):
                    actions += sick.not_serving(node, incarnations[node], now)
        if actions:
            self._ports.execute([SetAside(tuple(actions))])
        return self.cluster_view()

    # ------------------------------------------------------------------ the holdings pull
    def _pull_holdings(self, action: PullHoldings) -> PulledHoldings:
        """The holdings pull (elasticpp.agent.leader.pull), on a thread of its own: it writes
        no part's state; its result is read by `observation`."""
        return pull_holdings(
            action.generation,
            self._ports.epoch(),
            action.digests,
            action.units,
            action.live_nodes,
            action.persist_dir,
            self.config.job,
            known=action.known,
            parallel=PULL_PARALLEL,
            node_timeout_s=PULL_NODE_TIMEOUT_S,
            deadline_s=pull_deadline_s(len(action.digests)),
            connect=lambda address: StateClient(address, dialer=self._dialer),
        )

    def _pulled(self) -> PulledHoldings | None:
        """The followed generation's pull, once it is back (an error in it as its result)."""
        future = self._pull
        if future is None or not future.done() or not self.state.pull_asked:
            return None
        exc = future.exception()
        if exc is not None:
            return PulledHoldings(self.state.generation, error=f"{type(exc).__name__}: {exc}")
        return future.result()

    # ------------------------------------------------------------------ the handlers
    def _term(self) -> Leadership:
        """The term a fenced write goes under: the leader's steps run only while it is held
        (`acting`), so there is one."""
        if self._leadership is None:
            raise ElasticppError("leader: a write of the leader's without a term")
        return self._leadership

    def _write_generation(self, action: WriteGeneration) -> list[Action]:
        ok = self._cluster.write_generation(action.record, action.expected_rev, self._term())
        return leader_generation_written(self.state, action, ok)

    def _start_pull(self, action: PullHoldings) -> list[Action]:
        future: Future[PulledHoldings] = run_in_thread("pull-holdings", self._pull_holdings, action)
        future.add_done_callback(lambda _: self._ports.wake())
        actions = leader_pull_started(self.state, action)
        if self.state.pull_asked:
            self._pull = future
        return actions

    def _resolve_resume(self, action: ResolveResume) -> list[Action]:
        disk = action.disk
        if action.persist_dir and Path(action.persist_dir).is_dir():
            disk = checkpoint_holdings(Path(action.persist_dir), self.config.job)
        return leader_resume_resolved(self.state, action, disk)

    def _check_never_committed(self, action: CheckNeverCommitted) -> list[Action]:
        return leader_fresh_checked(self.state, action, self._cluster.commits.ever_committed())

    def _write_resume(self, action: WriteResume) -> list[Action]:
        ok = self._cluster.arrivals.write_resume(
            action.generation, dict(action.value), self._term()
        )
        self._ports.reread()
        return leader_resume_written(self.state, action, ok)

    def _publish_resume_wait(self, action: PublishResumeWait) -> list[Action]:
        ok = self._cluster.arrivals.write_resume_wait(action.generation, action.why, self._term())
        self._ports.reread()
        return leader_resume_wait_published(self.state, action, ok)

    def _record_timeline(self, action: RecordTimeline) -> list[Action]:
        ok = self._cluster.commits.record_timeline(
            action.generation, dict(action.timeline), self._term()
        )
        return leader_timeline_recorded(self.state, action, ok)

    def _housekeep(self, action: Housekeep) -> None:
        removed = self._cluster.commits.housekeep(action.generation, leader=self._term())
        if removed:
            log.info("leader: removed %d etcd key(s) of older generations", removed)

    def _compact_history(self, action: CompactHistory) -> None:
        compacted = self._cluster.commits.compact_history(self._term())
        if compacted is not None:
            log.info("leader: etcd history compacted to revision %d", compacted)

    def _count_recovery(self, action: CountRecovery) -> None:
        m = self._metrics
        m.recoveries_total.labels(**m.labels).inc()
        m.recovery_seconds.labels(**m.labels).observe(action.seconds)

    def _read_commit_records(self, action: ReadCommitRecords) -> list[Action]:
        # From the cache (no read of every node's record twice a second): a record a watch
        # delivery old gives a safe step no newer than a fresh one would.
        self._cluster.cache_for_leader(True)
        records = self._cluster.commits.commit_records(action.generation, cached=True)
        return leader_safe_step(action, records)

    def _read_safe(self, action: ReadSafe) -> list[Action]:
        # A cached value may be a delivery old: the write compares its revision.
        current, revision = self._cluster.commits.read_safe(cached=True)
        return leader_safe_read(action, current, revision)

    def _write_safe(self, action: WriteSafe) -> list[Action]:
        ok = self._cluster.commits.write_safe(action.safe, action.expected_rev, self._term())
        return leader_safe_written(action, ok)
