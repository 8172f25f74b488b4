"""The liveness part's decisions, pure: a follower's watch on the leader (suspect it, probe
it, depose it), and how long a probe's answer is kept. The invariants of suspicion and probes
are in `shell`'s docstring."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticpp.agent.actions import Action, DeposeLeader, Event, ProbeLeader, Reread
from elasticpp.agent.kernel.limits import DEAD_RECHECK_S, LEADER_SUSPECT_S
from elasticpp.agent.kernel.records import Record


class ProbeResult(enum.Enum):
    """What a probe of an agent's health service found."""

    SERVING = "serving"
    NOT_SERVING = "not_serving"
    DEAD = "dead"  # the connection was refused
    SILENT = "silent"  # no answer within the probe's budget


def paced_keep_s(round_size: int, per_s: float) -> float:
    """How long a SERVING answer of a round of `round_size` probes is kept: DEAD_RECHECK_S,
    or as long as re-probing the round at `per_s` probes a second takes."""
    return max(DEAD_RECHECK_S, round_size / per_s)


@dataclass
class LivenessState:
    """The liveness part's state, plain data: written on the loop by the `Liveness` object
    and the steps here (the probes out and the count of them are its shell's)."""

    dead: dict[str, str] = field(default_factory=dict)  # node -> incarnation found dead
    dead_checked_s: float = 0.0  # monotonic: dead nodes last probed again
    unhealthy: dict[str, str] = field(default_factory=dict)  # node -> NOT_SERVING incarnation
    probe_cache: dict[tuple[str, str], tuple[float, ProbeResult]] = field(default_factory=dict)
    # how long a cached SERVING answer of a large round is kept (DEAD_RECHECK_S if absent)
    probe_keep: dict[tuple[str, str], float] = field(default_factory=dict)
    round_keep: dict[tuple[str, str], float] = field(default_factory=dict)  # probes out
    silent_once: set[tuple[str, str]] = field(default_factory=set)  # second probe out
    suspect_since: dict[int, float] = field(default_factory=dict)  # generation -> first seen
    suspects_probed_gen: int = 0  # the failed generation whose suspects' probes started
    verdicts_gen: int = 0  # the failed generation whose suspects' first verdicts are all in
    leader_probed_s: float = 0.0
    leader_silent: tuple[str, str] | None = None  # (leader, incarnation) silent to a probe
    revived_s: float = 0.0  # monotonic: a node found dead last answered again

    def dead_now(self, members: Mapping[str, Record]) -> set[str]:
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
