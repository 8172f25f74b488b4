"""Which step to resume from, and where every rank of a new plan gets its pieces. Pure.

`resolve` reads what the live nodes (and, last, the persistent checkpoint) hold and returns
a `ResumePlan`: the newest step whose every unit of the model has a complete tensor-parallel
slice set available (any tp size: the worker reshards), and for each rank of the target plan
the `Fetch`es it needs. Steps are tried newest first in commit order: by the newest
(epoch, generation) that committed them, then by number. So after an etcd wipe (a new
epoch, generation numbers restarting at 1) the steps the new epoch committed come before
those of older epochs, and before those the new epoch has committed, the newest state of
the older epochs is resumed. For a unit a rank needs, it takes exactly its own slice when a piece of
the target's tp size holds it, else every slice of a complete set of another tp size.

Sources of a piece, in order of preference:
1. local    the rank's own node holds it (its own step or a replica it keeps);
2. peer     a live node's own pieces (a data-parallel twin's, or the node that ran the stage);
3. replica  a live node's replica of another node's pieces;
4. disk     the persistent checkpoint.
Among the sources of the best kind the one with the fewest bytes assigned so far is taken
(ties by node id), so the load spreads deterministically. Ranks on one node that need the
same piece share one transfer (`ResumePlan.node_fetches`).

Cost, so that the leader re-plans thousands of nodes within a second: one entry per held
step (not per piece) until a step is chosen; then per piece a rank needs, a lookup in its
node's own holdings, and for a piece the node lacks, the least-loaded source from a queue
of that piece's sources (`_Queue`), never a scan of every holder per rank.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.errors import StateUnavailableError
from elasticpp.plan.layout import Plan
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings, PieceInfo

__all__ = ["DISK_SOURCE", "Fetch", "FetchKind", "ResumePlan", "resolve"]


class FetchKind(enum.Enum):
    LOCAL = "local"
    PEER = "peer"
    REPLICA = "replica"
    DISK = "disk"


class Fetch(NamedTuple):
    """One piece a rank needs at the resume step, and where to take it from.

    A named tuple, like `PieceInfo`: a resume of thousands of ranks makes hundreds of
    thousands of these, and a tuple is built at a fraction of a frozen dataclass's cost."""

    piece_name: str
    origin_node: str  # whose step directory holds it (DISK_SOURCE for the checkpoint)
    source_node: str  # the node to read it from (DISK_SOURCE for the checkpoint)
    kind: FetchKind
    size: int
    sha256: str


@dataclass(frozen=True)
class ResumePlan:
    step: int
    generation: int
    units: tuple[str, ...]  # the model's, in order
    fetches: Mapping[int, tuple[Fetch, ...]]  # rank -> what it needs, in unit order
    rank_nodes: Mapping[int, str]  # rank -> node it runs on

    def node_fetches(self, node_id: str) -> tuple[Fetch, ...]:
        """Distinct fetches of the ranks on `node_id` (one transfer per piece per node)."""
        seen: dict[tuple[str, str, str], Fetch] = {}
        for rank, fetches in sorted(self.fetches.items()):
            if self.rank_nodes[rank] == node_id:
                for f in fetches:
                    seen.setdefault((f.piece_name, f.origin_node, f.source_node), f)
        return tuple(seen.values())

    def counts(self) -> dict[FetchKind, int]:
        """Distinct transfers (per node) of each kind."""
        out = dict.fromkeys(FetchKind, 0)
        for node in sorted(set(self.rank_nodes.values())):
            for f in self.node_fetches(node):
                out[f.kind] += 1
        return out

    def bytes_moved(self) -> int:
        """Bytes that cross the network or come from disk (everything but local pieces)."""
        return sum(
            f.size
            for node in sorted(set(self.rank_nodes.values()))
            for f in self.node_fetches(node)
            if f.kind is not FetchKind.LOCAL
        )

    def describe(self) -> str:
        counts = self.counts()
        return (
            f"resume at step {self.step} (generation {self.generation}): "
            + ", ".join(f"{counts[k]} {k.value}" for k in FetchKind)
            + f" pieces, {self.bytes_moved()} bytes to move"
        )


@dataclass(frozen=True)
class _Source:
    """One committed step of `origin` as `node` holds it (DISK_SOURCE: the checkpoint's)."""

    node: str
    origin: str
    pieces: Mapping[str, PieceInfo]


def _index(
    holdings: Mapping[str, NodeHoldings],
    live: set[str],
    disk: NodeHoldings | None,
    units: tuple[str, ...],
) -> tuple[dict[int, list[_Source]], dict[int, tuple[int, int]]]:
    """step -> who holds a commit of it (by node id, then origin; the disk last), and per
    step the newest (epoch, generation) that committed it. One entry per held step, not per
    piece: the pieces are looked up only for the step resumed."""
    index: dict[int, list[_Source]] = {}
    newest: dict[int, tuple[int, int]] = {}
    sources = [(n, h) for n, h in sorted(holdings.items()) if n in live]
    if disk is not None:
        sources.append((DISK_SOURCE, disk))
    for node, held in sources:
        for (origin, step), holding in sorted(held.steps.items()):
            if holding.units != units:
                continue  # another model's state: never usable
            origin_name = DISK_SOURCE if node == DISK_SOURCE else origin
            index.setdefault(step, []).append(_Source(node, origin_name, holding.pieces))
            newest[step] = max(newest.get(step, (0, 0)), holding.commit)
    return index, newest


def _complete_sets(names: Iterable[str], keys: dict[str, PieceKey]) -> dict[str, list[int]]:
    """unit -> tp sizes with every slice available (ascending); `keys` caches parsed names."""
    ranks: dict[tuple[str, int], set[int]] = {}
    for name in names:
        key = keys.get(name)
        if key is None:
            key = keys[name] = PieceKey.parse(name)
        ranks.setdefault((key.unit, key.tp_size), set()).add(key.tp_rank)
    out: dict[str, list[int]] = {}
    for (unit, size), have in sorted(ranks.items()):
        if len(have) == size:
            out.setdefault(unit, []).append(size)
    return out


def resolve(
    holdings: Mapping[str, NodeHoldings],
    target: Plan,
    *,
    live_nodes: Iterable[str],
    disk: NodeHoldings | None = None,
) -> ResumePlan:
    """The resume step and every rank's fetches; `StateUnavailableError` if no step is whole.

    `holdings` maps node id -> what it holds (entries of nodes not in `live_nodes` are
    ignored); `disk` is what the persistent checkpoint holds (see
    `checkpoints.checkpoint_holdings`), used only where no live node has a piece.
    """
    live = set(live_nodes)
    units = target.model.units
    index, newest = _index(holdings, live, disk, units)
    if not index:
        raise StateUnavailableError(
            f"no committed state on any live node ({', '.join(sorted(live)) or 'none'})"
            + (" or on disk" if disk is not None else " and no checkpoint given")
        )
    steps = sorted(index, key=lambda s: (newest[s], s), reverse=True)
    newest_missing: list[str] = []
    keys: dict[str, PieceKey] = {}
    for step in steps:
        names: set[str] = set().union(*(s.pieces for s in index[step]))
        complete = _complete_sets(names, keys)
        missing = [u for u in units if u not in complete]
        if not missing:
            return _Assigner(target, index[step], names, complete).resume_plan(step)
        newest_missing = newest_missing or missing
    step, missing = steps[0], newest_missing
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise StateUnavailableError(
        f"no step has every unit on a live node or disk; the newest, step {step}, "
        f"misses a complete tp slice set of {shown} (steps checked: "
        f"{', '.join(str(s) for s in sorted(index, reverse=True))})"
    )


# A source in a piece's queue: (bytes assigned to it when queued, node, origin, the piece).
# (node, origin) is unique per piece, so the PieceInfo is never compared.
_Entry = tuple[int, str, str, PieceInfo]


class _Queue:
    """The sources of one kind (peer or replica) of one piece, least loaded first.

    Loads only grow. `sources` are all sources of the kind in (node, origin) order; those
    before `next` that hold the piece are in `heap` by (load, node, origin) as it was when
    pushed, and every one of them had a load > 0 then. So the first holder at or after
    `next` with load 0 is the least loaded (ties by id); with none, the heap's top once its
    load is current (an entry out of date is pushed again with the current load). Each
    source is passed once per piece, and only as far as a choice needs.
    """

    __slots__ = ("heap", "name", "next", "sources")

    def __init__(self, name: str, sources: list[_Source]) -> None:
        self.name = name
        self.sources = sources
        self.next = 0
        self.heap: list[_Entry] = []

    def top(self, load: Mapping[str, int]) -> _Entry | None:
        name, sources, heap = self.name, self.sources, self.heap
        i = self.next
        while i < len(sources):
            s = sources[i]
            info = s.pieces.get(name)
            if info is not None:
                used = load.get(s.node, 0)
                if used == 0:
                    self.next = i
                    return (0, s.node, s.origin, info)
                heapq.heappush(heap, (used, s.node, s.origin, info))
            i += 1
        self.next = i
        while heap:
            top = heap[0]
            used = load.get(top[1], 0)
            if top[0] == used:
                return top
            heapq.heapreplace(heap, (used, *top[1:]))
        return None


class _Assigner:
    """Chooses every rank's sources at one step (the preferences of the module docstring).

    A node's own sources are looked up directly; the peer and replica sources of a piece
    some node lacks are kept in a `_Queue` each, made on the first need.
    """

    def __init__(
        self,
        target: Plan,
        sources: list[_Source],
        names: set[str],
        complete: Mapping[str, list[int]],
    ) -> None:
        self.target = target
        self.names = names
        self.complete = complete
        self.load: dict[str, int] = {}
        self.local: dict[str, list[_Source]] = {}
        self.peers: list[_Source] = []
        self.replicas: list[_Source] = []
        self.replicas_of: dict[str, list[_Source]] = {}
        self.disk: list[_Source] = []
        for s in sources:
            if s.node == DISK_SOURCE:
                self.disk.append(s)
                continue
            self.local.setdefault(s.node, []).append(s)
            if s.node == s.origin:
                self.peers.append(s)
            else:
                self.replicas.append(s)
                self.replicas_of.setdefault(s.origin, []).append(s)
        for held in self.local.values():
            held.sort(key=lambda s: (s.origin != s.node, s.origin))  # its own step first
        self.peer_queues: dict[str, _Queue] = {}
        self.replica_queues: dict[str, _Queue] = {}
        self.filenames: dict[tuple[str, int, int], str] = {}

    def filename(self, unit: str, rank: int, size: int) -> str:
        key = (unit, rank, size)
        name = self.filenames.get(key)
        if name is None:
            name = self.filenames[key] = PieceKey(unit, rank, size).filename
        return name

    def resume_plan(self, step: int) -> ResumePlan:
        target = self.target
        # (pp, tp) -> the pieces of a rank there where every unit has the rank's exact slice;
        # else, per unit, the exact slice or None: resharded, which depends on the node
        whole: dict[tuple[int, int], list[str]] = {}
        mixed: dict[tuple[int, int], list[tuple[str, str | None]]] = {}
        for pp in range(target.pp):
            for tp in range(target.tp):
                names = [
                    (u, n if (n := self.filename(u, tp, target.tp)) in self.names else None)
                    for u in target.model.stage_units(target.stages, pp)
                ]
                if any(n is None for _, n in names):
                    mixed[(pp, tp)] = names
                else:
                    whole[(pp, tp)] = [n for _, n in names if n is not None]
        on_node: dict[str, dict[str, Fetch]] = {}
        fetches: dict[int, tuple[Fetch, ...]] = {}
        for slot in target.placement:
            node = slot.node_id
            held = self.local.get(node, [])
            where = (slot.coord.pp, slot.coord.tp)
            wanted = whole.get(where)
            if wanted is None:
                wanted = [
                    n
                    for unit, name in mixed[where]
                    for n in ([name] if name is not None else self.reshard(unit, held))
                ]
            done = on_node.setdefault(node, {})
            fetches[slot.rank] = tuple(
                [done.get(name) or self.choose(name, node, held, done) for name in wanted]
            )
        return ResumePlan(
            step=step,
            generation=target.generation,
            units=target.model.units,
            fetches=fetches,
            rank_nodes={s.rank: s.node_id for s in target.placement},
        )

    def reshard(self, unit: str, held: list[_Source]) -> list[str]:
        """Every slice of the complete set with the fewest pieces off this node (then the
        smallest size)."""

        def remote(size: int) -> tuple[int, int]:
            names = [self.filename(unit, r, size) for r in range(size)]
            return sum(not any(n in s.pieces for s in held) for n in names), size

        size = min(self.complete[unit], key=remote)
        return [self.filename(unit, r, size) for r in range(size)]

    def choose(self, name: str, node: str, held: list[_Source], done: dict[str, Fetch]) -> Fetch:
        """Where `node` takes `name` from; kept in `done`, as the node's ranks share it."""
        for s in held:
            info = s.pieces.get(name)
            if info is not None:
                done[name] = fetch = Fetch(name, s.origin, node, FetchKind.LOCAL, *info)
                return fetch
        # Not on the node: none of the node's own sources is a candidate in a queue.
        kind, top = FetchKind.PEER, self.queue(self.peer_queues, self.peers, name).top(self.load)
        if top is None:
            kind, top = FetchKind.REPLICA, self.replica(name, node)
        if top is None:
            kind = FetchKind.DISK
            info = next(s.pieces[name] for s in self.disk if name in s.pieces)
            top = (0, DISK_SOURCE, DISK_SOURCE, info)
        _, source, origin, info = top
        self.load[source] = self.load.get(source, 0) + info.size
        done[name] = fetch = Fetch(name, origin, source, kind, *info)
        return fetch

    def replica(self, name: str, node: str) -> _Entry | None:
        """A replica of the node's own step first, then the least-loaded replica."""
        own = [
            (self.load.get(s.node, 0), s.node, s.origin, s.pieces[name])
            for s in self.replicas_of.get(node, ())
            if name in s.pieces
        ]
        if own:
            return min(own)
        return self.queue(self.replica_queues, self.replicas, name).top(self.load)

    @staticmethod
    def queue(queues: dict[str, _Queue], sources: list[_Source], name: str) -> _Queue:
        q = queues.get(name)
        if q is None:
            q = queues[name] = _Queue(name, sources)
        return q
