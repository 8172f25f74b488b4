"""What the leader's step tests share: the job, the members, and observations built from them."""

from __future__ import annotations

from typing import Any

from elasticpp.agent.jobspec import parse_job_spec
from elasticpp.agent.kernel.decide import ClusterView
from elasticpp.agent.leader.state import LeaderState
from elasticpp.agent.leader.step import (
    LeaderObservation,
)
from elasticpp.agent.sick import SickNodes
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.cluster.records import (
    GenerationRecord,
    node_fields,
)
from elasticpp.plan import ClusterSpec, Layout, NodeSpec, Plan, build_plan, load_device_spec
from elasticpp.store.holdings import NodeHoldings, PieceInfo, StepHolding
from tests.agents import SPEC_FIELDS

LEADER_SPEC = parse_job_spec(
    {**SPEC_FIELDS, "global_batch": 12, "max_nodes": 3, "stop_timeout_s": 10.0}
)


MEMBERS = {n: {"address": f"{n}:1", "slots": 1, "incarnation": f"i-{n}"} for n in ("n0", "n1")}


WALL = 1_000_000.0  # wall-clock seconds = WALL + the monotonic now_s


def _plan(generation: int, nodes: tuple[str, ...] = ("n0", "n1")) -> Plan:
    cluster = ClusterSpec(tuple(NodeSpec(n, 1) for n in nodes), load_device_spec("cpu"))
    return build_plan(
        LEADER_SPEC.model, cluster, Layout(1, 1, len(nodes)), global_batch=12, micro_batch=2
    ).with_generation(generation)


def leader_record(
    generation: int, nodes: tuple[str, ...] = ("n0", "n1"), **extra: Any
) -> GenerationRecord:
    plan = _plan(generation, nodes).to_dict()
    tags = node_fields(plan, nodes, {n: f"i-{n}" for n in nodes})
    return GenerationRecord(generation, plan, "n0", WALL, extra={**tags, **extra})


def leader_state() -> LeaderState:
    return LeaderState(SickNodes(LEADER_SPEC.sick_policy()))


def leader_obs(
    now_s: float,
    *,
    record: GenerationRecord | None = None,
    barriers: dict[str, dict[str, Any]] | None = None,
    members: dict[str, dict[str, Any]] | None = None,
    failed: frozenset[str] = frozenset(),
    follows: bool = True,
    spec: Any = LEADER_SPEC,
) -> LeaderObservation:
    """The leader n0's observation at `now_s`; it follows `record`'s generation."""
    members = MEMBERS if members is None else members
    current = tuple(sorted(record.planned_nodes)) if record is not None else None
    view = ClusterView(members, frozenset(), current, failed, now_s, last_join_s=0.0)
    followed = record if follows else None
    return LeaderObservation(
        now_s=now_s,
        wall_s=WALL + now_s,
        node_id="n0",
        view=view,
        record=record,
        record_rev=7,
        members=members,
        barriers=barriers or {},
        detected=({}, {}),
        followed=followed,
        followed_plan=Plan.from_dict(followed.plan) if followed is not None else None,
        spec=spec,
        store_address="h:1",
    )


def holdings_of(node: str, step: int, units: tuple[str, ...] | None = None) -> dict[str, Any]:
    """What `node` reports at stopped-G: its own `step` of `units` (all by default)."""
    units = LEADER_SPEC.model.units if units is None else units
    pieces = {PieceKey(u, 0, 1).filename: PieceInfo(10, "ab" * 32) for u in units}
    holding = StepHolding(node, step, LEADER_SPEC.model.units, pieces, generation=1)
    return NodeHoldings(node, {(node, step): holding}).to_dict()
