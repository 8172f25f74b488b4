"""The leader's decisions as a pure step: `leader_step(state, obs) -> actions`.

`Leader.lead` (elasticpp.agent.leader.shell) builds a `LeaderObservation` (the clock, the
cluster view with the quarantines applied, the generation record and its revision, the
barriers, the detection times, the generation this node follows, the job spec) and hands the
step's actions to the executor. The step and the functions the executor feeds results back
to write only the leader's `LeaderState`; none does I/O. The actions (elasticpp.agent.actions,
"the leader's actions"): WriteGeneration, ConfirmDead, SetAside, PullHoldings,
ResolveResume, CheckNeverCommitted, WriteResume, PublishResumeWait, RecordTimeline,
Housekeep, CleanRendezvous, CountRecovery, ReadCommitRecords, ReadSafe, WriteSafe.

Invariants:
- a generation is a compare-and-swap against the record's revision read; the failure count
  and the re-plan backoff move only once it was written (`leader_generation_written`);
- the resume instruction of a generation is resolved once every live node arrived at
  `stopped-G`, or once the `stopped-G` deadline set the missing ones aside (quarantined; if
  one is in the plan, the next plan goes without it), from the holdings detail pulled from
  the nodes their digests name (elasticpp.agent.leader.resume); `resume_written` is set only
  after the write succeeded (`leader_resume_written`) or when etcd shows an earlier leader's;
- a job that committed steps before (held by a node, in the checkpoint, or on record in
  etcd) never starts over at step 0: it waits and says so, in its log and in etcd
  (`PublishResumeWait`), where its followers read it and wait without a deadline;
- the recovery timeline is written once every planned node started, never over one an
  earlier leader wrote; housekeeping follows only a written timeline;
- the safe step is computed at most every SAFE_EVERY_S and written only when it rises;
- etcd's history is compacted every COMPACT_EVERY_S while a generation runs, to the revision
  read one period before (so history is bounded and a lagging watch still has a period);
- a result fed back for a generation the state has left is ignored (an empty list).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticpp.agent.actions import (
    Action,
    CleanRendezvous,
    CompactHistory,
    CountRecovery,
    Event,
    Housekeep,
    ReadCommitRecords,
    ReadSafe,
    RecordTimeline,
    Reread,
    WriteGeneration,
    WriteSafe,
)
from elasticpp.agent.kernel.decide import ClusterView, Replan, Wait, candidates, decide_replan
from elasticpp.agent.kernel.limits import COMPACT_EVERY_S, MAX_REPLAN_BACKOFF_S, SAFE_EVERY_S
from elasticpp.agent.kernel.records import JSONValue, Record, fields, integer, number
from elasticpp.agent.leader.resume import (
    MISSING_PROBE_EVERY_S,
    leader_fresh_checked,
    leader_pull_started,
    leader_resume_resolved,
    leader_resume_step,
    leader_resume_wait_published,
    leader_resume_written,
)
from elasticpp.agent.leader.state import LeaderState, PulledHoldings
from elasticpp.cluster.barriers import (
    RESUME_MEMBER,
    failed_barrier,
    resume_barrier,
    started_barrier,
    stepped_barrier,
    stopped_barrier,
    timeline_member,
)
from elasticpp.cluster.records import (
    CommitRecord,
    GenerationRecord,
    GenerationSummary,
    SafeStep,
    node_fields,
)
from elasticpp.errors import ConfigError, ElasticppError
from elasticpp.plan import ClusterSpec, NodeSpec, Plan
from elasticpp.plan.search import plan as plan_layout
from elasticpp.store.ring import safe_step

if TYPE_CHECKING:
    from elasticpp.agent.jobspec import JobSpec  # read, never built: it imports no torch

# The resume's steps live in elasticpp.agent.leader.resume; the executor and tests import them
# from here, with the rest of the leader's.
__all__ = [
    "MISSING_PROBE_EVERY_S",
    "LeaderObservation",
    "leader_fresh_checked",
    "leader_generation_written",
    "leader_pull_started",
    "leader_resume_resolved",
    "leader_resume_step",
    "leader_resume_wait_published",
    "leader_resume_written",
    "leader_safe_check",
    "leader_safe_read",
    "leader_safe_step",
    "leader_safe_written",
    "leader_step",
    "leader_timeline_recorded",
    "leader_timeline_step",
    "leader_trained_step",
]

log = logging.getLogger("elasticpp.agent")


@dataclass(frozen=True)
class LeaderObservation:
    """What the leader's step sees. `now_s` is monotonic, `wall_s` wall-clock seconds."""

    now_s: float
    wall_s: float
    node_id: str
    view: ClusterView  # quarantines applied; its members are the view's member keys
    record: GenerationRecord | None  # the newest generation record, None before any
    record_rev: int  # its mod revision: the compare of the next generation's write
    members: Mapping[str, Record]  # member keys: address, slots, incarnation
    barriers: Mapping[str, Record]  # stopped-G, resume-G, started-G, ...
    detected: tuple[Mapping[int, float], ...]  # generation -> wall time a change was seen
    followed: GenerationRecord | None  # the generation this node's follower is in
    followed_plan: Plan | None  # its plan
    spec: JobSpec
    store_address: str | None  # the rendezvous store this term hosts
    pulled: PulledHoldings | None = None  # the followed generation's holdings pull, once back
    # Why the newest record's plan is refused here (made for another model: a forged or
    # foreign record), or None. Every node skips such a record; the leader writes over it.
    refused: str | None = None


def leader_step(state: LeaderState, obs: LeaderObservation) -> list[Action]:
    """Re-plan when the view calls for it (outside the backoff; a graceful change waits for
    the current transition's resume instruction), else carry the followed generation on:
    its resume instruction, its timeline, its safe step."""
    rec = obs.record
    spec = obs.spec
    if state.written_generation > (rec.generation if rec else 0):
        # The view is older than this term's own write: deciding on it would plan the
        # same change again and fail its compare-and-swap (a read and a plan each time,
        # several times a transition while the write's watch event was on its way).
        return []
    decision = decide_replan(
        obs.view,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        settle_s=spec.join_settle_s,
    )
    if rec is not None and obs.refused is not None:
        # No node follows a record made for another model: it is superseded at once by a
        # plan of this term's own, for the nodes the view has (no node blamed for it).
        if obs.now_s < state.replan_not_before_s:
            return []
        nodes = decision.nodes if isinstance(decision, Replan) else candidates(obs.view)
        if len(nodes) < spec.min_nodes:
            return []
        why = f"generation {rec.generation} refused: {obs.refused}"
        return _plan_generation(
            state, obs, Replan(why, graceful=False, nodes=tuple(nodes[: spec.max_nodes]))
        )
    # Mid-transition while the current generation's resume instruction is not written,
    # as etcd says (not as this node's own follower phase says).
    in_progress = (
        rec is not None
        and not state.at(rec.generation, obs.now_s).resume_written
        and RESUME_MEMBER not in obs.barriers.get(resume_barrier(rec.generation), {})
    )
    actions: list[Action] = []
    if isinstance(decision, Replan):
        if obs.now_s < state.replan_not_before_s:
            return []
        if not (decision.graceful and in_progress):
            return _plan_generation(state, obs, decision)
    elif isinstance(decision, Wait) and state.last_wait != decision.reason:
        state.last_wait = decision.reason
        actions.append(Event("decision", f"waiting: {decision.reason}"))
    if rec is None or obs.followed is None or obs.followed.generation != rec.generation:
        return actions
    actions += leader_resume_step(state, obs)
    actions += leader_timeline_step(state, obs)
    leader_trained_step(state, obs)
    actions += leader_safe_check(state, obs)
    actions += leader_compaction_check(state, obs)
    return actions


def leader_compaction_check(state: LeaderState, obs: LeaderObservation) -> list[Action]:
    """Every COMPACT_EVERY_S of a term while a generation runs (the first one period into
    the term): compact etcd's history to the revision read at the previous compaction."""
    if state.compacted_s is None:
        state.compacted_s = obs.now_s
        return []
    if obs.now_s - state.compacted_s < COMPACT_EVERY_S:
        return []
    state.compacted_s = obs.now_s
    return [CompactHistory()]


def _slots(value: JSONValue) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"a member's slots must be a whole number, got {value!r}")
    return value


def _plan_generation(state: LeaderState, obs: LeaderObservation, decision: Replan) -> list[Action]:
    rec = obs.record
    members = obs.members
    generation = (rec.generation if rec else 0) + 1
    try:
        # A member key is written by its agent; a slot count this build cannot use (a bug, a
        # newer format) is a layout that cannot be planned, said once, not an error per tick.
        nodes = [NodeSpec(n, _slots(members[n].get("slots", 1))) for n in decision.nodes]
        cluster = ClusterSpec(tuple(nodes), obs.spec.device_spec())
        result = plan_layout(
            obs.spec.model,
            cluster,
            obs.spec.global_batch,
            micro_batch=obs.spec.micro_batch,
            top_k=0,
        )
    except ElasticppError as exc:
        if state.last_wait == str(exc):
            return []
        state.last_wait = str(exc)
        return [Event("decision", f"cannot plan for {list(decision.nodes)}: {exc}")]
    plan = result.best.with_generation(generation)
    plan_dict = obs.spec.plan_record(plan)
    extra = {
        "reason": decision.reason,
        "graceful": decision.graceful if rec is not None else False,
        # The planned nodes and their incarnations' tags, not their addresses: a fetch takes
        # a source's address from its member key. A node whose agent restarts lost its
        # workers: the plan must change even if the node id came back before its lease lapsed.
        **node_fields(
            plan_dict,
            decision.nodes,
            {n: str(members[n].get("incarnation")) for n in decision.nodes},
        ),
        "previous_layout": layout_of(rec),
        **rendezvous_field(state.rendezvous_secret, generation),
        "detected_at": detection_time(obs, generation),
        "planned_at": obs.wall_s,
    }
    strikes = state.sick.carried()
    if strikes:
        extra["strikes"] = strikes  # the next term starts from them (elasticpp.agent.sick)
    record = GenerationRecord(
        generation=generation,
        plan=plan_dict,
        leader=obs.node_id,
        created_at=obs.wall_s,
        store_address=obs.store_address,
        extra=extra,
    )
    message = (
        f"leader: generation {generation} = {plan.layout}, "
        f"micro-batches {list(plan.microbatches)} ({decision.reason})"
    )
    return [WriteGeneration(record, obs.record_rev, decision.graceful, obs.now_s, message)]


def rendezvous_field(secret: str, generation: int) -> dict[str, str]:
    """The record's `rendezvous` token: the key prefix the generation's workers meet under
    in the rendezvous store (`GenerationRecord.rendezvous_prefix`), derived from the term's
    secret, so that nobody can guess the next generation's and seed its keys."""
    if not secret:
        return {}
    mac = hmac.new(secret.encode(), f"rendezvous/{generation}".encode(), hashlib.sha256)
    return {"rendezvous": mac.hexdigest()[:32]}


def leader_generation_written(
    state: LeaderState, written: WriteGeneration, ok: bool
) -> list[Action]:
    """On record (`ok`); or refused (the record changed, the term is over): nothing moves."""
    if not ok:
        return []
    state.written_generation = max(state.written_generation, written.record.generation)
    # Back off when generations keep failing before they train (a bug or a bad node must
    # not turn into a re-plan storm); a generation that trains resets it.
    state.replan_failures = 0 if written.graceful else state.replan_failures + 1
    backoff_s = 0.0
    if state.replan_failures > 2:
        backoff_s = min(MAX_REPLAN_BACKOFF_S, 0.25 * 2 ** (state.replan_failures - 3))
    state.replan_not_before_s = written.decided_s + backoff_s
    return [Event("decision", written.message), Reread()]


def detection_time(obs: LeaderObservation, generation: int) -> float:
    """When the change behind `generation` was first seen: a failure report of the current
    generation (by any agent), a lapsed lease or a join seen here, else now."""
    seen = [source.get(generation, obs.wall_s) for source in obs.detected]
    rec = obs.record
    if rec is not None:
        for v in obs.barriers.get(failed_barrier(rec.generation), {}).values():
            at = v.get("at") if isinstance(v, dict) else None
            if isinstance(at, (int, float)):
                seen.append(float(at))
    return min(seen, default=obs.wall_s)


def leader_timeline_step(state: LeaderState, obs: LeaderObservation) -> list[Action]:
    """Once every planned node of the followed generation started, its recovery timeline
    (an earlier leader's stays). Started is not trained: strikes and the failure count
    start again only at `stepped-G` (`leader_trained_step`)."""
    gen, plan = obs.followed, obs.followed_plan
    if gen is None or plan is None:
        return []
    ls = state.at(gen.generation, obs.now_s)
    if ls.timeline_written or not ls.resume_written:
        return []
    if timeline_member(gen.generation) in obs.barriers.get("timelines", {}):
        # Written by the leader that ran this generation; a leader elected later (at the
        # job's end, say) must not overwrite it with what it did not see.
        ls.timeline_written = True
        return []
    started = obs.barriers.get(started_barrier(gen.generation), {})
    nodes = gen.planned_set
    if not nodes <= set(started):
        return []
    resume = fields(obs.barriers.get(resume_barrier(gen.generation), {}).get(RESUME_MEMBER))
    stopped = obs.barriers.get(stopped_barrier(gen.generation), {})
    detected = float(gen.extra.get("detected_at", gen.created_at))
    stopped_at = max(number(fields(v), "at", 0) for v in stopped.values()) if stopped else detected
    moved_at = max(number(fields(v), "moved_at", 0) for v in started.values())
    resumed_at = max(number(fields(v), "at", 0) for v in started.values())
    timeline = {
        "generation": gen.generation,
        "reason": gen.extra.get("reason", ""),
        "layout_before": gen.extra.get("previous_layout", ""),
        "layout_after": str(plan.layout),
        "resume_step": integer(resume, "step", 0),
        "steps_recomputed": integer(resume, "recomputed", 0),
        "detected_at": detected,
        "planned_s": float(gen.extra.get("planned_at", detected)) - detected,
        "stopped_s": stopped_at - detected,
        "moved_s": max(moved_at, stopped_at) - detected,
        "resumed_s": resumed_at - detected,
    }
    return [RecordTimeline(gen.generation, timeline, bool(gen.extra.get("previous_layout")))]


def leader_trained_step(state: LeaderState, obs: LeaderObservation) -> None:
    """The nodes at `stepped-G` of the followed generation (their ranks completed a step of
    it) have their strikes cleared, and the failure count starts again: the generation
    trained. Not at `started-G`: a node whose workers die in their first step was cleared at
    every start and never quarantined, while its failed generations spent the job's failure
    budget. A leader elected later reads the same barrier (the strikes it seeds from the
    record are cleared the same way)."""
    gen = obs.followed
    if gen is None:
        return
    stepped = obs.barriers.get(stepped_barrier(gen.generation), {})
    ls = state.at(gen.generation, obs.now_s)
    if stepped is ls.stepped_seen or not stepped:
        return  # the cache's object is the same while the barrier is: nothing new
    ls.stepped_seen = stepped
    new = [n for n in stepped if n not in ls.stepped_cleared]
    if new:
        ls.stepped_cleared = ls.stepped_cleared.union(new)
        state.replan_failures = 0
        state.sick.trained(new)


def leader_timeline_recorded(state: LeaderState, action: RecordTimeline, ok: bool) -> list[Action]:
    """The timeline is on record: what older generations left in etcd and in the
    rendezvous store goes (the generation runs), and a recovery is counted. Not written:
    the term is over; the next leader writes it, or knows better."""
    if not ok or state.generation != action.generation:
        return []
    state.timeline_written = True
    t = action.timeline
    actions: list[Action] = [Housekeep(action.generation), CleanRendezvous(action.generation)]
    if action.recovery:
        actions.append(CountRecovery(number(t, "resumed_s", 0.0)))
    actions.append(
        Event(
            "recovery",
            f"generation {t.get('generation')} ({t.get('reason')}): {t.get('layout_before')} -> "
            f"{t.get('layout_after')}, resumed at step {t.get('resume_step')} after "
            f"{number(t, 'resumed_s', 0.0):.2f} s, {t.get('steps_recomputed')} step(s) "
            "recomputed",
        )
    )
    return actions


def leader_safe_check(state: LeaderState, obs: LeaderObservation) -> list[Action]:
    """Every SAFE_EVERY_S once the followed generation resumed: read its commit records."""
    gen, plan = obs.followed, obs.followed_plan
    copies = obs.spec.replication_copies
    if gen is None or plan is None or not copies:
        return []
    ls = state.at(gen.generation, obs.now_s)
    if not ls.resume_written or obs.now_s - ls.safe_checked_s < SAFE_EVERY_S:
        return []
    state.safe_checked_s = obs.now_s
    # The ring replication uses (`_replicate_async`): the plan's nodes with ranks.
    ring = tuple(sorted({s.node_id for s in plan.placement}))
    return [ReadCommitRecords(gen.generation, ring, copies)]


def leader_safe_step(read: ReadCommitRecords, records: Mapping[str, CommitRecord]) -> list[Action]:
    """The newest anchor that every node with ranks holds, and its replica holders hold a
    replica of, by their commit records (elasticpp.store.replicate); then compare it with
    the published one."""
    ring = list(read.ring)
    step = safe_step(
        ring,
        read.copies,
        ring,
        {n: rec.anchors for n, rec in records.items()},
        {n: rec.replicas for n, rec in records.items()},
    )
    if step is None:
        return []
    return [ReadSafe(SafeStep(read.generation, step), read.copies)]


def leader_safe_read(read: ReadSafe, current: SafeStep | None, revision: int) -> list[Action]:
    """Publish the safe step only when it rises above the published one."""
    if current is not None and read.safe <= current:
        return []
    return [WriteSafe(read.safe, revision, read.copies, current)]


def leader_safe_written(write: WriteSafe, ok: bool) -> list[Action]:
    """Written: said once; refused (the key changed, the term is over): checked again."""
    if ok:
        was = write.was
        log.info(
            "leader: step %d of generation %d is safe (held by its node and %d replica "
            "holder(s) of every node); it was %s",
            write.safe.step,
            write.safe.generation,
            write.copies,
            "none" if was is None else f"step {was.step} of {was.generation}",
        )
    return []


def layout_of(rec: GenerationRecord | None) -> str:
    """The layout of `rec` for the timeline; "" if none or unreadable (a newer format)."""
    if rec is None:
        return ""
    return GenerationSummary.of(rec).layout
