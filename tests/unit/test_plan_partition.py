"""Cost-balanced stages: exact min-max, contiguous, every block in exactly one stage."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpp.errors import PlanError
from elasticpp.plan import balanced_stages


def _bottleneck(counts, cost, first_extra, last_extra):
    loads = [n * cost for n in counts]
    loads[0] += first_extra
    loads[-1] += last_extra
    return max(loads)


def _brute_force(layers, pp, cost, first_extra, last_extra):
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), pp - 1):
        edges = (0, *cuts, layers)
        counts = [b - a for a, b in itertools.pairwise(edges)]
        best = min(best, _bottleneck(counts, cost, first_extra, last_extra))
    return best


@settings(max_examples=300, deadline=None)
@given(
    layers=st.integers(1, 11),
    data=st.data(),
    cost=st.floats(0.01, 10.0),
    first_extra=st.one_of(st.just(0.0), st.floats(0.0, 40.0)),
    last_extra=st.one_of(st.just(0.0), st.floats(0.0, 40.0)),
)
def test_balanced_stages_reach_the_brute_force_optimum(layers, data, cost, first_extra, last_extra):
    pp = data.draw(st.integers(1, layers))
    stages = balanced_stages(layers, pp, cost, first_extra, last_extra)
    assert len(stages) == pp
    assert stages[0][0] == 0 and stages[-1][1] == layers
    assert all(a < b for a, b in stages)
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(stages))
    counts = [b - a for a, b in stages]
    got = _bottleneck(counts, cost, first_extra, last_extra)
    assert got == pytest.approx(_brute_force(layers, pp, cost, first_extra, last_extra), rel=1e-9)


def test_even_costs_give_the_remainder_to_the_first_stage():
    # 1F1B keeps the most micro-batches alive on stage 0, so it gets the fewest blocks
    assert balanced_stages(10, 3, 1.0) == ((0, 2), (2, 6), (6, 10))
    assert balanced_stages(96, 16, 1.0) == tuple((6 * i, 6 * i + 6) for i in range(16))


def test_a_heavy_head_takes_blocks_off_the_last_stage():
    assert balanced_stages(8, 2, 1.0, 0.0, 2.0) == ((0, 5), (5, 8))
    assert balanced_stages(8, 2, 1.0, 0.0, 100.0) == ((0, 7), (7, 8))


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PlanError, match="at most one stage a layer"):
        balanced_stages(4, 5, 1.0)
