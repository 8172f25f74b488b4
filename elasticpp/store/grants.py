"""What one node may fetch from another's state service: what its plan assigns it.

A node fetches pieces for two reasons, and the state service serves it nothing else:
- resuming (`store.resume`): the pieces of the units its ranks' stages hold in the plan of
  the generation it asks in: a unit's own tensor-parallel slice (the plan's tp size, the
  rank's tp index), or any slice of a unit stored at another tp size (a reshard reads the
  whole set of the layout that wrote it);
- replicating (`store.replicate`): any piece of the serving node's own anchor steps (steps
  divisible by `replication_every`), if the caller is one of that node's replica holders in
  the plan's ring (its planned nodes, sorted, as the leader's safe step computes it).
A node with no rank in the plan (a spare, a node drained out) fetches nothing. Pure: the
agent calls `fetch_refusal` with the plan it holds at the caller's generation.
"""

from __future__ import annotations

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.plan.layout import Plan
from elasticpp.store.ring import replica_holders


def fetch_refusal(
    plan: Plan,
    caller: str,
    server: str,
    origin: str,
    step: int,
    key: PieceKey,
    *,
    copies: int,
    every: int,
) -> str | None:
    """None if `caller` may fetch piece `key` of `origin`'s step `step` from `server` under
    `plan`, else why not (for the caller: it names the piece and the generation)."""
    if origin == server and copies > 0 and step % max(every, 1) == 0:
        ring = sorted({s.node_id for s in plan.placement})
        if server in ring and caller in replica_holders(ring, server, copies):
            return None
    slots = plan.ranks_on(caller)
    for slot in slots:
        if key.unit not in plan.model.stage_units(plan.stages, slot.coord.pp):
            continue
        if key.tp_size != plan.tp or key.tp_rank == slot.coord.tp:
            return None
    what = f"piece {key.filename} of {origin} step {step}"
    if not slots:
        return f"{what}: node {caller} has no rank in the plan of generation {plan.generation}"
    return (
        f"{what}: the plan of generation {plan.generation} assigns node {caller} no rank "
        "that holds it"
    )
