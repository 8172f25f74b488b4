"""Records, jobs and cases the cluster, resolver, security and packaging tests share."""

from __future__ import annotations

import random
from typing import Any

from elasticpp.agent.jobspec import parse_job_spec
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.cluster.records import (
    GenerationRecord,
    node_fields,
)
from elasticpp.errors import PlanError
from elasticpp.plan import ClusterSpec, Layout, NodeSpec, build_plan, load_model_spec
from elasticpp.plan.layout import Plan
from elasticpp.plan.specs import DEVICE_PRESETS, ModelSpec
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings, PieceInfo, StepHolding


def record_of(nodes: list[str], gpus: int, **extra: object) -> GenerationRecord:
    """A record as the leader writes it: `nodes` planned, the first `gpus // 4` with ranks."""
    cluster = ClusterSpec(tuple(NodeSpec(n, 4) for n in nodes), DEVICE_PRESETS["h100-80g"])
    layout = Layout(1, 4, gpus // 4)
    plan = build_plan(load_model_spec("tiny"), cluster, layout, global_batch=8, micro_batch=1)
    fields = node_fields(plan.to_dict(), nodes, {n: f"inc-{n}" for n in nodes})
    return GenerationRecord(3, plan.to_dict(), "n0", 1.0, extra={**fields, **extra})


SPEC_FIELDS: dict[str, Any] = {
    "name": "j",
    "model": "tiny",
    "global_batch": 4,
    "micro_batch": 2,
    "steps": 5,
    "seed": 0,
    "min_nodes": 1,
    "max_nodes": 1,
}


SECURITY_SPEC = parse_job_spec(SPEC_FIELDS)


OTHER = ModelSpec("o", num_layers=2, hidden_size=16, num_heads=4, vocab_size=32, seq_len=8)


TP_SIZES = (1, 2, 4)


def _model(rng: random.Random) -> ModelSpec:
    layers = rng.randint(1, 5)
    return ModelSpec("t", num_layers=layers, hidden_size=16, num_heads=4, vocab_size=32, seq_len=8)


def _pieces(rng: random.Random, units: tuple[str, ...], drop: float) -> dict[str, PieceInfo]:
    """Some units at some tp sizes, a few slices missing; sizes few so that loads tie."""
    out: dict[str, PieceInfo] = {}
    sizes = rng.sample(TP_SIZES, rng.randint(1, 2))
    for unit in units:
        if rng.random() < 0.3:
            continue
        for size in sizes:
            for r in range(size):
                if rng.random() >= drop:
                    sha = f"{unit}{r}{size}{rng.randint(0, 1)}".ljust(64, "0")
                    out[PieceKey(unit, r, size).filename] = PieceInfo(rng.choice((0, 10, 20)), sha)
    return out


def _holding(rng: random.Random, model: ModelSpec, origin: str, step: int) -> StepHolding:
    units = OTHER.units if rng.random() < 0.05 else model.units
    pieces = _pieces(rng, units, drop=rng.choice((0.0, 0.0, 0.1)))
    return StepHolding(origin, step, units, pieces, rng.randint(0, 2), rng.randint(0, 1))


def resolver_case(
    seed: int,
) -> tuple[dict[str, NodeHoldings], Plan, list[str], NodeHoldings | None]:
    rng = random.Random(seed)
    model = _model(rng)
    old = [f"n{i}" for i in range(rng.randint(1, 6))]
    steps = rng.sample(range(1, 6), rng.randint(1, 3))
    holdings = {}
    for node in old:
        held = {}
        for step in steps:
            if rng.random() < 0.8:
                held[(node, step)] = _holding(rng, model, node, step)
            for origin in rng.sample([*old, "new0"], rng.randint(0, 2)):
                if origin != node:
                    held[(origin, step)] = _holding(rng, model, origin, step)
        holdings[node] = NodeHoldings(node, held)
    disk = None
    if rng.random() < 0.5:
        step = rng.choice(steps)
        disk = NodeHoldings(
            DISK_SOURCE,
            {(o, step): _holding(rng, model, o, step) for o in rng.sample(old, min(2, len(old)))},
        )
    live = [n for n in old if rng.random() < 0.8]
    nodes = {n: rng.choice((1, 2, 4)) for n in rng.sample(live, rng.randint(0, len(live)))}
    for i in range(rng.randint(0 if nodes else 1, 2)):
        nodes[f"new{i}"] = rng.choice((1, 2, 4))
        live.append(f"new{i}")
    cluster = ClusterSpec(
        tuple(NodeSpec(n, g) for n, g in rng.sample(sorted(nodes.items()), len(nodes))),
        DEVICE_PRESETS["cpu"],
    )
    gpus = sum(nodes.values())
    while True:
        tp = rng.choice([t for t in TP_SIZES if t <= max(nodes.values())])
        pp = rng.randint(1, min(model.num_layers, max(1, gpus // tp)))
        dp = rng.randint(1, max(1, gpus // (tp * pp)))
        try:
            target = build_plan(model, cluster, Layout(pp, tp, dp), global_batch=dp, micro_batch=1)
            break
        except PlanError:
            continue
    rng.shuffle(live)
    return holdings, target.with_generation(rng.randint(1, 9)), live, disk


# The SHA-256 of the Apache License 2.0 as the ASF publishes it
# (https://www.apache.org/licenses/LICENSE-2.0.txt), byte for byte.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
