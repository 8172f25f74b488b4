"""Pure decisions over cluster state: no etcd, no clock of their own, unit-tested directly."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_DIGITS = re.compile(r"(\d+)")


def _natural_key(node_id: str) -> tuple[tuple[int, int | str], ...]:
    # node-2 before node-10: operators number nodes, and the ring should follow their numbers.
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(node_id) if part
    )


def ring_order(node_ids: Iterable[str]) -> list[str]:
    """Node ids in ring order: natural sort (node-2 < node-10), duplicates removed."""
    return sorted(set(node_ids), key=_natural_key)


def ring_successor(node_id: str, node_ids: Iterable[str]) -> str | None:
    """The next node after `node_id` on the ring (its replication peer); None if alone.

    `node_id` need not be in `node_ids` (a node that just left still has a successor)."""
    ring = ring_order(node_ids)
    others = [n for n in ring if n != node_id]
    if not others:
        return None
    keys = [_natural_key(n) for n in others]
    mine = _natural_key(node_id)
    for n, k in zip(others, keys, strict=True):
        if k > mine:
            return n
    return others[0]


def live_nodes(
    members: Mapping[str, Any],
    suspects: Iterable[str] = (),
    confirmed_alive: Iterable[str] = (),
) -> list[str]:
    """Registered nodes minus suspected ones, in ring order.

    A suspect that a probe confirmed alive (`confirmed_alive`) counts as live."""
    alive = set(confirmed_alive)
    out = {n for n in members if n not in set(suspects) or n in alive}
    return ring_order(out)


def missing_arrivals(expected: Iterable[str], arrived: Iterable[str]) -> list[str]:
    """Expected nodes that have not arrived at a barrier, in ring order."""
    return ring_order(set(expected) - set(arrived))


def newest_common_step(commits: Mapping[str, int], nodes: Iterable[str]) -> int | None:
    """The newest step every one of `nodes` has committed (the min); None if one has none."""
    steps = []
    for n in nodes:
        if n not in commits:
            return None
        steps.append(commits[n])
    return min(steps) if steps else None
