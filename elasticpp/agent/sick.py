"""Sick nodes are set aside, and a job that cannot make progress ends: the leader's
`SickNodes` part, pure (no I/O, the clock is an argument), owning its state.

Why: a node that stays sick (a state disk too small, a worker that will not die, a spare
that never becomes ready, an agent whose loop is wedged) would otherwise be put back into
every new plan, and the job would re-plan the same nodes for ever.

The rules, in the order the leader applies them:

- **Blame.** When a generation fails, the nodes to blame are those whose own failure report
  blames themselves (`culprit`: a disk error, a spare never ready, a worker that will not
  die, unhealthy GPUs) and, when no report does, the earliest reporter(s) among the reports
  that did not follow a peer's loss (a worker crash makes its peers fail after it with
  "connection closed by peer": those reports say so and are blamed only when all do).
  Nodes that did not arrive at `stopped-G` within the stop deadline are blamed too (a
  wedged agent).
- **Strikes.** A blamed node gets a strike. `strikes_to_quarantine` consecutive strikes, or
  one `severe` one (a disk that cannot hold the state, a worker that survives SIGKILL, a
  node that never arrived), quarantine it. A node whose ranks completed a step of a
  generation (it arrived at `stepped-G`) has its strikes cleared: the strikes are consecutive
  failed generations, not a lifetime count. Starting is not enough (a worker that dies in
  its first step was cleared at every start and never quarantined).
- **Quarantine with exponential backoff.** The n-th quarantine of a node lasts
  `base_s · 2^(n−1)`, at most `max_s`; then the node is re-admitted (planned again, as a
  join). A new incarnation of its agent (restarted, say after an operator fixed the disk) is
  re-admitted at once; the count stays, so a node that keeps failing waits longer each time.
  An operator can lift a quarantine at any time (`elasticpp ctl lift NODE`).
- **The failure budget.** Every failed generation (a loss or a failure, not a join or drain)
  is counted; more than `max_failures` within `window_s` ends the job with the reason (as
  torchrun's `--max-restarts` and JobSet's `maxRestarts` do), instead of re-planning for ever.

The leader publishes quarantines in etcd (`quarantine/<node>`, see
`elasticpp.cluster.health`); a new leader loads them. Strikes go on from term to term: each
generation record carries the strikes of the nodes it plans (`carried`, at most
CARRIED_STRIKES nodes, the most struck first), and a new leader starts from the newest
record's (`seed`); a node's step in a generation, seen by any term, clears its own. (A leader lost
to an overloaded machine once reset them every few generations, and a sick node at 1,024
simulated nodes was never quarantined.) The failure budget's window starts afresh with each
term (documented in docs/cluster.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from elasticpp.errors import ConfigError

CARRIED_STRIKES = 64  # nodes whose strikes a generation record carries (bounded record)

# Reports whose `at` lies this close to the earliest one share the blame (clocks of
# different nodes, and a peer's collective failing a moment after the cause).
EARLIEST_WINDOW_S = 0.5


@dataclass(frozen=True)
class SickPolicy:
    strikes_to_quarantine: int = 3
    base_s: float = 60.0
    max_s: float = 3600.0
    max_failures: int = 50
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.strikes_to_quarantine < 1:
            raise ConfigError(f"quarantine_after must be >= 1, got {self.strikes_to_quarantine!r}")
        if not 0 < self.base_s <= self.max_s:
            raise ConfigError(
                f"quarantine_s ({self.base_s!r}) must be > 0 and <= quarantine_max_s "
                f"({self.max_s!r})"
            )
        if self.max_failures < 1 or self.window_s <= 0:
            raise ConfigError(
                f"max_failures must be >= 1 and failure_window_s > 0, got "
                f"{self.max_failures!r} and {self.window_s!r}"
            )

    def duration_s(self, count: int) -> float:
        """How long the `count`-th quarantine of a node lasts."""
        return float(min(self.max_s, self.base_s * 2 ** max(0, count - 1)))


@dataclass(frozen=True)
class Report:
    """One node's failure report of a generation, as the leader reads it."""

    node: str
    reason: str
    at: float  # wall time on the reporting node
    culprit: bool = False  # the node blames itself (its disk, its spares, its GPUs)
    severe: bool = False  # quarantine at the first strike
    followed_a_peer: bool = False  # its workers failed because a peer went away


@dataclass(frozen=True)
class Quarantined:
    """One quarantine, as published in etcd. Times are wall-clock seconds (they cross nodes
    and leader terms); `until` is when the node is re-admitted."""

    node: str
    reason: str
    since: float
    until: float
    count: int  # how many times this node was quarantined, this one included
    incarnation: str  # the agent incarnation quarantined; a new one is re-admitted


@dataclass(frozen=True)
class Quarantine:
    """Action: publish this quarantine."""

    entry: Quarantined


@dataclass(frozen=True)
class Readmit:
    """Action: remove the quarantine of `node` (expired, or its agent restarted)."""

    node: str
    reason: str


@dataclass(frozen=True)
class EndJob:
    """Action: the job cannot make progress; end it with `reason`."""

    reason: str


Action = Quarantine | Readmit | EndJob


def blame(reports: Iterable[Report]) -> dict[str, Report]:
    """The nodes to blame for a failed generation, with the report that blames each."""
    reports = list(reports)
    culprits = {r.node: r for r in reports if r.culprit}
    if culprits or not reports:
        return culprits
    # A report whose workers failed because a peer went away is a victim's: blamed only when
    # every report is one (elasticpp.train.worker.peerloss).
    reports = [r for r in reports if not r.followed_a_peer] or reports
    first = min(r.at for r in reports)
    return {r.node: r for r in reports if r.at - first <= EARLIEST_WINDOW_S}


@dataclass
class SickNodes:
    """The leader's memory of sick nodes. One writer: the leader's loop, through the
    methods below, each of which takes `now` (wall seconds) and returns actions."""

    policy: SickPolicy
    quarantined: dict[str, Quarantined] = field(default_factory=dict)
    strikes: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # quarantines per node so far
    failures: deque[float] = field(default_factory=deque)  # when generations failed
    judged: int = 0  # the newest generation whose failure was judged
    ended: bool = False
    _not_serving: dict[str, str] = field(default_factory=dict)  # node -> incarnation judged

    def carried(self) -> dict[str, int]:
        """The strikes a generation record carries into later terms (see the module)."""
        most = sorted(self.strikes.items(), key=lambda kv: (-kv[1], kv[0]))[:CARRIED_STRIKES]
        return dict(sorted(most))

    def seed(self, carried: object) -> None:
        """Start a term from the strikes a generation record carried; entries that are not
        a node id with a positive count (a corrupt or foreign record) are left out."""
        if not isinstance(carried, Mapping):
            return
        for node, count in carried.items():
            if isinstance(node, str) and type(count) is int and count > 0:
                self.strikes[node] = max(self.strikes.get(node, 0), count)

    def load(self, published: Mapping[str, Quarantined]) -> None:
        """Take the quarantines etcd holds (a new term, an operator's lift)."""
        self.quarantined = dict(published)
        for node, q in published.items():
            self.counts[node] = max(self.counts.get(node, 0), q.count)

    def judge(
        self,
        generation: int,
        reports: Iterable[Report],
        incarnations: Mapping[str, str],
        now: float,
        *,
        lost: Iterable[str] = (),
    ) -> list[Action]:
        """Generation `generation` failed (`reports` from its nodes, `lost` nodes gone):
        strike the nodes to blame, quarantine those over the line, count the failure
        against the budget. Judged once per generation; later calls return nothing."""
        if generation <= self.judged or self.ended:
            return []
        self.judged = generation
        actions: list[Action] = []
        blamed = blame(reports)
        for node in sorted(blamed):
            r = blamed[node]
            self.strikes[node] = self.strikes.get(node, 0) + 1
            if r.severe or self.strikes[node] >= self.policy.strikes_to_quarantine:
                why = r.reason
                if not r.severe:
                    why = f"{why} ({self.strikes[node]} failed generations in a row)"
                actions.extend(self._quarantine(node, why, incarnations.get(node, ""), now))
        for node in sorted(set(lost) - set(blamed)):
            # A node lost generation after generation (an agent that keeps dying or whose
            # lease keeps lapsing) is as sick as one that reports failures.
            self.strikes[node] = self.strikes.get(node, 0) + 1
            if self.strikes[node] >= self.policy.strikes_to_quarantine:
                why = f"lost {self.strikes[node]} generations in a row"
                actions.extend(self._quarantine(node, why, incarnations.get(node, ""), now))
        actions.extend(self._count_failure(now))
        return actions

    def exclude(self, node: str, reason: str, incarnation: str, now: float) -> list[Action]:
        """Quarantine `node` at once (it missed a deadline everyone else met)."""
        self.strikes[node] = self.strikes.get(node, 0) + 1
        return self._quarantine(node, reason, incarnation, now)

    def not_serving(self, node: str, incarnation: str, now: float) -> list[Action]:
        """A probe found `node`'s agent NOT_SERVING (its loop stalled): quarantine it, once
        per incarnation (a stale observation must not undo its re-admission)."""
        if self._not_serving.get(node) == incarnation:
            return []
        self._not_serving[node] = incarnation
        why = "answers NOT_SERVING: its decision loop has stalled"
        return self.exclude(node, why, incarnation, now)

    def trained(self, nodes: Iterable[str]) -> None:
        """`nodes` completed a step of a generation: their strikes start again at zero."""
        for node in nodes:
            self.strikes.pop(node, None)

    def expire(self, incarnations: Mapping[str, str], now: float) -> list[Action]:
        """Re-admit nodes whose quarantine ran out, or whose agent restarted since."""
        actions: list[Action] = []
        for node, q in sorted(self.quarantined.items()):
            current = incarnations.get(node)
            if now >= q.until:
                why = f"quarantine of {q.until - q.since:.0f} s over"
            elif current is not None and q.incarnation and current != q.incarnation:
                why = "its agent restarted"
            else:
                continue
            del self.quarantined[node]
            self.strikes.pop(node, None)
            actions.append(Readmit(node, why))
        return actions

    def lifted(self, node: str) -> None:
        self.quarantined.pop(node, None)
        self.strikes.pop(node, None)

    def _quarantine(self, node: str, reason: str, incarnation: str, now: float) -> list[Action]:
        if node in self.quarantined:
            return []
        count = self.counts.get(node, 0) + 1
        self.counts[node] = count
        entry = Quarantined(
            node=node,
            reason=reason,
            since=now,
            until=now + self.policy.duration_s(count),
            count=count,
            incarnation=incarnation,
        )
        self.quarantined[node] = entry
        return [Quarantine(entry)]

    def _count_failure(self, now: float) -> list[Action]:
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.policy.window_s:
            self.failures.popleft()
        if len(self.failures) <= self.policy.max_failures:
            return []
        self.ended = True
        return [
            EndJob(
                f"failure budget spent: {len(self.failures)} failed generations within "
                f"{self.policy.window_s:.0f} s (max_failures is {self.policy.max_failures})"
            )
        ]
