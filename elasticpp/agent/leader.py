"""The leader part of the agent: one agent plans for the job.

It acts only while its term holds (`Leadership.is_held()` and the leader key still names it).
This module is the shell: campaigning and stepping down (I/O), the rendezvous store the term
hosts, and `_lead`, which probes suspects, judges the nodes' health (`_lead_health`: the
health part carries the decisions out), builds a `LeaderObservation` and hands the actions
of the pure step
(`leaderstep.leader_step`) to the executor. The step writes each generation by
compare-and-swap, resolves where the resume state comes from and publishes it once as a
fenced record any later leader reads, records the recovery timeline, has what older
generations left in etcd removed, and publishes the safe step (fenced, only when it rises)
from the running generation's commit records; its invariants are in leaderstep.py.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import secrets
import socket
from collections.abc import Mapping
from typing import Any

from elasticpp.agent.actions import PullHoldings, SetAside
from elasticpp.agent.deadlines import pull_deadline_s
from elasticpp.agent.decide import ClusterView, NodeLists, lost_nodes, node_lists
from elasticpp.agent.follower.step import _GenState
from elasticpp.agent.health.step import as_quarantined, report_of
from elasticpp.agent.leaderhandlers import LeaderHandlers
from elasticpp.agent.leaderstate import LeaderState, campaign_delay_s, campaign_spread_s
from elasticpp.agent.leaderstep import LeaderObservation, leader_step
from elasticpp.agent.limits import PULL_NODE_TIMEOUT_S, PULL_PARALLEL
from elasticpp.agent.pull import PulledHoldings, pull_holdings
from elasticpp.agent.sick import SickNodes
from elasticpp.cluster.records import GenerationRecord
from elasticpp.errors import ElasticppError
from elasticpp.store.client import StateClient

log = logging.getLogger("elasticpp.agent")

# A key of the rendezvous store: workers of generation G use the prefix `gen<G>-<token>`
# (`GenerationRecord.rendezvous_prefix`; `gen<G>` in records of earlier releases).
_GEN_KEY = re.compile(r"gen([0-9]{1,19})(?:-[0-9a-f]{32})?/")


def _listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on `host` (an address or a name), a free port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(address)
    sock.listen(1024)
    return sock


class LeaderPart(LeaderHandlers):
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _is_leader(self) -> bool:
        # Acts only while the term is held: a loop that stalled past the lease TTL, or whose
        # keep-alive failed, must not write on the strength of what it read before. Nor while
        # its own membership is lost or not yet seen again: it would re-plan without itself,
        # then again when its key is back (two generations for one blip).
        return (
            self._ls.leadership is not None
            and self._ls.leadership.is_held()
            and self.view.snapshot.leader == self.node_id
            and self.node_id in self.view.snapshot.members
            and not self._fenced()
        )

    def _maybe_campaign(self) -> None:
        # Deposed (the key deleted or taken) or lapsed: the old term is resigned before any
        # new campaign, so no keep-alive thread or lease outlives its term.
        deposed = self.view.snapshot.leader != self.node_id
        if self._ls.leadership is not None and (deposed or not self._ls.leadership.is_held()):
            self._step_down("lost the leadership")
            return
        if self._ls.leadership is not None:
            return  # won; the view reads the leader key on the next refresh
        if (
            self.view.snapshot.leader is not None
            or self.control.summary().draining
            or self._exit_requested() is not None
        ):
            self._ls.campaign_at_s = None  # a leader is known: the next loss draws afresh
            return
        if not self._torch_ready.is_set():
            return  # the leader hosts the rendezvous store; wait until torch is imported
        now_s = self._clock.monotonic()
        record = self.view.snapshot.record
        nodes = len(record.planned_nodes) if record is not None else 1
        if self._ls.campaign_at_s is None:  # spread over the nodes that see no leader
            self._ls.campaign_at_s = now_s + campaign_delay_s(nodes, random.random())
        if now_s < self._ls.campaign_at_s:
            return
        leadership = self.cluster.campaign(
            self.node_id, ttl_s=self.spec.lease_ttl_s, gate=self._lease_gate()
        )
        if leadership is None:
            # Lost: another node holds the key, which the view will show; until it does,
            # no new campaign (it would lose again): a leader that lapses meanwhile is
            # campaigned for after a full spread.
            self._ls.campaign_at_s = now_s + campaign_spread_s(nodes)
            return
        # A new term starts the leader's state afresh, the failure budget too; strikes go on
        # from the newest record, quarantines and what each generation's transition has
        # written are read from etcd.
        sick = SickNodes(self.spec.sick_policy())
        if self.view.snapshot.record is not None:
            sick.seed(self.view.snapshot.record.extra.get("strikes"))
        # A secret of the term's: each generation's rendezvous prefix is derived from it.
        self._ls = LeaderState(sick, leadership=leadership, rendezvous_secret=secrets.token_hex(16))
        self.view.reread.raise_()  # the view (the one writer of `leader`) reads the key now
        self._start_rendezvous_store()
        self.journal.write("decision", f"node {self.node_id} is the leader")

    def _step_down(self, why: str) -> None:
        """End this node's term (resign: its lease is revoked, so a successor can win at
        once). `_leader` is the view's to write: it reads the key again."""
        if self._ls.leadership is None:
            return
        self.journal.write("decision", f"node {self.node_id} {why}: leadership resigned")
        with contextlib.suppress(ElasticppError):
            self._ls.leadership.resign()
        self._ls.leadership = None
        self.view.reread.raise_()

    def _start_rendezvous_store(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        # The store listens on the advertised address alone: given a host, torch's store
        # still binds every interface, so the socket is made here and handed over.
        sock = _listening_socket(self.cfg.advertise_host)
        port = sock.getsockname()[1]
        self._ls.tcpstore = TCPStore(
            self.cfg.advertise_host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
            master_listen_fd=sock.fileno(),
        )
        self._ls.tcpstore_socket = sock  # kept open for the store's term
        self._ls.store_address = f"{self.cfg.advertise_host}:{self._ls.tcpstore.port}"

    def _clean_rendezvous(self, generation: int) -> None:
        """Delete the rendezvous keys of generations before `generation` (prefix `gen<G>/`)
        once every rank of `generation` has started: no worker of an older one meets there
        again, and the store of a term that lasts weeks must not keep every generation's."""
        store = self._ls.tcpstore
        if store is None:
            return
        try:
            for key in store.list_keys():
                m = _GEN_KEY.match(key)
                if m is not None and int(m.group(1)) < generation:
                    store.delete_key(key)
        except RuntimeError as exc:  # best effort: the keys go with the next generation
            log.warning("leader: rendezvous keys of old generations not deleted: %s", exc)

    def _restarted(
        self, rec: GenerationRecord | None, members: dict[str, dict[str, Any]]
    ) -> frozenset[str]:
        """The planned nodes whose agent restarted, computed again only when the record or
        the members changed (both are replaced, never changed in place, on a new read)."""
        if rec is None:
            return frozenset()
        memo = self._ls.restarted_memo
        if memo is not None and memo[0] is rec and memo[1] is members:
            return memo[2]
        restarted = frozenset(rec.reregistered(members))
        self._ls.restarted_memo = (rec, members, restarted)
        return restarted

    def _view(self) -> ClusterView:
        rec = self.view.snapshot.record
        current = rec.planned_sorted if rec else None
        failed = (
            set(self.view.snapshot.barriers.get(f"failed-{rec.generation}", {})) if rec else set()
        )
        members = self.view.snapshot.members
        dead = frozenset(n for n in self.liveness.dead_now(members) if n in members)
        restarted = self._restarted(rec, members)
        quarantined = frozenset(self.health.quarantines())
        return ClusterView(
            members=self.view.snapshot.members,
            dead=dead,
            current_nodes=current,
            failed=failed,
            now_s=self._clock.monotonic(),
            # planned again after the settle window: a join, a revived node, a re-admission
            last_join_s=max(
                self.view.snapshot.last_join_s,
                self.liveness.summary().revived_s,
                self.health.summary().readmitted_s,
            ),
            job_done=self.control.summary().job_done or self.health.summary().ended is not None,
            restarted=restarted,
            quarantined=quarantined,
            lists=self._node_lists(members, dead, quarantined),
        )

    def _node_lists(
        self, members: Mapping[str, Any], dead: frozenset[str], quarantined: frozenset[str]
    ) -> NodeLists:
        """The view's live nodes and candidates (`decide.node_lists`), computed again only
        when the members (replaced, never changed in place, on a new read), the dead or the
        quarantined nodes changed."""
        memo = self._ls.lists_memo
        if memo is not None and memo[0] is members and memo[1] == dead and memo[2] == quarantined:
            return memo[3]
        lists = node_lists(members, dead, quarantined)
        self._ls.lists_memo = (members, dead, quarantined, lists)
        return lists

    def _lead(self) -> None:
        """The leader's cycle: probes and health decisions first (their results are in the
        view the step sees), then the pure step (`leaderstep.leader_step`), whose actions
        the executor applies, feeding the outcomes of writes and reads back to it."""
        self.liveness.probes_done()  # the verdicts of the probes finished since the last cycle
        self.liveness.recheck_dead()
        rec = self.view.snapshot.record
        view = self._view()
        if rec is not None and view.failed and not (view.dead & set(view.current_nodes or ())):
            # Suspicion (a worker failure) is confirmed by probing before the TTL lapses;
            # results are kept for DEAD_RECHECK_S (live answers of a large round longer,
            # `liveness.paced_keep_s`), so a failure that waits is no probe storm.
            if self.liveness.confirm_suspects(rec.generation, view.current_nodes or ()):
                return  # re-planned once the first round's verdicts are in
            view = self._view()
        view = self._lead_health(view)
        if self.health.summary().ended is not None:
            return
        observation = self._leader_observation(view, self.follower.followed())
        self._execute(leader_step(self._ls, observation))

    def _pull_holdings(self, action: PullHoldings) -> PulledHoldings:
        """The holdings pull (elasticpp.agent.pull), on a thread of its own: it writes no
        agent state; its result is read by `_leader_observation`."""
        return pull_holdings(
            action.generation,
            self.store.epoch,
            action.digests,
            action.units,
            action.live_nodes,
            action.persist_dir,
            self.store.job,
            known=action.known,
            parallel=PULL_PARALLEL,
            node_timeout_s=PULL_NODE_TIMEOUT_S,
            deadline_s=pull_deadline_s(len(action.digests)),
            connect=lambda address: StateClient(address, dialer=self._dialer),
        )

    def _pulled(self) -> PulledHoldings | None:
        """The followed generation's pull, once it is back (an error in it as its result)."""
        future = self._ls.pull
        if future is None or not future.done():
            return None
        exc = future.exception()
        if exc is not None:
            return PulledHoldings(self._ls.generation, error=f"{type(exc).__name__}: {exc}")
        result: PulledHoldings = future.result()
        return result

    def _leader_observation(
        self, view: ClusterView, followed: _GenState | None
    ) -> LeaderObservation:
        """What the leader's step sees now: `view`, and what the view and the follower
        know (read, not copied: the step writes none of it)."""
        return LeaderObservation(
            now_s=self._clock.monotonic(),
            wall_s=self._clock.time(),
            node_id=self.node_id,
            view=view,
            record=self.view.snapshot.record,
            record_rev=self.view.snapshot.record_rev,
            members=self.view.snapshot.members,
            barriers=self.view.snapshot.barriers,
            detected=(self.view.snapshot.detected, self.follower.detected()),
            followed=followed.record if followed is not None else None,
            followed_plan=followed.plan if followed is not None else None,
            spec=self.spec,
            store_address=self._ls.store_address,
            pulled=self._pulled(),
            refused=self._refused(followed),
        )

    def _refused(self, followed: _GenState | None) -> str | None:
        """Why the newest record's plan cannot be followed here (made for another model, or
        unreadable), if this node's follower did not enter it; None when it is followed."""
        rec = self.view.snapshot.record
        if rec is None or (followed is not None and followed.generation >= rec.generation):
            return None
        try:
            self.spec.plan_of(rec.plan)  # shared: the follower's read of the same record
        except (ElasticppError, KeyError, TypeError, ValueError) as exc:
            return str(exc)
        return None

    def timelines(self) -> list[dict[str, Any]]:
        values = self.view.snapshot.barriers.get("timelines", {})
        return sorted(values.values(), key=lambda t: int(t.get("generation", 0)))

    def _lead_health(self, view: ClusterView) -> ClusterView:
        """Judge the current generation's failure (once), re-admit nodes whose quarantine
        is over; returns the view with the quarantines applied."""
        sick = self._ls.sick
        published = {n: as_quarantined(r) for n, r in self.health.quarantines().items()}
        if published != sick.quarantined:
            for n in set(sick.quarantined) - set(published):
                sick.lifted(n)  # an operator lifted it, or a new term reads etcd
            sick.load(published)
        members = self.view.snapshot.members
        memo = self._ls.incarnations_memo
        if memo is not None and memo[0] is members:
            incarnations = memo[1]
        else:
            incarnations = {n: str(i.get("incarnation", "")) for n, i in members.items()}
            self._ls.incarnations_memo = (members, incarnations)
        now = self._clock.time()
        actions = sick.expire(incarnations, now)
        rec = self.view.snapshot.record
        if rec is not None and view.current_nodes is not None:
            current = set(view.current_nodes)
            lost = lost_nodes(view)
            failed = self.view.snapshot.barriers.get(f"failed-{rec.generation}", {})
            reports = [report_of(n, v) for n, v in failed.items() if n in current]
            if lost or reports:
                actions += sick.judge(rec.generation, reports, incarnations, now, lost=lost)
            # A node of the generation that answered a probe NOT_SERVING has a stalled
            # decision loop (elasticpp.agent.liveness): it would fail every plan it is in.
            unhealthy = self.liveness.summary().unhealthy
            for node in sorted(current & set(unhealthy)):
                if unhealthy[node] == incarnations.get(node):
                    actions += sick.not_serving(node, incarnations[node], now)
        if actions:
            self._execute([SetAside(tuple(actions))])
        return self._view()
