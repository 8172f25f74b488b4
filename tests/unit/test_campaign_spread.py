"""How long a node that sees no leader waits before it campaigns (leaderstate.campaign_delay_s):
within a spread that grows with the job's nodes up to a ceiling, so that a leader's loss does
not make every node of a large job campaign at once, and a small job elects at once."""

from __future__ import annotations

import pytest

from elasticpp.agent.leader.state import (
    CAMPAIGN_SPREAD_MAX_S,
    CAMPAIGN_SPREAD_S_PER_NODE,
    campaign_delay_s,
)


def test_a_small_job_campaigns_within_milliseconds() -> None:
    assert campaign_delay_s(1, 0.999) < 0.01
    assert campaign_delay_s(4, 0.999) < 0.02
    assert campaign_delay_s(0, 0.5) == 0.5 * CAMPAIGN_SPREAD_S_PER_NODE  # no record yet


def test_the_spread_grows_with_the_nodes_up_to_its_ceiling() -> None:
    assert campaign_delay_s(100, 0.5) == pytest.approx(0.5 * 100 * CAMPAIGN_SPREAD_S_PER_NODE)
    assert campaign_delay_s(2048, 0.999) <= CAMPAIGN_SPREAD_MAX_S
    assert campaign_delay_s(16384, 0.5) == pytest.approx(0.5 * CAMPAIGN_SPREAD_MAX_S)
    assert campaign_delay_s(2048, 0.0) == 0.0


@pytest.mark.parametrize("nodes", [1024, 2048])
def test_few_of_many_nodes_draw_a_turn_before_the_first_ones_key_is_seen(nodes: int) -> None:
    """With draws spread evenly, the nodes whose turn comes within 250 ms of the first (a
    watch event's way to every node of a loaded cluster) are ~60, not every node; the
    first turn comes within milliseconds all the same."""
    delays = sorted(campaign_delay_s(nodes, i / nodes) for i in range(nodes))
    early = sum(d - delays[0] < 0.25 for d in delays)
    assert early <= 0.065 * nodes
    assert delays[1] < 0.005  # the second of the even draws: 1/N of the spread


@pytest.mark.parametrize("draw", [-0.1, 1.0, 2.0])
def test_a_draw_outside_0_1_is_refused(draw: float) -> None:
    with pytest.raises(ValueError, match="must be in"):
        campaign_delay_s(8, draw)
