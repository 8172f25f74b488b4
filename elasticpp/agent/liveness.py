"""The liveness part of the agent: suspicion confirmed by probe.

The leader probes the nodes of a failed generation (a dead agent refuses the connection at
once; a slow reply is retried within a budget) and takes back a node confirmed dead that
answers again. A follower does the same for the leader: a failure left unanswered makes it
probe the leader, and a dead leader's term is deposed so that a new one is elected without
waiting for its lease to lapse.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures

from elasticpp.agent import probe
from elasticpp.agent.limits import DEAD_RECHECK_S, LEADER_SUSPECT_S

log = logging.getLogger("elasticpp.agent")


class LivenessPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _check_leader(self) -> None:
        """Detect by suspicion, confirm by probe, for the leader too: when a failure of the
        current generation has waited LEADER_SUSPECT_S without a new plan, a follower probes
        the leader's agent and, if it is dead (a refused connection is final at once),
        deposes its term so that a new leader is elected now, not after its lease lapses."""
        rec, leader = self._record, self._leader
        if rec is None or leader is None or leader == self.node_id:
            return
        failed = self._barriers.get(f"failed-{rec.generation}", {})
        if not failed:
            self._suspect_since.clear()
            return
        now = time.monotonic()
        since = self._suspect_since.setdefault(rec.generation, now)
        if now - since < LEADER_SUSPECT_S or now - self._leader_probed_s < DEAD_RECHECK_S:
            return
        self._leader_probed_s = now
        address = self._members.get(leader, {}).get("address")
        if address and probe.answers(str(address)):
            return
        assert self.cluster is not None
        if self.cluster.depose(leader):
            self._event("decision", f"leader {leader} confirmed dead by probe: deposed")
            self._dead[leader] = str(self._members.get(leader, {}).get("incarnation", ""))
            self._dirty = True

    def _probe(self, nodes: list[str]) -> set[str]:
        """The nodes whose agent does not answer a health check (dead, not just slow)."""

        def check(node: str) -> bool:
            address = self._members.get(node, {}).get("address")
            return bool(address) and probe.answers(str(address))

        others = [n for n in nodes if n != self.node_id]
        with futures.ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
            alive = dict(zip(others, pool.map(check, others), strict=True))
        return {n for n, ok in alive.items() if not ok}

    def _recheck_dead(self) -> None:
        """A node confirmed dead that still holds its registration is probed again now and
        then: if it answers (it was only slow or stopped for a while), it is no longer dead,
        and the leader takes it back as it would a joining node."""
        now = time.monotonic()
        if not self._dead or now - self._dead_checked_s < DEAD_RECHECK_S:
            return
        self._dead_checked_s = now
        registered = [
            n for n, inc in self._dead.items() if self._members.get(n, {}).get("incarnation") == inc
        ]
        back = set(registered) - self._probe(registered)
        for n in sorted(back):
            del self._dead[n]
            self._last_join_s = now
            self._event("decision", f"node {n} answers again: no longer dead")

    def _confirm_dead(self, nodes: list[str]) -> None:
        for n in self._probe(nodes):
            inc = str(self._members.get(n, {}).get("incarnation", ""))
            if self._dead.get(n) != inc:
                self._dead[n] = inc
                self._event("decision", f"node {n} confirmed dead by probe")
