"""The resolver that scales returns exactly what the straightforward one did.

`bench/resolve_reference.py` keeps the O(ranks x pieces x candidates) resolver as the oracle.
Seeded random cases cover what changes a choice: tp sizes that need resharding, replicas
(of the target node's own steps too), several steps and commits, another model's steps, dead
nodes, pieces missing, the checkpoint on disk (two origins of one step), equal sizes that
leave the least-loaded source to the tie-break. Every case resolves to the same `ResumePlan`
or fails with the same message.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from bench.resolve import scene
from bench.resolve_reference import resolve_reference
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.errors import PlanError, StateUnavailableError
from elasticpp.plan import load_model_spec
from elasticpp.plan.layout import Layout, Plan, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS, ClusterSpec, ModelSpec, NodeSpec
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings, PieceInfo, StepHolding
from elasticpp.store.resolver import FetchKind, ResumePlan, resolve

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


def _case(
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


Resolver = Callable[..., ResumePlan]


def _outcome(
    fn: Resolver,
    holdings: dict[str, NodeHoldings],
    target: Plan,
    live: list[str],
    disk: NodeHoldings | None,
) -> ResumePlan | str:
    try:
        return fn(holdings, target, live_nodes=live, disk=disk)
    except StateUnavailableError as exc:
        return f"StateUnavailableError: {exc}"


@pytest.mark.parametrize("block", range(8))
def test_the_fast_resolver_equals_the_reference_on_random_cases(block: int) -> None:
    kinds: set[FetchKind] = set()
    resolved = 0
    for seed in range(block * 100, block * 100 + 100):
        holdings, target, live, disk = _case(seed)
        want = _outcome(resolve_reference, holdings, target, live, disk)
        got = _outcome(resolve, holdings, target, live, disk)
        assert got == want, f"seed {seed}"
        if isinstance(want, ResumePlan):
            resolved += 1
            kinds |= {f.kind for fs in want.fetches.values() for f in fs}
    # the cases exercise every kind of source, and both outcomes
    assert kinds == set(FetchKind) and 20 < resolved < 100


def test_the_fast_resolver_equals_the_reference_at_512_nodes() -> None:
    sc = scene(load_model_spec("llama-70b"), Layout(16, 8, 32), 512)
    want = resolve_reference(sc.holdings, sc.target, live_nodes=sc.live)
    got = resolve(sc.holdings, sc.target, live_nodes=sc.live)
    assert got == want
    # the spare takes the lost node's stage from its data-parallel twins
    assert {f.kind for f in got.node_fetches("spare")} == {FetchKind.PEER}
    others = {f.kind for r, fs in got.fetches.items() if got.rank_nodes[r] != "spare" for f in fs}
    assert others == {FetchKind.LOCAL}
