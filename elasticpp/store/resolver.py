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
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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


_PREFERENCE = {FetchKind.LOCAL: 0, FetchKind.PEER: 1, FetchKind.REPLICA: 2, FetchKind.DISK: 3}


@dataclass(frozen=True, order=True)
class Fetch:
    """One piece a rank needs at the resume step, and where to take it from."""

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
class _Candidate:
    source: str
    origin: str
    info: PieceInfo


def _kind(c: _Candidate, node: str) -> FetchKind:
    if c.source == DISK_SOURCE:
        return FetchKind.DISK
    if c.source == node:
        return FetchKind.LOCAL
    return FetchKind.PEER if c.source == c.origin else FetchKind.REPLICA


def _index(
    holdings: Mapping[str, NodeHoldings],
    live: set[str],
    disk: NodeHoldings | None,
    units: tuple[str, ...],
    newest: dict[int, tuple[int, int]],
) -> dict[int, dict[str, list[_Candidate]]]:
    """step -> piece name -> who can supply it; `newest` gets, per step, the newest
    (epoch, generation) that committed it."""
    index: dict[int, dict[str, list[_Candidate]]] = {}
    sources = [(n, h) for n, h in sorted(holdings.items()) if n in live]
    if disk is not None:
        sources.append((DISK_SOURCE, disk))
    for node, held in sources:
        for (origin, step), holding in sorted(held.steps.items()):
            if holding.units != units:
                continue  # another model's state: never usable
            pieces = index.setdefault(step, {})
            newest[step] = max(newest.get(step, (0, 0)), holding.commit)
            for name, info in holding.pieces.items():
                origin_name = DISK_SOURCE if node == DISK_SOURCE else origin
                pieces.setdefault(name, []).append(_Candidate(node, origin_name, info))
    return index


def _complete_sets(pieces: Mapping[str, list[_Candidate]]) -> dict[str, list[int]]:
    """unit -> tp sizes with every slice available."""
    ranks: dict[tuple[str, int], set[int]] = {}
    for name in pieces:
        key = PieceKey.parse(name)
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
    `persist.checkpoint_holdings`), used only where no live node has a piece.
    """
    live = set(live_nodes)
    units = target.model.units
    newest: dict[int, tuple[int, int]] = {}
    index = _index(holdings, live, disk, units, newest)
    if not index:
        raise StateUnavailableError(
            f"no committed state on any live node ({', '.join(sorted(live)) or 'none'})"
            + (" or on disk" if disk is not None else " and no checkpoint given")
        )
    steps = sorted(index, key=lambda s: (newest[s], s), reverse=True)
    newest_missing: list[str] = []
    for step in steps:
        complete = _complete_sets(index[step])
        missing = [u for u in units if u not in complete]
        if not missing:
            return _assign(target, step, index[step], complete)
        newest_missing = newest_missing or missing
    step, missing = steps[0], newest_missing
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise StateUnavailableError(
        f"no step has every unit on a live node or disk; the newest, step {step}, "
        f"misses a complete tp slice set of {shown} (steps checked: "
        f"{', '.join(str(s) for s in sorted(index, reverse=True))})"
    )


def _assign(
    target: Plan,
    step: int,
    pieces: Mapping[str, list[_Candidate]],
    complete: Mapping[str, list[int]],
) -> ResumePlan:
    load: Counter[str] = Counter()
    on_node: dict[tuple[str, str], Fetch] = {}
    fetches: dict[int, tuple[Fetch, ...]] = {}
    for slot in target.placement:
        node = slot.node_id
        wanted: list[str] = []
        for unit in target.model.stage_units(target.stages, slot.coord.pp):
            exact = PieceKey(unit, slot.coord.tp, target.tp).filename
            if exact in pieces:
                wanted.append(exact)
                continue

            # Reshard from a complete set: the size with the fewest pieces off this node.
            def remote(size: int, unit: str = unit, node: str = node) -> tuple[int, int]:
                names = [PieceKey(unit, r, size).filename for r in range(size)]
                return sum(all(c.source != node for c in pieces[n]) for n in names), size

            size = min(complete[unit], key=remote)
            wanted += [PieceKey(unit, r, size).filename for r in range(size)]
        chosen = []
        for name in wanted:
            fetch = on_node.get((node, name))
            if fetch is None:
                best = min(
                    pieces[name],
                    key=lambda c: (
                        _PREFERENCE[_kind(c, node)],
                        c.origin != node,  # locally, its own step before a replica
                        load[c.source],
                        c.source,
                        c.origin,
                    ),
                )
                kind = _kind(best, node)
                if kind is not FetchKind.LOCAL:
                    load[best.source] += best.info.size
                fetch = Fetch(name, best.origin, best.source, kind, *best.info)
                on_node[(node, name)] = fetch
            chosen.append(fetch)
        fetches[slot.rank] = tuple(chosen)
    return ResumePlan(
        step=step,
        generation=target.generation,
        units=target.model.units,
        fetches=fetches,
        rank_nodes={s.rank: s.node_id for s in target.placement},
    )
