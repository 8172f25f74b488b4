"""Peer replication: every node's committed anchor steps are also kept by the next `r` nodes.

Ring: the sorted node ids; node i's replicas live on nodes i+1 .. i+r (mod n). Anchors are the
committed steps divisible by `every` (the job's `replication_every`). Pull model: each node
calls `replicate_once`, which asks each node it backs up for its holdings and copies, oldest
first, every anchor of that node newer (by epoch, generation, then step) than the newest
anchor of it held here; holding none yet, it starts at the newest. So every holder walks
through the same anchors and the holders of different origins meet on common steps however
their rounds interleave. Pieces it already holds with the same sha256 (a data-parallel twin's
identical state, an earlier attempt) are hard-linked instead of fetched. A replica step is
committed (manifest) only when all its pieces are in.

The guarantee (with r >= 1): a step s is safe when every node of the plan holds its own
commit of s and each of its `replica_holders` holds a replica of it (`safe_step`). The leader
publishes the newest safe step only when it rises; every node keeps its anchors at or above
the newest safe step it has learnt (`LocalStore.set_floor`). A newly published safe step is
held by all when it is published, and no node drops an anchor at or above its known floor,
so it stays held by all until a newer one is published; until then, the previous one was.
Hence at every moment after the first publication the nodes hold a common step that survives
any single node loss. Caveat: anchors above the floor are capped per origin
(`retention.Retention.cap`); while the safe step lags by more than that, the guarantee can break.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elasticpp.checkpoint.durable import link_or_copy
from elasticpp.checkpoint.manifest import sha256_file
from elasticpp.errors import ConfigError, ElasticppError
from elasticpp.store.client import StateClient
from elasticpp.store.holdings import NodeHoldings, StepHolding
from elasticpp.store.local import LocalStore
from elasticpp.store.ring import backup_origins, replica_holders, safe_step

log = logging.getLogger(__name__)

__all__ = [
    "ReplicaResult",
    "ReplicationPolicy",
    "backup_origins",
    "replica_holders",
    "replicate_once",
    "safe_step",
]


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


@dataclass(frozen=True)
class ReplicaResult:
    origin: str
    step: int | None  # the newest step now held (None: nothing to copy or it failed)
    fetched_bytes: int = 0
    linked: int = 0  # pieces taken from this node's own holdings instead of the network
    error: str = ""
    copied: int = 0  # steps committed here by this round


def replicate_once(
    store: LocalStore,
    peers: Mapping[str, str],
    ring: Sequence[str],
    r: int,
    generation: int,
    *,
    every: int = 1,
    client_factory: Callable[[str], StateClient] = StateClient,
) -> list[ReplicaResult]:
    """Pull the anchors (steps divisible by `every`) this node lacks of every node it backs
    up, oldest first (see the module docstring).

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
            results.append(_pull(store, origin, address, generation, every, client_factory))
        except ElasticppError as exc:
            log.warning("replication of %s from %s failed: %s", origin, address, exc)
            results.append(ReplicaResult(origin, None, error=str(exc)))
    return results


def _wanted(store: LocalStore, held: NodeHoldings, origin: str, every: int) -> list[StepHolding]:
    """The origin's anchors to copy, oldest first: those newer than the newest one held here,
    or its newest alone when none is held here."""
    theirs = sorted(
        (h for (o, s), h in held.steps.items() if o == origin and s % every == 0),
        key=lambda h: h.order,
    )
    mine = [
        h for h in store.holdings().steps.values() if h.origin == origin and h.step % every == 0
    ]
    if not mine:
        return theirs[-1:]
    newest = max(h.order for h in mine)
    return [h for h in theirs if h.order > newest]


def _pull(
    store: LocalStore,
    origin: str,
    address: str,
    generation: int,
    every: int,
    client_factory: Callable[[str], StateClient],
) -> ReplicaResult:
    with client_factory(address) as client:
        held = client.list_steps(generation, epoch=store.epoch)
        step: int | None = None
        fetched = linked = copied = 0
        for holding in _wanted(store, held, origin, every):
            f, n, done = _copy(store, client, origin, holding, generation)
            step, fetched, linked, copied = holding.step, fetched + f, linked + n, copied + done
        if step is None:
            newest = held.newest_step_of(origin)
            mine = None if newest is None else store.committed(origin, newest)
            step = newest if mine is not None else None
        return ReplicaResult(origin, step, fetched, linked, copied=copied)


def _copy(
    store: LocalStore, client: StateClient, origin: str, holding: StepHolding, generation: int
) -> tuple[int, int, bool]:
    """Copy one committed step of `origin` and commit it here: (bytes fetched, pieces linked,
    whether it was committed here now)."""
    step = holding.step
    mine = store.committed(origin, step)
    if mine is not None and mine.commit >= holding.commit:
        return 0, 0, False
    # A newer generation's commit of a step held here (recomputed after a rollback) is
    # a new commit: it goes into its own directory and replaces the older one.
    step_dir = store.replica_step_dir(origin, step, holding.generation, holding.epoch)
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
            step,
            name,
            origin,
            dest,
            info.sha256,
            generation,
            expected_size=info.size,
            epoch=store.epoch,
        )
    store.commit_replica(
        origin, step, holding.units, holding.entries(), holding.generation, holding.epoch
    )
    log.debug(
        "replication: %s holds %s step %d (%d bytes fetched, %d pieces linked)",
        store.node_id,
        origin,
        step,
        fetched,
        linked,
    )
    return fetched, linked, True
