"""Peer replication: every node's committed steps are also kept by the next `r` nodes.

Ring: the sorted node ids; node i's replicas live on nodes i+1 .. i+r (mod n). Pull model:
each node calls `replicate_once`, which asks each node it backs up for its holdings and
copies that node's newest committed own step (by generation, then step), if it does not
hold that commit yet. Pieces it already
holds with the same sha256 (a data-parallel twin's identical state, an earlier attempt) are
hard-linked instead of fetched. A replica step is committed (manifest) only when all its
pieces are in; the store keeps the newest `keep_steps` replica steps per origin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elasticpp.checkpoint.manifest import sha256_file
from elasticpp.errors import ConfigError, ElasticppError
from elasticpp.store.client import StateClient
from elasticpp.store.local import LocalStore, link_or_copy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicationPolicy:
    """`r` peers keep each node's steps; copied on each step divisible by `every_steps`."""

    r: int = 1
    every_steps: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 0:
            raise ConfigError(f"replication r must be an integer >= 0, got {self.r!r}")
        if isinstance(self.every_steps, bool) or self.every_steps < 1:
            raise ConfigError(f"replication every_steps must be >= 1, got {self.every_steps!r}")

    def due(self, step: int) -> bool:
        return self.r > 0 and step % self.every_steps == 0


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


@dataclass(frozen=True)
class ReplicaResult:
    origin: str
    step: int | None  # the step now held (None: nothing to copy or it failed)
    fetched_bytes: int = 0
    linked: int = 0  # pieces taken from this node's own holdings instead of the network
    error: str = ""


def replicate_once(
    store: LocalStore,
    peers: Mapping[str, str],
    ring: Sequence[str],
    r: int,
    generation: int,
    *,
    client_factory: Callable[[str], StateClient] = StateClient,
) -> list[ReplicaResult]:
    """Pull the newest committed step of every node this one backs up.

    `peers` maps the live node ids to their state-service addresses; an origin missing from
    it is skipped (dead: its replica here is what survives). Errors are logged and reported
    per origin, never raised: replication is best effort and runs again next time.
    """
    results = []
    for origin in backup_origins(ring, store.node_id, r):
        address = peers.get(origin)
        if address is None:
            continue
        try:
            results.append(_pull(store, origin, address, generation, client_factory))
        except ElasticppError as exc:
            log.warning("replication of %s from %s failed: %s", origin, address, exc)
            results.append(ReplicaResult(origin, None, error=str(exc)))
    return results


def _pull(
    store: LocalStore,
    origin: str,
    address: str,
    generation: int,
    client_factory: Callable[[str], StateClient],
) -> ReplicaResult:
    with client_factory(address) as client:
        held = client.list_steps(generation)
        step = held.newest_step_of(origin)
        if step is None:
            return ReplicaResult(origin, None)
        holding = held.steps[(origin, step)]
        mine = store.committed(origin, step)
        if mine is not None and mine.generation >= holding.generation:
            return ReplicaResult(origin, step)
        # A newer generation's commit of a step held here (recomputed after a rollback) is
        # a new commit: it goes into its own directory and replaces the older one.
        step_dir = store.replica_step_dir(origin, step, holding.generation)
        fetched = linked = 0
        for name, info in sorted(holding.pieces.items()):
            dest = step_dir / name
            if dest.is_file() and dest.stat().st_size == info.size:
                if sha256_file(dest) == info.sha256:
                    continue  # fetched (and verified) by an earlier, interrupted attempt
                dest.unlink()
            local = store.find_piece(step, name, info.sha256)
            if local is not None:
                link_or_copy(local, dest)
                linked += 1
                continue
            fetched += client.fetch_piece(
                step, name, origin, dest, info.sha256, generation, expected_size=info.size
            )
        store.commit_replica(origin, step, holding.units, holding.entries(), holding.generation)
        log.info(
            "replication: %s holds %s step %d (%d bytes fetched, %d pieces linked)",
            store.node_id,
            origin,
            step,
            fetched,
            linked,
        )
        return ReplicaResult(origin, step, fetched, linked)
