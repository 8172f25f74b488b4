"""What the layout search (elasticpp.plan.search) knows of a layout before it meets a
cluster, and of a cluster before it meets a layout: a `Profile` (one per (p, t, b,
recompute): balanced stages, the slowest stage's time, the largest micro-batch count whose
memory fits), a cluster's `Shape` for one t (how many tensor-parallel groups it holds and
where node boundaries fall), and a `Choice` (a profile with its best d on one cluster).
Pure: no I/O; costs come from `elasticpp.plan.cost`.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticpp.plan import cost
from elasticpp.plan.specs import ClusterSpec

NO_LIMIT = 1 << 62  # a micro-batch count larger than any real one: memory never binds


@dataclass(frozen=True)
class Profile:
    """What a layout costs apart from d and the cluster's shape."""

    pp: int
    tp: int
    micro_batch: int
    recompute: bool
    stages: tuple[tuple[int, int], ...]
    # (index of the first stage of the kind, blocks, is first, is last): the distinct stages
    kinds: tuple[tuple[int, int, bool, bool], ...]
    compute_slot: float  # the slowest stage's forward + backward of one micro-batch
    p2p_intra: float  # the two boundary transfers of a slot, on NVLink (0 when pp == 1)
    p2p_inter: float  # ... on the network
    max_stage_params: int
    optimizer_seconds: float
    max_in_flight_fit: int  # the largest m_max whose memory fits; NO_LIMIT; 0: never fits
    min_memory_bytes: float  # with one micro-batch in flight
    memory: cost.MemoryCosts

    def memory_bytes(self, mc: cost.ModelCosts, m_max: int) -> float:
        return memory_bytes(mc, self.memory, self.kinds, self.pp, m_max)


def memory_bytes(
    mc: cost.ModelCosts,
    mem: cost.MemoryCosts,
    kinds: tuple[tuple[int, int, bool, bool], ...],
    pp: int,
    m_max: int,
) -> float:
    """The largest stage's memory: per kind of stage, its earliest (most in flight) stage."""
    return max(
        cost.stage_memory_bytes(mc, mem, n, first, last, min(pp - s, m_max))
        for s, n, first, last in kinds
    )


@dataclass(frozen=True)
class Shape:
    """A cluster's shape for one t: how many TP groups it holds and where nodes break."""

    groups: int  # TP groups the whole cluster holds
    first_node_groups: int  # groups on the first node that holds any: DP stays intra below it
    # (group count, cumulative groups through the first node with that count): where a
    # replica of p stages first straddles a node boundary
    breaks: tuple[tuple[int, int], ...]

    def straddle_replica(self, pp: int) -> int:
        """Replicas `[0, result)` each sit inside one node (p2p on NVLink)."""
        first = NO_LIMIT
        for count, cumulative in self.breaks:
            if count % pp:
                first = min(first, cumulative // pp)
        return first

    @classmethod
    def of(cls, cluster: ClusterSpec, tp: int) -> Shape:
        counts = [n.gpus // tp for n in cluster.nodes]
        breaks: dict[int, int] = {}
        cumulative = 0
        for count in counts[:-1]:  # the end of the last node bounds d, it is not crossed
            cumulative += count
            breaks.setdefault(count, cumulative)
        return cls(
            groups=sum(counts),
            first_node_groups=next((c for c in counts if c), 0),
            breaks=tuple(sorted(breaks.items())),
        )

    @classmethod
    def uniform(cls, gpus_per_node: int, tp: int, nodes: int) -> Shape:
        g = gpus_per_node // tp
        return cls(groups=g * nodes, first_node_groups=g, breaks=((g, g),) if nodes > 1 else ())


@dataclass(frozen=True)
class Choice:
    """A profile with its best d on one cluster."""

    key: tuple[float, int, int, int, int, int, bool]
    profile: Profile
    dp: int
    m_max: int

    @property
    def step_seconds(self) -> float:
        return self.key[0]


def largest_fitting_m(
    mc: cost.ModelCosts,
    mem: cost.MemoryCosts,
    kinds: tuple[tuple[int, int, bool, bool], ...],
    pp: int,
    capacity: float,
) -> int:
    """The largest m_max whose memory fits (memory grows with m up to m = p)."""
    if memory_bytes(mc, mem, kinds, pp, pp) <= capacity:
        return NO_LIMIT
    lo, hi = 0, pp - 1  # lo fits (0 = nothing), the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if memory_bytes(mc, mem, kinds, pp, mid) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo
