"""The replication ring, pure: which nodes keep whose anchor steps, and which step is safe.

Ring: the sorted node ids; node i's replicas live on nodes i+1 .. i+r (mod n). The copying
itself, and the guarantee these functions state, are in elasticpp.store.replicate; the
leader's pure step computes the safe step from here without importing a client.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence


def backup_origins(ring: Sequence[str], node_id: str, r: int) -> list[str]:
    """The nodes whose steps `node_id` keeps: the r nodes before it in the sorted ring."""
    nodes = sorted(set(ring))
    if node_id not in nodes:
        return []
    i = nodes.index(node_id)
    out: list[str] = []
    for k in range(1, min(r, len(nodes) - 1) + 1):
        out.append(nodes[(i - k) % len(nodes)])
    return out


def replica_holders(ring: Sequence[str], origin: str, r: int) -> list[str]:
    """The nodes that keep `origin`'s steps: the r nodes after it in the sorted ring."""
    nodes = sorted(set(ring))
    i = nodes.index(origin)
    return [nodes[(i + k) % len(nodes)] for k in range(1, min(r, len(nodes) - 1) + 1)]


def safe_step(
    ring: Sequence[str],
    r: int,
    state_nodes: Iterable[str],
    own: Mapping[str, Collection[int]],
    replicas: Mapping[str, Mapping[str, Collection[int]]],
) -> int | None:
    """The newest anchor step that survives any single node loss, or None. Pure.

    `state_nodes` are the nodes whose own state the step needs (the plan's nodes with ranks;
    a node missing from `ring` is added to it); `own[n]` the anchor steps `n` holds of its own,
    `replicas[h][o]` those `h` holds of origin `o` (all of one generation). A step is safe
    when every state node holds its own commit of it and each of its `replica_holders`
    holds that commit as a replica. With r = 0, or a node alone in the ring, nothing survives
    a node's loss: None.
    """
    nodes = sorted(set(state_nodes))
    ring = sorted(set(ring) | set(nodes))
    if r < 1 or not nodes or len(ring) < 2:
        return None
    common: set[int] | None = None
    for node in nodes:
        steps = set(own.get(node, ()))
        for holder in replica_holders(ring, node, r):
            steps &= set(replicas.get(holder, {}).get(node, ()))
        common = steps if common is None else common & steps
        if not common:
            return None
    return max(common) if common else None
