"""The agent's view of the cluster: members, the generation record, the leader and the
barriers of the current generation, read from etcd by the decision loop (on a watch event,
and at least every second), and the published safe step (at most every `SAFE_EVERY_S`), which
becomes the store's floor. An unreachable etcd keeps the last view (training goes on,
changes wait); an unreadable generation record keeps it too, since acting on a guess could
break the fencing; joins and losses are noted for the recovery timeline. When the job epoch
this agent joined is gone (the job's etcd state started afresh under it), the agent stops
(`_check_epoch`, exit status `EPOCH_ENDED_EXIT`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from elasticpp.agent.limits import SAFE_EVERY_S
from elasticpp.cluster.errors import (
    ClusterDataError,
    ClusterUnavailableError,
)

log = logging.getLogger("elasticpp.agent")

# The exit status of an agent whose job epoch ended under it (EX_TEMPFAIL: start it again;
# a service manager's restart-on-failure does).
EPOCH_ENDED_EXIT = 75


class ViewPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _etcd_down(self, exc: Exception) -> None:
        if self._etcd_ok:
            self._event("decision", f"etcd unreachable ({exc}); training continues, changes wait")
        self._etcd_ok = False
        self.metrics.etcd_up.labels(**self.metrics.labels).set(0)

    def _count_skipped(self) -> None:
        assert self.cluster is not None
        new = self.cluster.skipped_values - self._skipped_seen
        if new > 0:
            self._skipped_seen += new
            self.metrics.etcd_values_skipped_total.labels(**self.metrics.labels).inc(new)

    def _refresh(self) -> None:
        assert self.cluster is not None
        self._dirty = False
        self._last_refresh_s = time.monotonic()
        try:
            members = self.cluster.agent_members().nodes
            record, rev = self.cluster.read_generation()
            leader = self.cluster.leader()
            barriers: dict[str, dict[str, Any]] = {}
            names = ["done", "timelines"]
            gen = record.generation if record else 0
            if gen:
                names += [f"{b}-{gen}" for b in ("stopped", "resume", "started", "failed")]
            for name in names:
                barriers[name], _ = self.cluster.barrier_state(name)
            safe = None
            if time.monotonic() - self._safe_read_s >= SAFE_EVERY_S:
                self._safe_read_s = time.monotonic()
                safe, _ = self.cluster.read_safe()
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
        if not self._etcd_ok:
            self._event("decision", "etcd reachable again")
            self._etcd_ok = True
        joined = [
            n
            for n, info in members.items()
            if self._members.get(n, {}).get("incarnation") != info.get("incarnation")
        ]
        left = sorted(set(self._members) - set(members))
        next_gen = (record.generation if record else 0) + 1
        if joined:
            self._last_join_s = time.monotonic()
            self._detected.setdefault(next_gen, time.time())
            self._event("membership", f"member(s) joined: {', '.join(sorted(joined))}")
            for n in joined:
                if self._dead.get(n) != members[n].get("incarnation"):
                    self._dead.pop(n, None)
        if left:
            self._event("membership", f"member(s) left: {', '.join(left)}")
            planned = set(record.extra.get("nodes", {})) if record else set()
            if planned & (set(left) - set(self._dead)):
                # A lease lapse is the detection only for a node not already found dead.
                self._detected.setdefault(next_gen, time.time())
        self._members = members
        self._record, self._record_rev = record, rev
        self._leader = leader
        self._barriers = barriers
        if safe is not None:
            # The floor only rises: anchors below it may go now (elasticpp.store.replicate).
            self.store.set_floor(safe.step, safe.generation)
        self._update_gauges()

    def _on_epoch_event(self, _event: Any) -> None:
        self._epoch_check = True
        self._on_watch(_event)

    def _check_epoch(self) -> None:
        """The job's epoch key changed, or the generation record vanished: if the epoch this
        agent joined is gone (etcd wiped, the job's prefix deleted), its generation numbering
        is gone with it; stop, so that a restart joins the new epoch."""
        assert self.cluster is not None
        self._epoch_check = False
        try:
            current = self.cluster.epoch()
        except ClusterDataError as exc:
            self.cluster.skip_value(self.cluster.keys.epoch, exc)
            return
        if current is not None and current.epoch == self.store.epoch:
            return
        self._event(
            "decision",
            f"the job's etcd state started afresh (epoch {self.store.epoch} is gone"
            + ("" if current is None else f", epoch {current.epoch} began")
            + "): stopping; started again, this agent joins the new epoch and the job "
            "resumes from the state the nodes hold",
        )
        self._exit_code = EPOCH_ENDED_EXIT
        self._done = True
