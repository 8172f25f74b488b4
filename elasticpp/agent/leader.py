"""The leader part of the agent: one agent plans for the job.

It acts only while its term holds (`Leadership.is_held()` and the leader key still names it).
It writes each generation by compare-and-swap, resolves where the resume state comes from
and publishes it once as a fenced record any later leader reads, records the recovery
timeline, removes what older generations left in etcd, and publishes the safe step (fenced,
only when it rises) from the running generation's commit records.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any

from elasticpp.agent.decide import (
    ClusterView,
    Replan,
    Wait,
    decide_replan,
    live_nodes,
)
from elasticpp.agent.follower import _GenState
from elasticpp.agent.leaderstate import LeaderState
from elasticpp.agent.limits import MAX_REPLAN_BACKOFF_S, SAFE_EVERY_S
from elasticpp.agent.sick import SickNodes
from elasticpp.cluster.client import RESUME_MEMBER
from elasticpp.cluster.records import GenerationRecord, SafeStep
from elasticpp.errors import ElasticppError
from elasticpp.plan import ClusterSpec, NodeSpec, Plan
from elasticpp.plan.search import plan as plan_layout
from elasticpp.store.holdings import NodeHoldings
from elasticpp.store.persist import checkpoint_holdings
from elasticpp.store.replicate import safe_step
from elasticpp.store.resolver import resolve

log = logging.getLogger("elasticpp.agent")

# A key of the rendezvous store: workers of generation G use the prefix `gen<G>` (`_assign`).
_GEN_KEY = re.compile(r"^gen(\d+)/")


class LeaderPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _is_leader(self) -> bool:
        # Acts only while the term is held: a loop that stalled past the lease TTL, or whose
        # keep-alive failed, must not write on the strength of what it read before. Nor while
        # its own membership is lost or not yet seen again: it would re-plan without itself,
        # then again when its key is back (two generations for one blip).
        return (
            self._ls.leadership is not None
            and self._ls.leadership.is_held()
            and self._vs.leader == self.node_id
            and self.node_id in self._vs.members
            and not self._fenced()
        )

    def _maybe_campaign(self) -> None:
        # Deposed (the key deleted or taken) or lapsed: the old term is resigned before any
        # new campaign, so no keep-alive thread or lease outlives its term.
        deposed = self._vs.leader != self.node_id
        if self._ls.leadership is not None and (deposed or not self._ls.leadership.is_held()):
            self._step_down("lost the leadership")
            return
        if self._ls.leadership is not None:
            return  # won; the view reads the leader key on the next refresh
        if self._vs.leader is not None or self._cs.draining or self._exit_requested() is not None:
            return
        assert self.cluster is not None
        if not self._torch_ready.is_set():
            return  # the leader hosts the rendezvous store; wait until torch is imported
        leadership = self.cluster.campaign(
            self.node_id, ttl_s=self.spec.lease_ttl_s, gate=self._lease_gate()
        )
        if leadership is None:
            return
        # A new term starts the leader's state afresh: strikes and the failure budget too;
        # quarantines and what each generation's transition has written are read from etcd.
        self._ls = LeaderState(SickNodes(self.spec.sick_policy()), leadership=leadership)
        self._reread.raise_()  # the view (the one writer of `leader`) reads the key now
        self._start_rendezvous_store()
        self._event("decision", f"node {self.node_id} is the leader")

    def _step_down(self, why: str) -> None:
        """End this node's term (resign: its lease is revoked, so a successor can win at
        once). `_leader` is the view's to write: it reads the key again."""
        if self._ls.leadership is None:
            return
        self._event("decision", f"node {self.node_id} {why}: leadership resigned")
        with contextlib.suppress(ElasticppError):
            self._ls.leadership.resign()
        self._ls.leadership = None
        self._reread.raise_()

    def _start_rendezvous_store(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        self._ls.tcpstore = TCPStore(
            self.cfg.advertise_host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )
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

    def _view(self) -> ClusterView:
        rec = self._vs.record
        current = tuple(sorted(rec.extra.get("nodes", {}))) if rec else None
        failed = set(self._vs.barriers.get(f"failed-{rec.generation}", {})) if rec else set()
        dead = self._lvs.dead_now(self._vs.members) & set(self._vs.members)
        recorded = rec.extra.get("incarnations", {}) if rec else {}
        restarted = {
            n
            for n, inc in recorded.items()
            if n in self._vs.members and self._vs.members[n].get("incarnation") != inc
        }
        return ClusterView(
            members=self._vs.members,
            dead=dead,
            current_nodes=current,
            failed=failed,
            now_s=self._clock.monotonic(),
            # planned again after the settle window: a join, a revived node, a re-admission
            last_join_s=max(self._vs.last_join_s, self._lvs.revived_s, self._hs.readmitted_s),
            job_done=self._cs.job_done or self._hs.job_end is not None,
            restarted=restarted,
            quarantined=frozenset(self._hs.quarantines),
        )

    def _lead(self) -> None:
        self._recheck_dead()
        rec = self._vs.record
        view = self._view()
        if rec is not None and view.failed and not (view.dead & set(view.current_nodes or ())):
            # Suspicion (a worker failure) is confirmed by probing before the TTL lapses;
            # results are kept for DEAD_RECHECK_S, so a failure that waits is no probe storm.
            self._confirm_dead(self._suspects(rec.generation, view.current_nodes or ()))
            view = self._view()
        view = self._lead_health(view)
        if self._hs.job_end is not None:
            return
        decision = decide_replan(
            view,
            min_nodes=self.spec.min_nodes,
            max_nodes=self.spec.max_nodes,
            settle_s=self.spec.join_settle_s,
        )
        gs = self._fs.gen
        # Mid-transition while the current generation's resume instruction is not written,
        # as etcd says (not as this node's own follower phase says).
        in_progress = (
            rec is not None
            and not self._ls.at(rec.generation, self._clock.monotonic()).resume_written
            and RESUME_MEMBER not in self._vs.barriers.get(f"resume-{rec.generation}", {})
        )
        if isinstance(decision, Replan):
            if self._clock.monotonic() < self._ls.replan_not_before_s:
                return
            if not (decision.graceful and in_progress):
                self._write_generation(decision, view)
                return
        elif isinstance(decision, Wait) and self._ls.last_wait != decision.reason:
            self._ls.last_wait = decision.reason
            self._event("decision", f"waiting: {decision.reason}")
        if rec is None or gs is None or gs.generation != rec.generation:
            return
        self._lead_resume(gs, view)
        self._lead_timeline(gs)
        self._lead_safe_step(gs, self._clock.monotonic())

    def _write_generation(self, decision: Replan, view: ClusterView) -> None:
        assert self.cluster is not None
        rec = self._vs.record
        generation = (rec.generation if rec else 0) + 1
        nodes = [NodeSpec(n, int(self._vs.members[n].get("slots", 1))) for n in decision.nodes]
        cluster = ClusterSpec(tuple(nodes), self.spec.device_spec())
        try:
            result = plan_layout(
                self.spec.model,
                cluster,
                self.spec.global_batch,
                micro_batch=self.spec.micro_batch,
                top_k=0,
            )
        except ElasticppError as exc:
            if self._ls.last_wait != str(exc):
                self._ls.last_wait = str(exc)
                self._event("decision", f"cannot plan for {list(decision.nodes)}: {exc}")
            return
        plan = result.best.with_generation(generation)
        extra = {
            "reason": decision.reason,
            "graceful": decision.graceful if rec is not None else False,
            "nodes": {n: str(self._vs.members[n]["address"]) for n in decision.nodes},
            # Every live node may serve state, also one outside the new plan (draining).
            "sources": {
                n: str(self._vs.members[n]["address"])
                for n in live_nodes(view)
                if n in self._vs.members
            },
            # A node whose agent restarts lost its workers: the plan must change even if the
            # node id came back before its lease lapsed.
            "incarnations": {
                n: str(self._vs.members[n].get("incarnation")) for n in decision.nodes
            },
            "previous_layout": _layout_of(rec),
            "detected_at": self._detection_time(generation),
            "planned_at": self._clock.time(),
        }
        record = GenerationRecord(
            generation=generation,
            plan=plan.to_dict(),
            leader=self.node_id,
            created_at=self._clock.time(),
            store_address=self._ls.store_address,
            extra=extra,
        )
        if self.cluster.write_generation(record, self._vs.record_rev, self._ls.leadership):
            # Back off when generations keep failing before they train (a bug or a bad
            # node must not turn into a re-plan storm); a generation that trains resets it.
            self._ls.replan_failures = 0 if decision.graceful else self._ls.replan_failures + 1
            backoff_s = 0.0
            if self._ls.replan_failures > 2:
                backoff_s = min(MAX_REPLAN_BACKOFF_S, 0.25 * 2 ** (self._ls.replan_failures - 3))
            self._ls.replan_not_before_s = self._clock.monotonic() + backoff_s
            self._event(
                "decision",
                f"leader: generation {generation} = {plan.layout}, "
                f"micro-batches {list(plan.microbatches)} "
                f"({decision.reason})",
            )
            self._reread.raise_()

    def _never_committed(self, generation: int) -> bool:
        assert self.cluster is not None
        return not self.cluster.ever_committed()

    def _detection_time(self, generation: int) -> float:
        """When the change behind `generation` was first seen: a failure report of the
        current generation (by any agent), a lapsed lease or a join seen here, else now."""
        seen = [
            source.get(generation, self._clock.time())
            for source in (self._vs.detected, self._fs.detected)
        ]
        rec = self._vs.record
        if rec is not None:
            for v in self._vs.barriers.get(f"failed-{rec.generation}", {}).values():
                if isinstance(v, dict) and isinstance(v.get("at"), (int, float)):
                    seen.append(float(v["at"]))
        return min(seen)

    def _lead_resume(self, gs: _GenState, view: ClusterView) -> None:
        ls = self._ls.at(gs.generation, self._clock.monotonic())
        if ls.resume_written:
            return
        assert self.cluster is not None
        if RESUME_MEMBER in self._vs.barriers.get(f"resume-{gs.generation}", {}):
            ls.resume_written = True  # an earlier leader of this generation wrote it
            return
        stopped = self._vs.barriers.get(f"stopped-{gs.generation}", {})
        expected = set(live_nodes(view))
        missing = expected - set(stopped)
        if missing:
            if self._clock.monotonic() - ls.missing_probed_s > 2.0:
                ls.missing_probed_s = self._clock.monotonic()
                self._confirm_dead(sorted(missing))
            if not self._exclude_non_arrivers(gs, sorted(missing)):
                return
            if missing & set(gs.record.extra.get("nodes", {})):
                return  # quarantined now: the next tick re-plans without them
            expected -= missing  # set aside, outside the plan: resume from the others
        holdings = {
            n: NodeHoldings.from_dict(v["holdings"]) for n, v in stopped.items() if n in expected
        }
        plan = gs.plan
        disk = None
        if self.spec.persist_dir and Path(self.spec.persist_dir).is_dir():
            disk = checkpoint_holdings(Path(self.spec.persist_dir), self.store.job)
        try:
            rp = resolve(holdings, plan, live_nodes=sorted(expected), disk=disk)
        except ElasticppError as exc:
            # Fresh only if nothing was committed in this etcd state nor held from an earlier
            # epoch of this job (stores and checkpoints hold only this job's steps).
            held = any(h.steps for h in holdings.values()) or bool(disk and disk.steps)
            if not held and self._never_committed(gs.generation):
                rp = None  # a fresh job: nothing was ever committed
            else:
                msg = (
                    f"generation {gs.generation}: cannot resume: {exc}; the job committed "
                    "steps before, so it does not start over (restore a checkpoint into "
                    "persist_dir or bring back a node that holds the state)"
                )
                if self._ls.last_wait != msg:
                    self._ls.last_wait = msg
                    self._event("decision", msg)
                return
        fetches: dict[str, list[list[Any]]] = {}
        step = 0
        if rp is not None:
            step = rp.step
            for rank, items in rp.fetches.items():
                fetches[str(rank)] = [
                    [f.piece_name, f.origin_node, f.source_node, f.sha256, f.size] for f in items
                ]
        next_steps = [int(v.get("next_step", 0)) for v in stopped.values()]
        written = self.cluster.write_resume(
            gs.generation,
            {
                "step": step,
                "fetches": fetches,
                "at": self._clock.time(),
                "recomputed": max([*next_steps, step]) - step,
            },
            self._ls.leadership,
        )
        self._reread.raise_()
        if not written:
            log.info(
                "generation %d: resume not written (written before or leadership lost)",
                gs.generation,
            )
            return
        ls.resume_written = True
        self._event("decision", f"leader: generation {gs.generation} resumes at step {step}")

    def _lead_timeline(self, gs: _GenState) -> None:
        ls = self._ls.at(gs.generation, self._clock.monotonic())
        if ls.timeline_written or not ls.resume_written:
            return
        if f"gen-{gs.generation}" in self._vs.barriers.get("timelines", {}):
            # Written by the leader that ran this generation; a leader elected later (at the
            # job's end, say) must not overwrite it with what it did not see.
            ls.timeline_written = True
            return
        started = self._vs.barriers.get(f"started-{gs.generation}", {})
        nodes = set(gs.record.extra.get("nodes", {}))
        if not nodes <= set(started):
            return
        self._ls.replan_failures = 0
        self._ls.sick.trained(nodes)
        assert self.cluster is not None
        resumes = self._vs.barriers.get(f"resume-{gs.generation}", {})
        resume = resumes.get(RESUME_MEMBER) or {}
        stopped = self._vs.barriers.get(f"stopped-{gs.generation}", {})
        detected = float(gs.record.extra.get("detected_at", gs.record.created_at))
        stopped_at = max(float(v.get("at", 0)) for v in stopped.values()) if stopped else detected
        moved_at = max(float(v.get("moved_at", 0)) for v in started.values())
        resumed_at = max(float(v.get("at", 0)) for v in started.values())
        timeline = {
            "generation": gs.generation,
            "reason": gs.record.extra.get("reason", ""),
            "layout_before": gs.record.extra.get("previous_layout", ""),
            "layout_after": str(gs.plan.layout),
            "resume_step": int(resume.get("step", 0)),
            "steps_recomputed": int(resume.get("recomputed", 0)),
            "detected_at": detected,
            "planned_s": float(gs.record.extra.get("planned_at", detected)) - detected,
            "stopped_s": stopped_at - detected,
            "moved_s": max(moved_at, stopped_at) - detected,
            "resumed_s": resumed_at - detected,
        }
        if not self.cluster.record_timeline(gs.generation, timeline, self._ls.leadership):
            return  # the term is over: the next leader writes it, or knows better
        ls.timeline_written = True
        # The generation runs: what older ones left in etcd goes (bounded growth).
        removed = self.cluster.housekeep(gs.generation, leader=self._ls.leadership)
        if removed:
            log.info("leader: removed %d etcd key(s) of older generations", removed)
        self._clean_rendezvous(gs.generation)
        if gs.record.extra.get("previous_layout"):
            self.metrics.recoveries_total.labels(**self.metrics.labels).inc()
            self.metrics.recovery_seconds.labels(**self.metrics.labels).observe(
                timeline["resumed_s"]
            )
        self._event(
            "recovery",
            "generation {generation} ({reason}): {layout_before} -> "
            "{layout_after}, resumed at step {resume_step} after {resumed_s:.2f} s, "
            "{steps_recomputed} step(s) recomputed".format(**timeline),
        )

    def _lead_safe_step(self, gs: _GenState, now_s: float) -> None:
        """Publish the newest safe step of the running generation when it rises (every
        `SAFE_EVERY_S` of the monotonic clock, `now_s`): the newest anchor that every node
        with ranks holds, and its replica holders hold a replica of, by their commit records
        (elasticpp.store.replicate)."""
        r = self.spec.replication_copies
        ls = self._ls.at(gs.generation, now_s)
        if not r or not ls.resume_written or now_s - ls.safe_checked_s < SAFE_EVERY_S:
            return
        self._ls.safe_checked_s = now_s
        assert self.cluster is not None
        records = self.cluster.commit_records(gs.generation)
        # The ring replication uses (`_replicate_async`): the plan's nodes with ranks.
        ring = sorted({s.node_id for s in gs.plan.placement})
        step = safe_step(
            ring,
            r,
            ring,
            {n: rec.anchors for n, rec in records.items()},
            {n: rec.replicas for n, rec in records.items()},
        )
        if step is None:
            return
        new = SafeStep(gs.generation, step)
        current, revision = self.cluster.read_safe()
        if current is not None and new <= current:
            return
        if self.cluster.write_safe(new, revision, self._ls.leadership):
            log.info(
                "leader: step %d of generation %d is safe (held by its node and %d replica "
                "holder(s) of every node); it was %s",
                step,
                gs.generation,
                r,
                "none" if current is None else f"step {current.step} of {current.generation}",
            )

    def timelines(self) -> list[dict[str, Any]]:
        values = self._vs.barriers.get("timelines", {})
        return sorted(values.values(), key=lambda t: int(t.get("generation", 0)))


def _layout_of(rec: GenerationRecord | None) -> str:
    """The layout of `rec` for the timeline; "" if none or unreadable (a newer format)."""
    if rec is None:
        return ""
    try:
        return str(Plan.from_dict(rec.plan).layout)
    except (ElasticppError, KeyError, TypeError, ValueError):
        return ""
