"""The leader's resume of a generation, as pure steps (part of `step.leader_step`).

Once the live nodes arrived at `stopped-G` (nodes missing are probed, and set aside at the
stop deadline), the leader knows from their digests (elasticpp.store.digest) what each holds,
without piece detail. It asks for the detail (`PullHoldings`: only of the nodes that may be a
source of a step the resume can reach, over gRPC, elasticpp.agent.leader.pull); the result comes
back as `LeaderObservation.pulled`, and the resume is resolved from it (`ResolveResume`),
published once (`WriteResume`).

Invariants:
- a generation's holdings are pulled once at a time; a pull that failed, or that its
  deadline cut short before every node was asked, is asked again after
  MISSING_PROBE_EVERY_S; a node on a newer generation makes the view read etcd again;
- a node asked that did not answer is set aside like a node missing at `stopped-G`
  (quarantined, once per generation): if it is in the plan, the next plan goes without it;
  else the resume is resolved from the others;
- an arrival in the full form of the previous release is read as its detail (no pull); a
  value that is neither is said once and counts as missing;
- a generation no step resolves for, in a job that committed before, waits for state and
  says so once (`PublishResumeWait`: its followers hold their deadline); meanwhile nothing
  is resolved again until the holdings are pulled (or the checkpoint read) again, every
  WAIT_REPULL_EVERY_S;
- a result fed back for a generation the state has left is ignored (an empty list).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from elasticpp.agent.actions import (
    Action,
    CheckNeverCommitted,
    ConfirmDead,
    Event,
    PublishResumeWait,
    PullHoldings,
    Reread,
    ResolveResume,
    SetAside,
    WriteResume,
)
from elasticpp.agent.kernel.decide import live_nodes
from elasticpp.agent.kernel.records import JSONValue, Record, fields, integer
from elasticpp.agent.leader.deadlines import stop_wait_s
from elasticpp.agent.leader.state import Arrival, LeaderState
from elasticpp.agent.sick import Action as SickAction
from elasticpp.cluster.barriers import RESUME_MEMBER, resume_barrier, stopped_barrier
from elasticpp.errors import ConfigError, ElasticppError
from elasticpp.store.digest import HoldingsDigest
from elasticpp.store.holdings import NodeHoldings
from elasticpp.store.instruction import encode as encode_instruction
from elasticpp.store.resolver import ResumePlan, resolve

if TYPE_CHECKING:
    from elasticpp.agent.leader.step import LeaderObservation

log = logging.getLogger("elasticpp.agent")

# Nodes missing at `stopped-G` are probed at most this often while the leader waits; a
# failed holdings pull is asked again after as long.
MISSING_PROBE_EVERY_S = 2.0
# While a generation waits for state it cannot resume from, the holdings (and the
# checkpoint's) are pulled again this often.
WAIT_REPULL_EVERY_S = 10.0


def _parse_arrival(value: JSONValue) -> Arrival:
    """One `stopped-G` value: its digest, its full holdings (the previous release's form),
    or why it cannot be read."""
    if not isinstance(value, dict):
        return f"expected a JSON object, got {type(value).__name__}"
    try:
        if "digest" in value:
            return HoldingsDigest.from_dict(_object(value["digest"]))
        return NodeHoldings.from_dict(_object(value["holdings"]))
    except (ConfigError, KeyError, TypeError) as exc:
        return str(exc)


def _object(value: JSONValue) -> Record:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _arrivals(
    stopped: Mapping[str, JSONValue],
    expected: set[str],
    parsed: dict[str, tuple[object, Arrival]],
) -> tuple[dict[str, HoldingsDigest], dict[str, NodeHoldings], dict[str, str]]:
    """The expected nodes' `stopped-G` values: digests, full holdings (the previous
    release's form), and the unreadable ones (node -> why). `parsed` (node -> (value,
    parse)) keeps each value's parse while the value is the same object: the leader looks
    at every arrival at each of its turns while a generation stops (a cached read that did
    not change is the same object), and parsing N digests each time was O(N) a turn."""
    digests: dict[str, HoldingsDigest] = {}
    full: dict[str, NodeHoldings] = {}
    bad: dict[str, str] = {}
    for node, value in stopped.items():
        if node not in expected:
            continue
        held = parsed.get(node)
        if held is None or held[0] is not value:
            held = parsed[node] = (value, _parse_arrival(value))
        result = held[1]
        if isinstance(result, HoldingsDigest):
            digests[node] = result
        elif isinstance(result, NodeHoldings):
            full[node] = result
        else:
            bad[node] = result
    return digests, full, bad


def leader_resume_step(state: LeaderState, obs: LeaderObservation) -> list[Action]:
    """The followed generation's resume instruction: taken as written if an earlier leader
    wrote it; else, once the nodes arrived at `stopped-G`, the holdings detail is pulled
    and the resume resolved from it (see the module docstring)."""
    gen, plan = obs.followed, obs.followed_plan
    if gen is None or plan is None:
        return []
    ls = state.at(gen.generation, obs.now_s)
    if ls.resume_written:
        return []
    if RESUME_MEMBER in obs.barriers.get(resume_barrier(gen.generation), {}):
        ls.resume_written = True  # an earlier leader of this generation wrote it
        return []
    stopped = obs.barriers.get(stopped_barrier(gen.generation), {})
    expected = set(live_nodes(obs.view))
    digests, full, bad = _arrivals(stopped, expected, ls.arrivals_parsed)
    actions: list[Action] = []
    if set(bad) - ls.unreadable:
        ls.unreadable |= set(bad)
        why = "; ".join(f"{n}: {w}" for n, w in sorted(bad.items()))
        actions.append(
            Event("decision", f"generation {gen.generation}: unreadable stopped arrival(s): {why}")
        )
    missing = expected - set(digests) - set(full)
    if missing:
        if obs.now_s - ls.missing_probed_s > MISSING_PROBE_EVERY_S:
            ls.missing_probed_s = obs.now_s
            actions.append(ConfirmDead(tuple(sorted(missing))))
        incarnations = {n: str(obs.members.get(n, {}).get("incarnation", "")) for n in missing}
        passed, decisions = stop_wait_step(
            state,
            gen.generation,
            sorted(missing),
            incarnations,
            now_s=obs.now_s,
            wall_s=obs.wall_s,
            stop_timeout_s=obs.spec.stop_timeout_s,
            nodes=len(expected),
        )
        if decisions:
            actions.append(SetAside(tuple(decisions)))
        if not passed:
            return actions
        if missing & gen.planned_set:
            return actions  # quarantined now: the next step re-plans without them
        expected -= missing  # set aside, outside the plan: resume from the others
    next_steps = tuple(integer(fields(v), "next_step", 0) for v in stopped.values())
    persist_dir = obs.spec.persist_dir or None
    if not any(d.groups for d in digests.values()):
        # Nothing to pull: what arrived in full (and the checkpoint) is all there is.
        if ls.wait_published and stopped is ls.resolved and not _look_again(ls, obs.now_s):
            return actions  # waiting for state: the same arrivals; the checkpoint read when due
        ls.resolved = stopped
        return [
            *actions,
            ResolveResume(
                gen.generation,
                plan,
                full,
                tuple(sorted(expected)),
                next_steps,
                persist_dir,
                obs.wall_s,
            ),
        ]
    if not ls.pull_asked:
        if obs.now_s >= ls.pull_not_before_s:
            ls.pull_not_before_s = obs.now_s + MISSING_PROBE_EVERY_S
            units = plan.model.units
            live = tuple(sorted(expected))
            actions.append(PullHoldings(gen.generation, units, digests, full, live, persist_dir))
        return actions
    pulled = obs.pulled
    if pulled is None or pulled.generation != gen.generation:
        return actions  # in flight
    if pulled.error or pulled.not_asked or pulled.moved_on:
        ls.pull_asked = False  # asked again MISSING_PROBE_EVERY_S after this result
        ls.pull_not_before_s = obs.now_s + MISSING_PROBE_EVERY_S
        if pulled.moved_on:
            return [*actions, Reread()]  # a node is on a newer generation than the view
        why = pulled.error or f"{len(pulled.not_asked)} node(s) not asked before its deadline"
        return [*actions, Event("decision", f"generation {gen.generation}: holdings pull: {why}")]
    unanswered = set(pulled.unanswered)
    if unanswered and not ls.pull_set_aside:
        ls.pull_set_aside = True
        decisions = []
        for node, why in sorted(pulled.unanswered.items()):
            reason = f"did not answer the holdings pull of generation {gen.generation}: {why}"
            incarnation = str(obs.members.get(node, {}).get("incarnation", ""))
            decisions += state.sick.exclude(node, reason, incarnation, obs.wall_s)
        actions.append(SetAside(tuple(decisions)))
    if unanswered & gen.planned_set:
        return actions  # quarantined now: the next step re-plans without them
    if ls.wait_published and pulled is ls.resolved:
        # Waiting for state: this pull resolved to nothing and would again; what the nodes
        # and the checkpoint hold is pulled again when due (a checkpoint restored into
        # persist_dir ends the wait).
        if _look_again(ls, obs.now_s):
            ls.pull_asked = False
        return actions
    ls.resolved = pulled
    live = tuple(sorted(expected - unanswered))
    holdings = {n: h for n, h in pulled.holdings.items() if n in live}
    actions.append(
        ResolveResume(
            gen.generation,
            plan,
            holdings,
            live,
            next_steps,
            None,
            obs.wall_s,
            pulled.disk,
            pulled.held,
        )
    )
    return actions


def _look_again(ls: LeaderState, now_s: float) -> bool:
    """While the generation waits for state: whether to look at the holdings again now,
    every WAIT_REPULL_EVERY_S from the wait's first step (not every turn: a resolve of
    2,048 nodes' holdings is ~0.2 s of the leader's CPU)."""
    if ls.wait_look_s == 0.0:
        ls.wait_look_s = now_s + WAIT_REPULL_EVERY_S
        return False
    if now_s < ls.wait_look_s:
        return False
    ls.wait_look_s = now_s + WAIT_REPULL_EVERY_S
    return True


def leader_pull_started(state: LeaderState, action: PullHoldings) -> list[Action]:
    """The pull runs; its result comes back as an observation (`LeaderObservation.pulled`)."""
    if state.generation == action.generation:
        state.pull_asked = True
    return []


def leader_resume_resolved(
    state: LeaderState, action: ResolveResume, disk: NodeHoldings | None
) -> list[Action]:
    """Resolve the resume step from the nodes' holdings and the checkpoint's (`disk`). No
    step resolves: a job nothing holds state of may be fresh (`CheckNeverCommitted`); one
    whose state is held somewhere waits, and says so."""
    if state.generation != action.generation:
        return []  # the state moved on to another generation: ignored
    try:
        rp = resolve(action.holdings, action.plan, live_nodes=action.live_nodes, disk=disk)
    except ElasticppError as exc:
        # Fresh only if nothing was committed in this etcd state nor held from an earlier
        # epoch of this job (stores and checkpoints hold only this job's steps).
        held = (
            action.held
            or any(h.steps for h in action.holdings.values())
            or bool(disk and disk.steps)
        )
        if held:
            return _cannot_resume(state, action.generation, str(exc))
        return [CheckNeverCommitted(action, str(exc))]
    return [_resume_instruction(action, rp)]


def leader_fresh_checked(
    state: LeaderState, check: CheckNeverCommitted, ever_committed: bool
) -> list[Action]:
    """A job that never committed a step starts at step 0; one that did waits."""
    if state.generation != check.resolve.generation:
        return []  # ignored: another generation
    if ever_committed:
        return _cannot_resume(state, check.resolve.generation, check.why)
    return [_resume_instruction(check.resolve, None)]


def _cannot_resume(state: LeaderState, generation: int, why: str) -> list[Action]:
    """Said once in the log, and in etcd until etcd has it (`leader_resume_wait_published`):
    the followers of `generation` then wait for the state with it, without a deadline.
    Failing the generation instead would blame the nodes that waited, quarantine them one
    re-plan after another and spend the failure budget, while what the job needs is a node
    that holds the state, or a checkpoint, brought back."""
    why = (
        f"{why}; the job committed steps before, so it does not start over (restore a "
        "checkpoint into persist_dir or bring back a node that holds the state)"
    )
    msg = f"generation {generation}: cannot resume: {why}"
    actions: list[Action] = []
    if state.last_wait != msg:
        state.last_wait = msg
        actions.append(Event("decision", msg))
    if state.wait_published != why:
        actions.append(PublishResumeWait(generation, why))
    return actions


def leader_resume_wait_published(
    state: LeaderState, action: PublishResumeWait, ok: bool
) -> list[Action]:
    """The wait is in etcd (`ok`), or need not be: an instruction was written since, or the
    term is over (the next leader says it again if it must). Not called when etcd could
    not be reached: the next step asks again."""
    if state.generation == action.generation:
        state.wait_published = action.why
    if not ok:
        log.info(
            "generation %d: the wait for state not published (an instruction was written, "
            "or leadership lost)",
            action.generation,
        )
    return []


def _resume_instruction(action: ResolveResume, rp: ResumePlan | None) -> WriteResume:
    # Each piece once; every node derives its own fetches with the plan (store.instruction).
    value = encode_instruction(rp, action.plan)
    step = int(value["step"])
    value.update(at=action.wall_s, recomputed=max([*action.next_steps, step]) - step)
    return WriteResume(action.generation, value)


def leader_resume_written(state: LeaderState, action: WriteResume, ok: bool) -> list[Action]:
    """The instruction is on record (`ok`); or one was written before, or the term is over."""
    if state.generation != action.generation:
        return []  # ignored: another generation
    if not ok:
        log.info(
            "generation %d: resume not written (written before or leadership lost)",
            action.generation,
        )
        return []
    state.resume_written = True
    step = action.value["step"]
    return [Event("decision", f"leader: generation {action.generation} resumes at step {step}")]


def stop_wait_step(
    state: LeaderState,
    generation: int,
    missing: Sequence[str],
    incarnations: Mapping[str, str],
    *,
    now_s: float,
    wall_s: float,
    stop_timeout_s: float,
    nodes: int = 0,
) -> tuple[bool, list[SickAction]]:
    """The leader's deadline on `stopped-G`: nodes that did not arrive within
    `stop_timeout_s` (a wedged agent, workers that will not die) are quarantined, and the
    job goes on without them. Returns whether the deadline has passed (the missing nodes are
    set aside) and the sick decisions to carry out (`SetAside`). Writes only `state`."""
    ls = state.at(generation, now_s)
    if ls.stop_wait_since_s is None:
        ls.stop_wait_since_s = now_s
        return False, []
    waited_s = stop_wait_s(stop_timeout_s, nodes)  # grows with the nodes waited for
    if now_s - ls.stop_wait_since_s <= waited_s:
        return False, []
    decisions: list[SickAction] = []
    for node in missing:
        why = (
            f"did not arrive at stopped-{generation} within {waited_s:.0f} s "
            "(a wedged agent, or workers that will not stop)"
        )
        decisions += state.sick.exclude(node, why, incarnations.get(node, ""), wall_s)
    return True, decisions
