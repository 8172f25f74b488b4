"""The resume instruction as the leader writes it to etcd, and what each node reads from it.

The resolver (elasticpp.store.resolver) picks, for every node of the new plan, each piece it
needs and where from. Written per rank that took O(ranks x pieces) bytes (24 MiB for
llama-70b at 2,048 nodes x 8). This form takes each piece once and derives the rest from the
plan, which every node has:

    {"format_version": 2, "step": S,
     "pieces": {name: [sha256, size]},          every piece some node fetches, once
     "reshard": {unit: tp_size},                a unit whose own slices are missing is
     "reshard_by_node": {node: {unit: tp_size}}   taken as a whole set of this tp size
     "nodes": [node id, ...],                   the sources and origins the runs name
     "by_node": {node: [[count, source, origin?], ...]},
     "infos_by_node": {node: {name: [sha256, size]}}}

A node's pieces, in order, are those of its ranks (by rank; per rank its stage's units): a
unit's own slice where `pieces` has it, else the whole set of the unit's reshard size. A node
absent from `by_node` takes each from itself, its own step. A node in it takes them run by
run: `count` pieces in a row from node `source` (an index into `nodes`) and of origin
`origin` (the same as the source when left out). `infos_by_node` names the rare piece whose
chosen copy differs from `pieces`. Decoding gives exactly `ResumePlan.node_fetches(node)`.

Invariants: a value of another `format_version` is refused, naming both versions, never
read as this one; node names are checked before they become paths; piece names are built
from the plan, never taken from the value.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.errors import ConfigError
from elasticpp.plan.layout import Plan
from elasticpp.store.holdings import DISK_SOURCE, check_node_id
from elasticpp.store.resolver import Fetch, FetchKind, ResumePlan

INSTRUCTION_FORMAT_VERSION = 2

_WHAT = "resume instruction"


def _kind(source: str, origin: str, node: str) -> FetchKind:
    # As the resolver classifies its candidates.
    if source == DISK_SOURCE:
        return FetchKind.DISK
    if source == node:
        return FetchKind.LOCAL
    return FetchKind.PEER if source == origin else FetchKind.REPLICA


def _most_common(counts: Counter[Any]) -> Any:
    # Deterministic: the most frequent, ties by the smallest value.
    return min(counts, key=lambda v: (-counts[v], v))


def _per_node(rp: ResumePlan) -> dict[str, tuple[Fetch, ...]]:
    """`rp.node_fetches(n)` of every node, in one pass over the ranks (that method walks
    every rank per node: minutes at 2,048 nodes)."""
    seen: dict[str, dict[tuple[str, str, str], Fetch]] = {}
    for rank, fetches in sorted(rp.fetches.items()):
        mine = seen.setdefault(rp.rank_nodes[rank], {})
        for f in fetches:
            mine.setdefault((f.piece_name, f.origin_node, f.source_node), f)
    return {n: tuple(seen[n].values()) for n in sorted(seen)}


def encode(rp: ResumePlan | None, plan: Plan, *, step: int = 0) -> dict[str, Any]:
    """The instruction for `plan` from the resolver's `rp` (None: a fresh job, step `step`,
    nothing to fetch). The caller adds its own fields (`at`, `recomputed`)."""
    value: dict[str, Any] = {"format_version": INSTRUCTION_FORMAT_VERSION, "step": step}
    value.update(pieces={}, reshard={}, reshard_by_node={}, nodes=[], by_node={}, infos_by_node={})
    if rp is None:
        return value
    value["step"] = rp.step
    per_node = _per_node(rp)
    infos: dict[str, Counter[tuple[str, int]]] = {}
    for fetches in per_node.values():
        for f in fetches:
            infos.setdefault(f.piece_name, Counter())[(f.sha256, f.size)] += 1
    pieces = {name: _most_common(c) for name, c in sorted(infos.items())}
    value["pieces"] = {name: [sha, size] for name, (sha, size) in pieces.items()}

    # Which whole set a node took of a unit whose own slice is missing.
    sizes: dict[str, dict[str, int]] = {}
    for n, fetches in per_node.items():
        for f in fetches:
            key = PieceKey.parse(f.piece_name)
            if key.tp_size != plan.tp:
                sizes.setdefault(key.unit, {})[n] = key.tp_size
    reshard = {u: _most_common(Counter(by.values())) for u, by in sorted(sizes.items())}
    value["reshard"] = reshard
    for u, by in sorted(sizes.items()):
        for n, size in sorted(by.items()):
            if size != reshard[u]:
                value["reshard_by_node"].setdefault(n, {})[u] = size

    # Nodes that take a piece from elsewhere, or a replica's, list their (source, origin)
    # pairs in runs; the others take everything from themselves.
    listed = {
        n: [(f.source_node, f.origin_node) for f in fetches]
        for n, fetches in per_node.items()
        if any(not f.source_node == f.origin_node == n for f in fetches)
    }
    for n, fetches in per_node.items():
        for f in fetches:
            if (f.sha256, f.size) != pieces[f.piece_name]:
                value["infos_by_node"].setdefault(n, {})[f.piece_name] = [f.sha256, f.size]
    names = sorted({x for pairs in listed.values() for pair in pairs for x in pair})
    index = {x: i for i, x in enumerate(names)}
    value["nodes"] = names
    for n, pairs in listed.items():
        merged: list[list[int]] = []
        for source, origin in pairs:
            run = [1, index[source]] + ([] if origin == source else [index[origin]])
            if merged and merged[-1][1:] == run[1:]:
                merged[-1][0] += 1
            else:
                merged.append(run)
        value["by_node"][n] = merged
    return value


def _field(value: Mapping[str, Any], name: str, kind: type) -> Any:
    v = value.get(name)
    if not isinstance(v, kind):
        raise ConfigError(f"{_WHAT}: {name} must be a JSON {kind.__name__}, got {v!r}")
    return v


def _info(entry: Any, name: str) -> tuple[str, int]:
    if (
        not isinstance(entry, list)
        or len(entry) != 2
        or not isinstance(entry[0], str)
        or isinstance(entry[1], bool)
        or not isinstance(entry[1], int)
    ):
        raise ConfigError(f"{_WHAT}: piece {name}: expected [sha256, size], got {entry!r}")
    return entry[0], entry[1]


def check_version(value: Mapping[str, Any]) -> None:
    """`ConfigError` unless `value` is an instruction of this format."""
    version = value.get("format_version")
    if version != INSTRUCTION_FORMAT_VERSION:
        raise ConfigError(
            f"{_WHAT}: format_version {version!r} is not {INSTRUCTION_FORMAT_VERSION} "
            "(written by a leader of another release; this node does not read it)"
        )


def _wanted(value: Mapping[str, Any], plan: Plan, node_id: str) -> list[str]:
    """The piece names `node_id` fetches, in the resolver's order; none for a fresh job."""
    pieces = _field(value, "pieces", dict)
    if not pieces:
        return []
    reshard = _field(value, "reshard", dict)
    own = _field(value, "reshard_by_node", dict).get(node_id, {})
    names: dict[str, None] = {}
    for slot in plan.ranks_on(node_id):
        for unit in plan.model.stage_units(plan.stages, slot.coord.pp):
            exact = PieceKey(unit, slot.coord.tp, plan.tp).filename
            if exact in pieces:
                names.setdefault(exact)
                continue
            size = own.get(unit, reshard.get(unit))
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(
                    f"{_WHAT}: no piece of unit {unit} for rank {slot.rank} "
                    f"(neither {exact} nor a reshard size, got {size!r})"
                )
            for r in range(size):
                names.setdefault(PieceKey(unit, r, size).filename)
    return list(names)


def node_fetches(value: Mapping[str, Any], plan: Plan, node_id: str) -> tuple[Fetch, ...]:
    """What `node_id` fetches, exactly as `ResumePlan.node_fetches(node_id)` of the plan the
    instruction was written from; `ConfigError` naming the problem for a value that is not
    an instruction of this format or does not fit `plan`."""
    check_version(value)
    wanted = _wanted(value, plan, node_id)
    pieces = value["pieces"]
    table = _field(value, "nodes", list)
    for x in table:
        if x != DISK_SOURCE:
            check_node_id(x, field_name=f"{_WHAT}: node")
    runs = _field(value, "by_node", dict).get(node_id)
    pairs: list[tuple[str, str]] = []
    if runs is None:
        pairs = [(node_id, node_id)] * len(wanted)
    else:
        for run in runs if isinstance(runs, list) else [runs]:
            ok = (
                isinstance(run, list)
                and len(run) in (2, 3)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in run)
                and 1 <= run[0] <= len(wanted) - len(pairs)  # bounded before it is built
                and all(0 <= i < len(table) for i in run[1:])
            )
            if not ok:
                raise ConfigError(f"{_WHAT}: bad run for {node_id}: {run!r:.80}")
            source = table[run[1]]
            pairs += [(source, table[run[-1]])] * run[0]
    if len(pairs) != len(wanted):
        raise ConfigError(
            f"{_WHAT}: {len(pairs)} sources for the {len(wanted)} pieces {node_id} needs"
        )
    infos = _field(value, "infos_by_node", dict).get(node_id, {})
    out = []
    for name, (source, origin) in zip(wanted, pairs, strict=True):
        sha, size = _info(infos.get(name, pieces[name]) if name in pieces else None, name)
        out.append(Fetch(name, origin, source, _kind(source, origin, node_id), size, sha))
    return tuple(out)
