"""The resolver as it was before it was made to scale: the oracle the new one must equal.

`resolve_reference` is the straightforward O(ranks x pieces x candidates) version of
`elasticpp.store.resolver.resolve`, kept unchanged so that `bench/resolve.py` can report the
speed-up and `tests/unit/test_resolver_scale.py` can check that the fast version returns
exactly the same `ResumePlan` on every case. Same preferences, same tie-breaks, same errors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.errors import StateUnavailableError
from elasticpp.plan.layout import Plan
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings, PieceInfo
from elasticpp.store.resolver import Fetch, FetchKind, ResumePlan

_PREFERENCE = {FetchKind.LOCAL: 0, FetchKind.PEER: 1, FetchKind.REPLICA: 2, FetchKind.DISK: 3}


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
    index: dict[int, dict[str, list[_Candidate]]] = {}
    sources = [(n, h) for n, h in sorted(holdings.items()) if n in live]
    if disk is not None:
        sources.append((DISK_SOURCE, disk))
    for node, held in sources:
        for (origin, step), holding in sorted(held.steps.items()):
            if holding.units != units:
                continue
            pieces = index.setdefault(step, {})
            newest[step] = max(newest.get(step, (0, 0)), holding.commit)
            for name, info in holding.pieces.items():
                origin_name = DISK_SOURCE if node == DISK_SOURCE else origin
                pieces.setdefault(name, []).append(_Candidate(node, origin_name, info))
    return index


def _complete_sets(pieces: Mapping[str, list[_Candidate]]) -> dict[str, list[int]]:
    ranks: dict[tuple[str, int], set[int]] = {}
    for name in pieces:
        key = PieceKey.parse(name)
        ranks.setdefault((key.unit, key.tp_size), set()).add(key.tp_rank)
    out: dict[str, list[int]] = {}
    for (unit, size), have in sorted(ranks.items()):
        if len(have) == size:
            out.setdefault(unit, []).append(size)
    return out


def resolve_reference(
    holdings: Mapping[str, NodeHoldings],
    target: Plan,
    *,
    live_nodes: Iterable[str],
    disk: NodeHoldings | None = None,
) -> ResumePlan:
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
                        c.origin != node,
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
