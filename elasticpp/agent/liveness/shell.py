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

`Liveness` is built with its ports: the clock, the journal, the error policy, the view's
snapshot (members, barriers, the record, the leader), the etcd call that deposes a leader,
the dialer and wake. It owns its state as plain data (`step.LivenessState`); the probes out,
their pool and channels are its shell's. Other parts read `summary()`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from concurrent.futures import Future

from elasticpp.agent import probe
from elasticpp.agent.actions import Action, ConfirmDead, DeposeLeader, ProbeLeader
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.journal import ErrorPolicy, Journal
from elasticpp.agent.kernel.limits import DEAD_RECHECK_S, PROBE_RECHECK_PER_S, PROBE_THREADS
from elasticpp.agent.kernel.records import Record
from elasticpp.agent.kernel.summaries import LivenessSummary
from elasticpp.agent.liveness.step import (
    LeaderWatch,
    LivenessState,
    ProbeResult,
    leader_deposed,
    leader_probed,
    leader_watch_step,
    paced_keep_s,
)
from elasticpp.agent.probe import ProbeChannels
from elasticpp.agent.view.step import ViewSnapshot
from elasticpp.cluster.barriers import failed_barrier
from elasticpp.transport import Dialer

log = logging.getLogger("elasticpp.agent")

Key = tuple[str, str]  # (node, incarnation)


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


class Liveness:
    """The liveness part: probes of suspects and of the leader, and their verdicts."""

    def __init__(
        self,
        node_id: str,
        *,
        clock: Clock,
        journal: Journal,
        errors: ErrorPolicy,
        view: Callable[[], ViewSnapshot],
        depose: Callable[[str], bool],
        dialer: Dialer,
        wake: Callable[[], None],
    ) -> None:
        self.node_id = node_id
        self.state = LivenessState()
        self._clock = clock
        self._journal = journal
        self._errors = errors
        self._view = view
        self._depose = depose
        self._wake = wake
        self._pool = futures.ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="probe")
        self._channels = ProbeChannels(dialer=dialer)  # kept between probes
        # (node, incarnation) -> its probe: started, no verdict given yet
        self._probing: dict[Key, Future[ProbeResult]] = {}
        # Which finished probes wake the loop: what the probes' threads touch (locked).
        self._wakes = ProbeWakes()

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only this part emits."""
        executor.register(ProbeLeader, self._probe_leader)
        executor.register(DeposeLeader, self._depose_leader)
        executor.register(ConfirmDead, lambda a: self.confirm_dead(a.nodes))

    def summary(self) -> LivenessSummary:
        s = self.state
        return LivenessSummary(
            dead=dict(s.dead),
            unhealthy=dict(s.unhealthy),
            revived_s=s.revived_s,
            suspecting=bool(s.suspect_since),
        )

    def dead_now(self, members: Mapping[str, Record]) -> set[str]:
        """The nodes found dead that are still registered as that incarnation, or gone."""
        return self.state.dead_now(members)

    def close(self) -> None:
        """Stop the probes (those out are cancelled or left to finish unread)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._channels.close()

    # ------------------------------------------------------------------ the leader
    def check_leader(self, failure_reported: bool) -> list[Action]:
        """A follower's watch on the leader (`leader_watch_step`, pure): `failure_reported`,
        this node reported the current generation failed (a follower does not read the
        others' reports; a node that saw no failure has nothing to suspect). The probe's
        and the deposition's results come back to it as the executor applies them."""
        view = self._view()
        rec, leader = view.record, view.leader
        info = view.members.get(leader, {}) if leader else {}
        return leader_watch_step(
            self.state,
            LeaderWatch(
                now_s=self._clock.monotonic(),
                node_id=self.node_id,
                generation=rec.generation if rec else None,
                leader=leader,
                failure_reported=rec is not None and failure_reported,
                address=str(info.get("address") or ""),
                incarnation=str(info.get("incarnation", "")),
            ),
        )

    def _probe_leader(self, action: ProbeLeader) -> list[Action]:
        service = probe.node_service(action.leader, action.incarnation)
        result = probe.check(
            action.address,
            service=service if action.incarnation else "",
            channels=self._channels,
        )
        return leader_probed(self.state, action, result)

    def _depose_leader(self, action: DeposeLeader) -> list[Action]:
        return leader_deposed(self.state, action, self._depose(action.leader))

    # ------------------------------------------------------------------ suspects
    def suspects(self, generation: int, nodes: Iterable[str]) -> list[str]:
        """The nodes of failed `generation` worth probing: those that did not report the
        failure themselves (a report is proof of life: a dead agent writes none)."""
        reports = self._view().barriers.get(failed_barrier(generation), {})
        return sorted(set(nodes) - set(reports) - {self.node_id})

    def confirm_suspects(self, generation: int, nodes: Iterable[str]) -> bool:
        """The leader's probes of failed `generation`'s suspects among `nodes` (results are
        kept for DEAD_RECHECK_S, live answers of a large round longer: a failure that waits
        is no probe storm). True while the leader is to wait: the first round's verdicts
        are not all in (it re-plans once they are, never around a node it is about to find
        dead); later rounds it does not wait for."""
        suspects = self.suspects(generation, nodes)
        s = self.state
        if s.suspects_probed_gen != generation:
            self.unpace()  # a new failure: its suspects are probed afresh
        if s.suspects_probed_gen == generation and not self.probing(suspects):
            s.verdicts_gen = generation  # the first round's verdicts are in
        self.confirm_dead(suspects)
        s.suspects_probed_gen = generation
        return s.verdicts_gen != generation and self.probing(suspects)

    def confirm_dead(self, nodes: Iterable[str]) -> None:
        """Probe the suspects `nodes`: the verdicts (`_verdict`) of results known now are
        given now, the others' when their probes finish."""
        members = self._view().members
        for n, result in self.probe(nodes).items():
            self._verdict(n, str(members.get(n, {}).get("incarnation", "")), result)

    def probe(self, nodes: Iterable[str]) -> dict[str, ProbeResult]:
        """The health of `nodes` known now (this node and nodes without an address left out):
        results younger than DEAD_RECHECK_S for the node's incarnation (a SERVING answer of
        a large round: younger than its `paced_keep_s`). The others' probes are
        started on the bounded pool (never twice at once); their verdicts come with a later
        cycle (`probes_done`, first in the leader's), woken by the result."""
        now = self._clock.monotonic()
        s = self.state
        cache, keep = s.probe_cache, s.probe_keep
        for key in [k for k, (at, _) in cache.items() if now - at >= keep.get(k, DEAD_RECHECK_S)]:
            del cache[key]
            keep.pop(key, None)
        results: dict[str, ProbeResult] = {}
        wanted = sorted(set(nodes) - {self.node_id})
        # One round at a time: while any of `nodes` is being probed, none is probed anew. A
        # round of thousands of nodes outlasts DEAD_RECHECK_S; re-probing its first answers
        # meanwhile would keep it from ever ending.
        start = not self.probing(wanted)
        due: list[tuple[Key, str]] = []
        members = self._view().members
        for n in wanted:
            info = members.get(n, {})
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
            s.round_keep[key] = round_keep_s
            self._start_probe(key, address)
        return results

    def unpace(self) -> None:
        """A new failure: the answers kept past DEAD_RECHECK_S (`paced_keep_s`) are not
        reused for it; its suspects are probed afresh."""
        self.state.probe_keep.clear()

    def probing(self, nodes: Iterable[str]) -> bool:
        """True while a probe of one of `nodes` is out (no verdict on it yet)."""
        wanted = set(nodes)
        return any(n in wanted for n, _ in self._probing)

    def probes(self) -> dict[Key, bool]:
        """The probes out (no verdict given on them yet), each with whether it finished."""
        return {key: future.done() for key, future in self._probing.items()}

    def _start_probe(self, key: Key, address: str) -> None:
        """Probe node `key[0]`'s incarnation `key[1]` at `address` on the pool; its result
        wakes the loop if it needs a look or ends the round (`ProbeWakes`)."""
        n, inc = key
        wakes = self._wakes
        wakes.started()
        try:
            future = self._pool.submit(
                probe.check,
                address,
                service=probe.node_service(n, inc) if inc else "",
                channels=self._channels,
            )
        except BaseException:
            wakes.not_started()
            raise
        future.add_done_callback(lambda f: wakes.finished(f) and self._wake())
        self._probing[key] = future

    def settle(self) -> None:
        """Before the leader's cycle: the verdicts of the probes finished since the last one,
        and a node found dead that still holds its registration probed again when due."""
        self.probes_done()
        self.recheck_dead()

    def probes_done(self) -> None:
        """The verdicts of the probes that have finished (see the module)."""
        s = self.state
        for key, future in list(self._probing.items()):
            if not future.done():
                continue
            del self._probing[key]
            if future.cancelled():
                s.round_keep.pop(key, None)
                continue  # the pool shut down: the agent is stopping
            try:
                result = future.result()
            except Exception as exc:  # a probe that raised says nothing of the node
                s.round_keep.pop(key, None)
                s.silent_once.discard(key)
                self._errors.survive("probe", exc)
                continue
            if result is ProbeResult.SILENT:
                if key not in s.silent_once:
                    address = self._view().members.get(key[0], {}).get("address")
                    if address and self._still_registered(key):
                        s.silent_once.add(key)  # a second look before any verdict
                        self._start_probe(key, str(address))
                        continue
                result = ProbeResult.DEAD  # silent twice (or no second look to take)
            s.silent_once.discard(key)
            s.probe_cache[key] = (self._clock.monotonic(), result)
            round_keep_s = s.round_keep.pop(key, DEAD_RECHECK_S)
            if result is ProbeResult.SERVING and round_keep_s > DEAD_RECHECK_S:
                s.probe_keep[key] = round_keep_s
            else:  # anything but a live answer is looked at again within DEAD_RECHECK_S
                s.probe_keep.pop(key, None)
            self._verdict(key[0], key[1], result)

    def _still_registered(self, key: Key) -> bool:
        """True while node `key[0]`'s member key holds incarnation `key[1]` (an incarnation
        of "" stands for any agent without one, registered or not)."""
        return str(self._view().members.get(key[0], {}).get("incarnation", "")) == key[1]

    def _verdict(self, n: str, inc: str, result: ProbeResult) -> None:
        """What the probe of `n`'s incarnation `inc` says (see the module)."""
        if not self._still_registered((n, inc)):
            return  # a new incarnation registered meanwhile: the answer was of the old one
        s, journal = self.state, self._journal
        if result is ProbeResult.DEAD:
            if s.dead.get(n) != inc:
                s.dead[n] = inc
                journal.write("decision", f"node {n} confirmed dead by probe")
            return
        if s.dead.get(n) == inc:
            del s.dead[n]
            s.revived_s = self._clock.monotonic()
            journal.write("decision", f"node {n} answers again: no longer dead")
        if result is ProbeResult.NOT_SERVING:
            if s.unhealthy.get(n) != inc:
                s.unhealthy[n] = inc
                journal.write("decision", f"node {n} answers the probe NOT_SERVING: unhealthy")
        elif s.unhealthy.pop(n, None) is not None:
            journal.write("decision", f"node {n} answers the probe SERVING again")

    def recheck_dead(self) -> None:
        """A node confirmed dead that still holds its registration is probed again now and
        then: if it answers (it was only slow or stopped for a while), it is no longer dead,
        and the leader takes it back as it would a joining node."""
        now = self._clock.monotonic()
        s = self.state
        if not s.dead or now - s.dead_checked_s < DEAD_RECHECK_S:
            return
        s.dead_checked_s = now
        members = self._view().members
        registered = [
            n for n, inc in s.dead.items() if members.get(n, {}).get("incarnation") == inc
        ]
        for n, result in self.probe(registered).items():
            self._verdict(n, str(self._view().members[n].get("incarnation", "")), result)
