"""The liveness part of the agent: suspicion confirmed by probe.

The leader probes the suspects of a failed generation — its nodes that have not reported the
failure themselves (a report is proof of life; a dead agent cannot write one) and nodes that
do not arrive at `stopped-G` — and takes back a node confirmed dead that answers again. A
follower does the same for the leader: a failure left unanswered makes it probe the leader,
and a leader that fails the probe (dead, or alive with a stalled loop) has its term deposed
so that a new one is elected without waiting for its lease to lapse.

Invariants:
- nobody is declared dead or deposed without a failed probe: a node whose address is not
  known (no member key) is not probed and gets no verdict; its lease decides;
- a node is probed at most once per DEAD_RECHECK_S: results are kept per (node, incarnation)
  for that long, so a failure that waits (re-plan backoff, too few nodes) causes no storm;
  an answer SERVING from a round of n probes is kept n / PROBE_RECHECK_PER_S when that is
  longer (`paced_keep_s`): while one failure waits, a leader re-probes at most ~100 live
  suspects a second however large the job (a 2,048-node job's once every ~20 s; its lease
  remains the bound on finding a node lost meanwhile). A newly failed generation's suspects
  are probed afresh: only answers younger than DEAD_RECHECK_S are reused for it;
- probes run on one bounded pool of PROBE_THREADS threads, reused, and the loop never waits
  for one: a probe asked for is started (at most one per node incarnation in flight), its
  result wakes the loop if it needs a look (anything but SERVING) or ends the round
  (`ProbeWakes`), and the next leader cycle gives its verdict. Probes go in rounds:
  while any node asked for is being probed, none of them is probed anew. While the first
  round of a failed generation's suspects is out the leader's step waits for its verdicts,
  so it never re-plans around a node it is about to find dead; later rounds it does not
  wait for. (The leader once waited on its loop for the probes of every silent node of a
  1,024-node job, 3-4 s a turn, and its lease lapsed.);
- silence is looked at twice: a probe unanswered within its budget (SILENT: gone without a
  word, or alive on a saturated machine) is followed at once by a second probe of that
  incarnation, still in the same round, and only a second silence is a verdict of death; a
  follower's probe of a silent leader is repeated DEAD_RECHECK_S later before it deposes. (A
  leader probing 2,047 suspects on a saturated machine once evicted a healthy node whose
  single probe went unanswered, and took it back a generation later.);
- a verdict is given only for the incarnation that was probed, whoever asked for it: DEAD
  (refused, or silent twice) records the node dead; an answer takes a node found dead back
  (it was only slow or stopped for a while); NOT_SERVING is alive, recorded as unhealthy
  (`unhealthy`, node -> incarnation), never as dead, so that its own recovery is not raced;
  SERVING clears it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from elasticpp.agent import probe
from elasticpp.agent.actions import Action, DeposeLeader, Event, ProbeLeader, Reread
from elasticpp.agent.limits import DEAD_RECHECK_S, LEADER_SUSPECT_S, PROBE_RECHECK_PER_S
from elasticpp.agent.probe import ProbeResult

log = logging.getLogger("elasticpp.agent")


def paced_keep_s(round_size: int, per_s: float) -> float:
    """How long a SERVING answer of a round of `round_size` probes is kept: DEAD_RECHECK_S,
    or as long as re-probing the round at `per_s` probes a second takes."""
    return max(DEAD_RECHECK_S, round_size / per_s)


class ProbeWakes:
    """Decides, on the probe's thread, whether a finished probe wakes the loop: when its
    answer needs a look now (anything but SERVING: a verdict to give, a second look to
    start; a probe that raised) or when it was the last one out. A round of 2,047 probes
    that each woke the leader made ~2,000 leader turns a round, each going over every
    suspect: 21 s of the leader's CPU in one sick node's transition at 2,048 nodes.
    SERVING answers wait for the round's end (or the loop's next tick); so does a dead
    node's revival found by a recheck while a round is out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._out = 0

    def started(self) -> None:
        with self._lock:
            self._out += 1

    def not_started(self) -> None:
        """A probe counted by `started` that never ran (the pool refused it)."""
        with self._lock:
            self._out -= 1

    def finished(self, future: Future[ProbeResult]) -> bool:
        """True if the loop is to be woken for `future`, which has just finished."""
        with self._lock:
            self._out -= 1
            last = self._out <= 0
        if last:
            return True
        if future.cancelled():
            return False
        if future.exception() is not None:
            return True
        return future.result() is not ProbeResult.SERVING


@dataclass
class LivenessState:
    """The liveness part's state: one object, written by this module's code on the loop."""

    dead: dict[str, str] = field(default_factory=dict)  # node -> incarnation found dead
    dead_checked_s: float = 0.0  # monotonic: dead nodes last probed again
    unhealthy: dict[str, str] = field(default_factory=dict)  # node -> NOT_SERVING incarnation
    probe_cache: dict[tuple[str, str], tuple[float, ProbeResult]] = field(default_factory=dict)
    # how long a cached SERVING answer of a large round is kept (DEAD_RECHECK_S if absent)
    probe_keep: dict[tuple[str, str], float] = field(default_factory=dict)
    round_keep: dict[tuple[str, str], float] = field(default_factory=dict)  # probes out
    # (node, incarnation) -> its probe: started, no verdict given yet
    probing: dict[tuple[str, str], Future[ProbeResult]] = field(default_factory=dict)
    silent_once: set[tuple[str, str]] = field(default_factory=set)  # second probe out
    # Which finished probes wake the loop: the one field the probes' threads touch (locked).
    wakes: ProbeWakes = field(default_factory=ProbeWakes)
    suspect_since: dict[int, float] = field(default_factory=dict)  # generation -> first seen
    suspects_probed_gen: int = 0  # the failed generation whose suspects' probes started
    verdicts_gen: int = 0  # the failed generation whose suspects' first verdicts are all in
    leader_probed_s: float = 0.0
    leader_silent: tuple[str, str] | None = None  # (leader, incarnation) silent to a probe
    revived_s: float = 0.0  # monotonic: a node found dead last answered again

    def dead_now(self, members: Mapping[str, Mapping[str, Any]]) -> set[str]:
        """Nodes found dead whose registration is still that incarnation's (or gone): a
        node registered again by a new agent is not dead."""
        return {
            n
            for n, inc in self.dead.items()
            if n not in members or members[n].get("incarnation") == inc
        }


@dataclass(frozen=True)
class LeaderWatch:
    """What a follower's watch on the leader sees. Times are monotonic seconds."""

    now_s: float
    node_id: str
    generation: int | None  # of the record, None before any
    leader: str | None
    failure_reported: bool  # this node reported the record's generation failed
    address: str  # the leader's, from its member key ("" while it has none)
    incarnation: str


def leader_watch_step(state: LivenessState, obs: LeaderWatch) -> list[Action]:
    """Detect by suspicion, confirm by probe, for the leader too: when a failure this node
    reported of the current generation has waited LEADER_SUSPECT_S without a new plan, it probes the
    leader's agent (at most once per DEAD_RECHECK_S). A leader whose member key is absent
    (re-registering after a lost lease) gets no probe and no verdict: a leader that is
    really gone loses its term with its lease."""
    if obs.generation is None or obs.leader is None or obs.leader == obs.node_id:
        return []
    if not obs.failure_reported:
        state.suspect_since.clear()
        state.leader_silent = None
        return []
    since = state.suspect_since.setdefault(obs.generation, obs.now_s)
    if obs.now_s - since < LEADER_SUSPECT_S or obs.now_s - state.leader_probed_s < DEAD_RECHECK_S:
        return []
    state.leader_probed_s = obs.now_s
    if not obs.address:
        return []
    return [ProbeLeader(obs.leader, obs.address, obs.incarnation)]


def leader_probed(state: LivenessState, probed: ProbeLeader, result: ProbeResult) -> list[Action]:
    """A leader that fails the probe has its term deposed, so that a new leader is elected
    now, not after its lease lapses: a refused connection is final at once, NOT_SERVING
    means its loop stalled; silence deposes only when the next probe (DEAD_RECHECK_S later)
    is silent too. The leader is the busiest node of a large job (2,047 probes of its own
    in a sick node's transition at 2,048 nodes): one slow answer must not cost an election."""
    key = (probed.leader, probed.incarnation)
    if result is ProbeResult.SILENT and state.leader_silent != key:
        state.leader_silent = key
        return [Event("decision", f"leader {probed.leader} silent to a probe: probed again")]
    state.leader_silent = None
    if result is ProbeResult.SERVING:
        return []
    dead = result is ProbeResult.DEAD or result is ProbeResult.SILENT
    why = {
        ProbeResult.DEAD: "dead",
        ProbeResult.SILENT: "silent to two probes",
    }.get(result, "not serving (its loop stalled)")
    return [DeposeLeader(probed.leader, why, probed.incarnation if dead else None)]


def leader_deposed(state: LivenessState, deposed: DeposeLeader, done: bool) -> list[Action]:
    """The term is deleted (`done`), or another change won the race (nothing to say)."""
    if not done:
        return []
    if deposed.dead_incarnation is not None:
        state.dead[deposed.leader] = deposed.dead_incarnation
    return [
        Event("decision", f"leader {deposed.leader} confirmed {deposed.why} by probe: deposed"),
        Reread(),
    ]


class LivenessPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _check_leader(self) -> None:
        """The liveness part's watch on the leader (`leader_watch_step`, pure); the probe's
        and the deposition's results come back to it as the executor applies them."""
        rec, leader = self.view.snapshot.record, self.view.snapshot.leader
        info = self.view.snapshot.members.get(leader, {}) if leader else {}
        self._execute(
            leader_watch_step(
                self._lvs,
                LeaderWatch(
                    now_s=self._clock.monotonic(),
                    node_id=self.node_id,
                    generation=rec.generation if rec else None,
                    leader=leader,
                    # Its own report: a follower does not read the others' (only the
                    # leader does); a node that saw no failure has nothing to suspect.
                    failure_reported=rec is not None
                    and (
                        self._fs.reported == rec.generation
                        or rec.generation in self._fs.pending_failures
                    ),
                    address=str(info.get("address") or ""),
                    incarnation=str(info.get("incarnation", "")),
                ),
            )
        )

    def _probe(self, nodes: Iterable[str]) -> dict[str, ProbeResult]:
        """The health of `nodes` known now (this node and nodes without an address left out):
        results younger than DEAD_RECHECK_S for the node's incarnation (a SERVING answer of
        a large round: younger than its `paced_keep_s`). The others' probes are
        started on the bounded pool (never twice at once); their verdicts come with a later
        cycle (`_probes_done`, first in the leader's), woken by the result."""
        now = self._clock.monotonic()
        lvs = self._lvs
        cache, keep = lvs.probe_cache, lvs.probe_keep
        for key in [k for k, (at, _) in cache.items() if now - at >= keep.get(k, DEAD_RECHECK_S)]:
            del cache[key]
            keep.pop(key, None)
        results: dict[str, ProbeResult] = {}
        wanted = sorted(set(nodes) - {self.node_id})
        # One round at a time: while any of `nodes` is being probed, none is probed anew. A
        # round of thousands of nodes outlasts DEAD_RECHECK_S; re-probing its first answers
        # meanwhile would keep it from ever ending.
        start = not self._probing(wanted)
        due: list[tuple[tuple[str, str], str]] = []
        for n in wanted:
            info = self.view.snapshot.members.get(n, {})
            address, inc = info.get("address"), str(info.get("incarnation", ""))
            if not address:
                continue
            key = (n, inc)
            if key in cache:
                results[n] = cache[key][1]
            elif start:
                due.append((key, str(address)))
        round_keep_s = paced_keep_s(len(due), PROBE_RECHECK_PER_S)
        for key, address in due:
            lvs.round_keep[key] = round_keep_s
            self._start_probe(key, address)
        return results

    def _unpace_probes(self) -> None:
        """A new failure: the answers kept past DEAD_RECHECK_S (`paced_keep_s`) are not
        reused for it; its suspects are probed afresh."""
        self._lvs.probe_keep.clear()

    def _start_probe(self, key: tuple[str, str], address: str) -> None:
        """Probe node `key[0]`'s incarnation `key[1]` at `address` on the pool; its result
        wakes the loop if it needs a look or ends the round (`ProbeWakes`)."""
        n, inc = key
        wakes = self._lvs.wakes
        wakes.started()
        try:
            future = self._probe_pool.submit(
                probe.check,
                address,
                service=probe.node_service(n, inc) if inc else "",
                channels=self._probe_channels,
            )
        except BaseException:
            wakes.not_started()
            raise
        future.add_done_callback(lambda f: wakes.finished(f) and self._wake.set())
        self._lvs.probing[key] = future

    def _probes_done(self) -> None:
        """The verdicts of the probes that have finished (see the module)."""
        for key, future in list(self._lvs.probing.items()):
            if not future.done():
                continue
            del self._lvs.probing[key]
            if future.cancelled():
                self._lvs.round_keep.pop(key, None)
                continue  # the pool shut down: the agent is stopping
            try:
                result = future.result()
            except Exception as exc:  # a probe that raised says nothing of the node
                self._lvs.round_keep.pop(key, None)
                self._lvs.silent_once.discard(key)
                self.errors.survive("probe", exc)
                continue
            if result is ProbeResult.SILENT:
                if key not in self._lvs.silent_once:
                    address = self.view.snapshot.members.get(key[0], {}).get("address")
                    if address and self._still_registered(key):
                        self._lvs.silent_once.add(key)  # a second look before any verdict
                        self._start_probe(key, str(address))
                        continue
                result = ProbeResult.DEAD  # silent twice (or no second look to take)
            self._lvs.silent_once.discard(key)
            self._lvs.probe_cache[key] = (self._clock.monotonic(), result)
            round_keep_s = self._lvs.round_keep.pop(key, DEAD_RECHECK_S)
            if result is ProbeResult.SERVING and round_keep_s > DEAD_RECHECK_S:
                self._lvs.probe_keep[key] = round_keep_s
            else:  # anything but a live answer is looked at again within DEAD_RECHECK_S
                self._lvs.probe_keep.pop(key, None)
            self._verdict(key[0], key[1], result)

    def _still_registered(self, key: tuple[str, str]) -> bool:
        """True while node `key[0]`'s member key holds incarnation `key[1]` (an incarnation
        of "" stands for any agent without one, registered or not)."""
        return str(self.view.snapshot.members.get(key[0], {}).get("incarnation", "")) == key[1]

    def _probing(self, nodes: Iterable[str]) -> bool:
        """True while a probe of one of `nodes` is out (no verdict on it yet)."""
        wanted = set(nodes)
        return any(n in wanted for n, _ in self._lvs.probing)

    def _verdict(self, n: str, inc: str, result: ProbeResult) -> None:
        """What the probe of `n`'s incarnation `inc` says (see the module)."""
        if not self._still_registered((n, inc)):
            return  # a new incarnation registered meanwhile: the answer was of the old one
        lvs = self._lvs
        if result is ProbeResult.DEAD:
            if lvs.dead.get(n) != inc:
                lvs.dead[n] = inc
                self.journal.write("decision", f"node {n} confirmed dead by probe")
            return
        if lvs.dead.get(n) == inc:
            del lvs.dead[n]
            lvs.revived_s = self._clock.monotonic()
            self.journal.write("decision", f"node {n} answers again: no longer dead")
        if result is ProbeResult.NOT_SERVING:
            if lvs.unhealthy.get(n) != inc:
                lvs.unhealthy[n] = inc
                self.journal.write("decision", f"node {n} answers the probe NOT_SERVING: unhealthy")
        elif lvs.unhealthy.pop(n, None) is not None:
            self.journal.write("decision", f"node {n} answers the probe SERVING again")

    def _recheck_dead(self) -> None:
        """A node confirmed dead that still holds its registration is probed again now and
        then: if it answers (it was only slow or stopped for a while), it is no longer dead,
        and the leader takes it back as it would a joining node."""
        now = self._clock.monotonic()
        if not self._lvs.dead or now - self._lvs.dead_checked_s < DEAD_RECHECK_S:
            return
        self._lvs.dead_checked_s = now
        registered = [
            n
            for n, inc in self._lvs.dead.items()
            if self.view.snapshot.members.get(n, {}).get("incarnation") == inc
        ]
        for n, result in self._probe(registered).items():
            self._verdict(n, str(self.view.snapshot.members[n].get("incarnation", "")), result)

    def _confirm_dead(self, nodes: Iterable[str]) -> None:
        """Probe the suspects `nodes`: the verdicts (`_verdict`) of results known now are
        given now, the others' when their probes finish."""
        for n, result in self._probe(nodes).items():
            self._verdict(
                n, str(self.view.snapshot.members.get(n, {}).get("incarnation", "")), result
            )

    def _suspects(self, generation: int, nodes: Iterable[str]) -> list[str]:
        """The nodes of failed `generation` worth probing: those that did not report the
        failure themselves (a report is proof of life: a dead agent writes none)."""
        reports = self.view.snapshot.barriers.get(f"failed-{generation}", {})
        return sorted(set(nodes) - set(reports) - {self.node_id})
