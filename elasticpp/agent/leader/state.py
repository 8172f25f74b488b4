"""The leader part's own state, as plain data with one writer (the leader's steps, on the
decision loop). A new term starts a new one: what a leader knows of a generation's
transition (whether its resume instruction and timeline are written) is re-derived from
etcd by the next leader, never read from this node's follower state. The term's handle, the
rendezvous store it hosts, the holdings pull in flight and the leader's memos of its view
are its shell's (elasticpp.agent.leader.shell). `PulledHoldings` is what a pull brings back
(elasticpp.agent.leader.pull), as the step reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticpp.agent.sick import SickNodes
from elasticpp.store.digest import HoldingsDigest
from elasticpp.store.holdings import NodeHoldings

# The first of N draws comes after spread/N on average (4 ms), however large the spread: what
# the spread sets is how many nodes draw a turn before the winner's key reaches them.
CAMPAIGN_SPREAD_S_PER_NODE = 0.004  # 4 s of spread at 1,000 nodes
CAMPAIGN_SPREAD_MAX_S = 8.0  # reached at 2,000 nodes


# A node's `stopped-G` value as the leader parsed it: a digest, full holdings (a small
# node's), or why it is unreadable.
Arrival = HoldingsDigest | NodeHoldings | str


@dataclass(frozen=True)
class PulledHoldings:
    """What a holdings pull brought back, for generation `generation`."""

    generation: int
    holdings: Mapping[str, NodeHoldings] = field(default_factory=dict)
    unanswered: Mapping[str, str] = field(default_factory=dict)  # node -> why
    not_asked: tuple[str, ...] = ()  # the deadline passed before their turn: not their fault
    moved_on: Mapping[str, str] = field(default_factory=dict)  # node -> its refusal
    disk: NodeHoldings | None = None
    held: bool = False  # some node's digest says it holds committed steps
    seconds: float = 0.0
    error: str = ""


@dataclass
class LeaderState:
    sick: SickNodes  # quarantines, strikes, the failure budget (elasticpp.agent.sick)
    rendezvous_secret: str = ""  # the term's secret behind each generation's store prefix
    # re-planning
    replan_failures: int = 0  # generations in a row that failed before they trained a step
    replan_not_before_s: float = 0.0  # monotonic: the backoff between failed generations
    written_generation: int = 0  # the newest generation this term wrote: nothing is
    # decided again until the view holds it (its own write reaches it through the watch)
    last_wait: str = ""  # the last "waiting"/"cannot" sentence, logged once
    safe_checked_s: float = 0.0  # monotonic: when the safe step was last computed
    compacted_s: float | None = None  # monotonic: etcd's history last compacted, or the
    # term's first look (the first compaction comes a period into the term)
    # the transition of `generation` (reset by `at` when the generation changes)
    generation: int = 0
    resume_written: bool = False
    timeline_written: bool = False
    # the `stepped-G` arrivals last looked at (the cache's object, the same while unchanged)
    # and the nodes whose strikes they cleared
    stepped_seen: object | None = None
    stepped_cleared: frozenset[str] = frozenset()
    missing_probed_s: float = 0.0  # monotonic: when nodes missing at stopped-G were probed
    stop_wait_since_s: float | None = None  # monotonic: first look at a stopped-G wait
    pull_asked: bool = False  # the holdings pull was started (its result: `obs.pulled`)
    pull_not_before_s: float = 0.0  # monotonic: a pull that failed is asked again after this
    pull_set_aside: bool = False  # the nodes a pull found unanswering were set aside
    unreadable: frozenset[str] = frozenset()  # nodes whose stopped-G value was said unreadable
    # node -> (its stopped-G value, the value's parse), kept while the value is the same
    # object (`resume._arrivals`)
    arrivals_parsed: dict[str, tuple[object, Arrival]] = field(default_factory=dict)
    wait_published: str = ""  # why the generation cannot resume, as etcd holds it
    wait_look_s: float = 0.0  # monotonic: while waiting, when the holdings are looked at again
    # the pull result (or the arrivals) last resolved: a wait does not resolve the same again
    resolved: PulledHoldings | Mapping[str, object] | None = None
    # monotonic: when this node campaigns, once it has seen no leader (`campaign_delay_s`)
    campaign_at_s: float | None = None

    def at(self, generation: int, now_s: float) -> LeaderState:
        """This state, with the per-generation fields of `generation` (fresh if new)."""
        if generation != self.generation:
            self.generation = generation
            self.resume_written = False
            self.timeline_written = False
            self.stepped_seen = None
            self.stepped_cleared = frozenset()
            self.missing_probed_s = now_s
            self.stop_wait_since_s = None
            self.pull_asked = False
            self.pull_not_before_s = 0.0
            self.pull_set_aside = False
            self.unreadable = frozenset()
            self.arrivals_parsed = {}
            self.wait_published = ""
            self.wait_look_s = 0.0
            self.resolved = None
        return self


def campaign_spread_s(nodes: int) -> float:
    """The spread of campaign turns in a job of `nodes`: CAMPAIGN_SPREAD_S_PER_NODE each, at
    most CAMPAIGN_SPREAD_MAX_S."""
    return min(CAMPAIGN_SPREAD_MAX_S, CAMPAIGN_SPREAD_S_PER_NODE * max(1, nodes))


def campaign_delay_s(nodes: int, draw: float) -> float:
    """How long a node that sees no leader waits before it campaigns: a draw in [0, 1)
    over the job's `campaign_spread_s`. When a leader's key goes, every node sees it at
    once; campaigning at once, each would read the key (and the first few also grant a
    lease, try the key and revoke the lease) while the cluster is already changing. Spread,
    the first campaign wins and the others see its key before their turn: a few campaign,
    not all (at 1,024 simulated nodes and a spread of 1 s, 757 did: a win took about a
    second to reach every node of a loaded machine)."""
    if not 0.0 <= draw < 1.0:
        raise ValueError(f"draw {draw!r}: must be in [0, 1)")
    return draw * campaign_spread_s(nodes)
