"""The resolver that scales returns exactly what the straightforward one did.

`bench/resolve_reference.py` keeps the O(ranks x pieces x candidates) resolver as the oracle.
Seeded random cases cover what changes a choice: tp sizes that need resharding, replicas
(of the target node's own steps too), several steps and commits, another model's steps, dead
nodes, pieces missing, the checkpoint on disk (two origins of one step), equal sizes that
leave the least-loaded source to the tie-break. Every case resolves to the same `ResumePlan`
or fails with the same message.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.resolve import scene
from bench.resolve_reference import resolve_reference
from elasticpp.errors import StateUnavailableError
from elasticpp.plan import load_model_spec
from elasticpp.plan.layout import Layout, Plan
from elasticpp.store.holdings import NodeHoldings
from elasticpp.store.resolver import FetchKind, ResumePlan, resolve
from tests.records import resolver_case as _case

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
