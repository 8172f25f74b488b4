"""The holdings digest a node publishes at stopped-G (elasticpp.store.digest): what it says,
how it is refused, and that the detail the leader pulls by it resolves exactly as
everything held would."""

from __future__ import annotations

import json

import pytest

from bench.records import MODELS, holdings, make_plan, node_ids
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.cluster.barriers import DIGEST_FORMAT as CLUSTER_DIGEST_FORMAT
from elasticpp.cluster.barriers import check_arrival
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.errors import ConfigError, StateUnavailableError
from elasticpp.store.digest import (
    DIGEST_FORMAT,
    HoldingsDigest,
    digest_of,
    pull_wants,
    restricted,
    units_fingerprint,
)
from elasticpp.store.holdings import NodeHoldings, PieceInfo, StepHolding
from elasticpp.store.resolver import ResumePlan, resolve
from tests.records import resolver_case as _case

UNITS = ("embed", "layer0", "layer1", "head")
INFO = PieceInfo(10, "ab" * 32)


def _step(origin: str, step: int, names: list[str], generation: int = 3) -> StepHolding:
    return StepHolding(origin, step, UNITS, dict.fromkeys(names, INFO), generation, 1)


def _names(units: tuple[str, ...], ranks: range, size: int) -> list[str]:
    return [PieceKey(u, r, size).filename for u in units for r in ranks]


def test_a_digest_names_steps_as_runs_and_coverage_as_unit_runs_with_rank_masks() -> None:
    own = _names(UNITS[:2], range(2), 2)
    held = NodeHoldings(
        "n0",
        {("n0", s): _step("n0", s, own) for s in (10, 9, 8, 7)}
        | {("n1", s): _step("n1", s, _names(UNITS[2:], range(1), 2)) for s in (10, 5, 0)},
    )
    digest = digest_of(held, "10.0.0.1:7070")
    fp = units_fingerprint(UNITS)
    by_coverage = {g.coverage: g for g in digest.groups}
    mine = by_coverage[((0, 2, 2, 0b11),)]
    assert (mine.epoch, mine.generation, mine.units) == (1, 3, fp)
    assert mine.steps == ((10, 4, 1),) and mine.step_numbers() == [10, 9, 8, 7]
    replica = by_coverage[((2, 2, 2, 0b01),)]
    assert replica.steps == ((10, 3, 5),) and replica.step_numbers() == [10, 5, 0]
    # Round trip through JSON, as etcd carries it.
    again = HoldingsDigest.from_dict(json.loads(json.dumps(digest.to_dict())))
    assert again == digest


def test_a_digest_of_another_format_or_malformed_is_refused_by_name() -> None:
    good = digest_of(
        NodeHoldings("n0", {("n0", 1): _step("n0", 1, ["embed.tp0-1.safetensors"])}), "h:1"
    )
    data = good.to_dict()
    assert DIGEST_FORMAT == CLUSTER_DIGEST_FORMAT
    with pytest.raises(
        ConfigError, match=r"format 2 is not 1 \(written by an agent of another release"
    ):
        HoldingsDigest.from_dict({**data, "format": 2})
    with pytest.raises(ClusterDataError, match="holdings digest format 2 is not 1"):
        check_arrival(
            "stopped-4", "n0", {"digest": {**data, "format": 2}, "at": 1.0, "next_step": 1}
        )
    assert check_arrival("stopped-4", "n0", {"digest": data, "at": 1.0, "next_step": 1})
    with pytest.raises(ClusterDataError, match="needs a holdings digest"):
        check_arrival("stopped-4", "n0", {"at": 1.0, "next_step": 1})
    for held, match in (
        ([[1, 3, "fp", [[0, 1, 2, 4]], [[5, 1, 1]]]], "past tp size 2"),
        ([[1, 3, "fp", [[0, 1, 2, 1]], [[5, 9, 1]]]], "below 0"),
        ([[1, 3, "fp", [[0, 1, 2, 1]], [[9, 10**9, 1]]]], "too many"),
        ([[1, 3, "fp", [[-1, 1, 2, 1]], [[5, 1, 1]]]], "unit index"),
        ([[1, 3, "fp"]], "malformed"),
    ):
        with pytest.raises(ConfigError, match=match):
            HoldingsDigest.from_dict({**data, "held": held})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        HoldingsDigest.from_dict({**data, "address": "nowhere"})


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.label)
def test_a_digest_is_a_few_hundred_bytes_where_the_holdings_were_about_100_kib(model) -> None:
    nodes = node_ids(64)
    plan = make_plan(model, nodes, 41)
    held = holdings(plan, nodes[5], nodes[4])  # 4 own steps, 4 replica steps
    digest = json.dumps(digest_of(held, "10.0.5.17:7070").to_dict())
    assert len(digest) < 300 < 90_000 < len(held.to_json())


def test_the_leader_pulls_only_the_steps_the_resume_can_reach_and_only_from_their_holders() -> None:
    whole = _names(UNITS, range(1), 1)
    half = _names(UNITS[:2], range(1), 1)
    digests = {
        # step 12 is newest but n1 holds only half of it; step 11 is whole on n0
        "n0": digest_of(
            NodeHoldings(
                "n0", {("n0", 11): _step("n0", 11, whole), ("n0", 9): _step("n0", 9, whole)}
            ),
            "h:1",
        ),
        "n1": digest_of(
            NodeHoldings(
                "n1", {("n1", 12): _step("n1", 12, half), ("n1", 11): _step("n1", 11, half)}
            ),
            "h:2",
        ),
        "n2": digest_of(NodeHoldings("n2", {("n2", 9): _step("n2", 9, whole)}), "h:3"),
        "dead": digest_of(NodeHoldings("dead", {("dead", 12): _step("dead", 12, whole)}), "h:4"),
    }
    wants = pull_wants(digests, UNITS, ["n0", "n1", "n2"])
    assert wants.resumable == 11 and wants.held
    assert wants.steps == {"n0": (11,), "n1": (12, 11)}  # n2 holds only step 9: never asked
    # Another model's steps are never wanted; nothing complete: every step of the model.
    other = pull_wants(digests, ("a", "b"), ["n0", "n1", "n2"])
    assert other.steps == {} and other.held and other.resumable is None
    partial = pull_wants({"n1": digests["n1"]}, UNITS, ["n1"])
    assert partial.steps == {"n1": (12, 11)} and partial.resumable is None


@pytest.mark.parametrize("block", range(4))
def test_resolving_the_pulled_detail_chooses_what_resolving_everything_would(block: int) -> None:
    """Seeded random cases of the resolver's own oracle test: several steps and commits,
    replicas, another model's steps, dead nodes, missing slices, the checkpoint on disk."""
    resolved = 0
    for seed in range(block * 100, block * 100 + 100):
        held, target, live, disk = _case(seed)
        digests = {n: digest_of(h, "h:1") for n, h in held.items()}
        wants = pull_wants(digests, target.model.units, live, disk)
        pulled = {n: restricted(held[n], steps) for n, steps in wants.steps.items()}
        try:
            want: ResumePlan | None = resolve(held, target, live_nodes=live, disk=disk)
        except StateUnavailableError:
            want = None
        try:
            got: ResumePlan | None = resolve(pulled, target, live_nodes=live, disk=disk)
        except StateUnavailableError:
            got = None
        assert got == want, f"seed {seed}"
        assert wants.held == any(held[n].steps for n in live if n in held), f"seed {seed}"
        assert (wants.resumable is None) == (want is None) or disk is not None, f"seed {seed}"
        resolved += want is not None
    assert 20 < resolved < 100
