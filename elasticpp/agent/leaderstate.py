"""The leader part's own state, as one object with one writer (the leader's steps, on the
decision loop). A new term starts a new one: what a leader knows of a generation's
transition (whether its resume instruction and timeline are written) is re-derived from
etcd by the next leader, never read from this node's follower state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elasticpp.agent.sick import SickNodes

# The first of N draws comes after spread/N on average (4 ms), however large the spread: what
# the spread sets is how many nodes draw a turn before the winner's key reaches them.
CAMPAIGN_SPREAD_S_PER_NODE = 0.004  # 4 s of spread at 1,000 nodes
CAMPAIGN_SPREAD_MAX_S = 8.0  # reached at 2,000 nodes


@dataclass
class LeaderState:
    sick: SickNodes  # quarantines, strikes, the failure budget (elasticpp.agent.sick)
    leadership: Any = None  # the term (cluster.leases.Leadership) while this node leads
    tcpstore: Any = None  # the workers' rendezvous store this term hosts
    tcpstore_socket: Any = None  # its listening socket, bound to the advertised address
    rendezvous_secret: str = ""  # the term's secret behind each generation's store prefix
    store_address: str | None = None
    # re-planning
    replan_failures: int = 0  # generations in a row that failed before they trained
    replan_not_before_s: float = 0.0  # monotonic: the backoff between failed generations
    written_generation: int = 0  # the newest generation this term wrote: nothing is
    # decided again until the view holds it (its own write reaches it through the watch)
    last_wait: str = ""  # the last "waiting"/"cannot" sentence, logged once
    safe_checked_s: float = 0.0  # monotonic: when the safe step was last computed
    # The steady leader's view, remembered while its inputs are the same objects (a cached
    # read that did not change is the same object): (record, members, restarted nodes) and
    # (members, incarnations). Recomputing them cost every tick O(N) hashes and dicts.
    restarted_memo: tuple[Any, Any, frozenset[str]] | None = None
    incarnations_memo: tuple[Any, dict[str, str]] | None = None
    # (members, dead, quarantined, their `decide.NodeLists`): sorting every member and
    # looking at each was ~4 ms of every leader turn at 2,048 nodes
    lists_memo: tuple[Any, frozenset[str], frozenset[str], Any] | None = None
    compacted_s: float | None = None  # monotonic: etcd's history last compacted, or the
    # term's first look (the first compaction comes a period into the term)
    # the transition of `generation` (reset by `at` when the generation changes)
    generation: int = 0
    resume_written: bool = False
    timeline_written: bool = False
    missing_probed_s: float = 0.0  # monotonic: when nodes missing at stopped-G were probed
    stop_wait_since_s: float | None = None  # monotonic: first look at a stopped-G wait
    pull: Any = None  # the future of the holdings pull (elasticpp.agent.pull), once asked
    pull_not_before_s: float = 0.0  # monotonic: a pull that failed is asked again after this
    pull_set_aside: bool = False  # the nodes a pull found unanswering were set aside
    unreadable: frozenset[str] = frozenset()  # nodes whose stopped-G value was said unreadable
    # node -> (its stopped-G value, the value's parse), kept while the value is the same
    # object (`resumestep._arrivals`)
    arrivals_parsed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    wait_published: str = ""  # why the generation cannot resume, as etcd holds it
    wait_look_s: float = 0.0  # monotonic: while waiting, when the holdings are looked at again
    resolved: Any = None  # the pull result (or arrivals) last resolved: a wait does not
    # resolve the same again
    # monotonic: when this node campaigns, once it has seen no leader (`campaign_delay_s`)
    campaign_at_s: float | None = None

    def at(self, generation: int, now_s: float) -> LeaderState:
        """This state, with the per-generation fields of `generation` (fresh if new)."""
        if generation != self.generation:
            self.generation = generation
            self.resume_written = False
            self.timeline_written = False
            self.missing_probed_s = now_s
            self.stop_wait_since_s = None
            self.pull = None
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
