"""The resolver: which step to resume from and where each rank's pieces come from."""

from __future__ import annotations

import pytest

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.errors import StateUnavailableError
from elasticpp.plan.layout import Layout, Plan, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS, ClusterSpec, ModelSpec, NodeSpec
from elasticpp.store.holdings import NodeHoldings, PieceInfo, StepHolding
from elasticpp.store.resolver import DISK_SOURCE, FetchKind, resolve

MODEL = ModelSpec("t", num_layers=4, hidden_size=16, num_heads=4, vocab_size=32, seq_len=8)
ALL_UNITS = MODEL.units


def plan(nodes: dict[str, int], layout: str, generation: int = 7) -> Plan:
    cluster = ClusterSpec(tuple(NodeSpec(n, g) for n, g in nodes.items()), DEVICE_PRESETS["cpu"])
    p = build_plan(MODEL, cluster, Layout.parse(layout), global_batch=8, micro_batch=1)
    return p.with_generation(generation)


def pieces(units: list[str], tp: int, size: int = 100, tag: str = "") -> dict[str, PieceInfo]:
    return {
        PieceKey(u, r, tp).filename: PieceInfo(size, f"{u}{r}{tp}{tag}".ljust(64, "0"))
        for u in units
        for r in range(tp)
    }


def holds(node: str, *entries: tuple[str, int, dict[str, PieceInfo]]) -> NodeHoldings:
    return NodeHoldings(
        node,
        {(o, s): StepHolding(o, s, MODEL.units, p) for o, s, p in entries},
    )


STAGE0 = ["embed", "block.0000", "block.0001"]
STAGE1 = ["block.0002", "block.0003", "head"]


def old_pp2_dp2_holdings(step: int = 5) -> dict[str, NodeHoldings]:
    """Old plan pp=2, dp=2, tp=1 on a, b, c, d (a/c stage 0, b/d stage 1); ring replicas."""
    s0, s1 = pieces(STAGE0, 1), pieces(STAGE1, 1)
    return {
        "a": holds("a", ("a", step, s0), ("d", step, s1)),
        "b": holds("b", ("b", step, s1), ("a", step, s0)),
        "c": holds("c", ("c", step, s0), ("b", step, s1)),
        "d": holds("d", ("d", step, s1), ("c", step, s0)),
    }


def kinds_of(rp, rank: int) -> set[FetchKind]:
    return {f.kind for f in rp.fetches[rank]}


def test_resolver_takes_local_pieces_when_the_node_held_them():
    target = plan({"a": 1, "b": 1}, "pp=2")
    rp = resolve(old_pp2_dp2_holdings(), target, live_nodes="abcd")
    assert rp.step == 5 and rp.generation == 7
    # rank 0 (stage 0) on a, rank 1 (stage 1) on b: both had their stage.
    assert kinds_of(rp, 0) == {FetchKind.LOCAL} and kinds_of(rp, 1) == {FetchKind.LOCAL}
    assert all(f.origin_node == "a" for f in rp.fetches[0])
    assert [PieceKey.parse(f.piece_name).unit for f in rp.fetches[1]] == STAGE1


def test_resolver_prefers_dp_twin_over_peer_replica():
    # a died. The new node e runs stage 0: c (a's data-parallel twin) has it as its own,
    # b has a replica of a's. The twin wins.
    target = plan({"e": 1, "b": 1}, "pp=2")
    rp = resolve(old_pp2_dp2_holdings(), target, live_nodes=["b", "c", "d", "e"])
    assert {(f.source_node, f.kind) for f in rp.fetches[0]} == {("c", FetchKind.PEER)}


def test_resolver_uses_replica_when_twin_is_dead_too():
    target = plan({"e": 1, "b": 1}, "pp=2")
    rp = resolve(old_pp2_dp2_holdings(), target, live_nodes=["b", "d", "e"])
    # a and c (both stage-0 holders) are dead; b keeps a's replica, d keeps c's.
    stage0 = rp.fetches[0]
    assert {f.kind for f in stage0} == {FetchKind.REPLICA}
    assert {(f.source_node, f.origin_node) for f in stage0} <= {("b", "a"), ("d", "c")}


def test_resolver_falls_back_to_disk_when_no_live_node_has_a_unit():
    holdings = old_pp2_dp2_holdings(step=5)
    disk = holds(DISK_SOURCE, (DISK_SOURCE, 4, pieces(ALL_UNITS, 2)))
    target = plan({"b": 1, "d": 1}, "pp=2")
    rp = resolve(holdings, target, live_nodes=["b", "d"], disk=disk)
    # Live holdings of step 5: b has stage 1 own + a's stage 0 replica, d has stage 1 own +
    # c's stage 0 replica: everything, so disk is not needed.
    assert rp.step == 5 and rp.counts()[FetchKind.DISK] == 0
    # Now only b lives: it has stage 1 and a replica of stage 0: still step 5.
    only_b = plan({"b": 2}, "pp=2")
    assert resolve(holdings, only_b, live_nodes=["b"], disk=disk).step == 5
    # Both stage-0 sources dead and their replicas too: the disk's step 4.
    stage1_only = {"d": holds("d", ("d", 5, pieces(STAGE1, 1)))}
    rp = resolve(stage1_only, plan({"d": 2}, "pp=2"), live_nodes=["d"], disk=disk)
    assert rp.step == 4
    assert {f.kind for fs in rp.fetches.values() for f in fs} == {FetchKind.DISK}
    assert all(f.source_node == DISK_SOURCE for fs in rp.fetches.values() for f in fs)


def test_resolver_raises_naming_missing_units_when_nothing_is_complete():
    stage1_only = {"d": holds("d", ("d", 5, pieces(STAGE1, 1)))}
    with pytest.raises(StateUnavailableError, match=r"step 5.*embed, block\.0000, block\.0001"):
        resolve(stage1_only, plan({"d": 2}, "pp=2"), live_nodes=["d"])
    with pytest.raises(StateUnavailableError, match="no committed state"):
        resolve({}, plan({"d": 2}, "pp=2"), live_nodes=["d"])
    # A dead node's holdings count for nothing.
    with pytest.raises(StateUnavailableError, match="no committed state"):
        resolve(old_pp2_dp2_holdings(), plan({"e": 2}, "pp=2"), live_nodes=["e"])


def test_resolver_reshards_tp2_to_tp1_with_both_slices():
    held = {"a": holds("a", ("a", 3, pieces(ALL_UNITS, 2)))}
    target = plan({"b": 2}, "pp=2,tp=1")
    rp = resolve(held, target, live_nodes=["a", "b"])
    for rank in (0, 1):
        names = [f.piece_name for f in rp.fetches[rank]]
        units = MODEL.stage_units(target.stages, target.slot(rank).coord.pp)
        assert names == [PieceKey(u, r, 2).filename for u in units for r in (0, 1)]
        assert kinds_of(rp, rank) == {FetchKind.PEER}


def test_resolver_takes_exact_slice_when_target_tp_is_available():
    held = {"a": holds("a", ("a", 3, {**pieces(ALL_UNITS, 2), **pieces(ALL_UNITS, 1)}))}
    rp = resolve(held, plan({"b": 2}, "tp=2"), live_nodes=["a", "b"])
    assert [f.piece_name for f in rp.fetches[1]] == [PieceKey(u, 1, 2).filename for u in ALL_UNITS]
    # tp=1 -> tp=2: each rank takes the whole unit.
    whole = {"a": holds("a", ("a", 3, pieces(ALL_UNITS, 1)))}
    rp = resolve(whole, plan({"b": 2}, "tp=2"), live_nodes=["a", "b"])
    assert [f.piece_name for f in rp.fetches[1]] == [PieceKey(u, 0, 1).filename for u in ALL_UNITS]


def test_resolver_spreads_load_over_sources_deterministically():
    full = pieces(ALL_UNITS, 1)
    held = {n: holds(n, (n, 9, full)) for n in ("a", "b", "c")}
    target = plan({"z": 1}, "pp=1")
    rp = resolve(held, target, live_nodes=["a", "b", "c", "z"])
    sources = [f.source_node for f in rp.fetches[0]]
    assert len(sources) == len(ALL_UNITS) == 6
    assert sorted(sources.count(n) for n in "abc") == [2, 2, 2]
    assert rp == resolve(held, target, live_nodes=["z", "c", "b", "a"])


def test_resolver_chooses_newest_complete_step_over_newer_incomplete_one():
    held = {
        "a": holds(
            "a",
            ("a", 10, pieces(STAGE0, 1)),  # step 10: the stage-1 holder died before replicating
            ("a", 9, pieces(ALL_UNITS, 1)),
        )
    }
    rp = resolve(held, plan({"a": 1}, "pp=1"), live_nodes=["a"])
    assert rp.step == 9
    assert kinds_of(rp, 0) == {FetchKind.LOCAL}


def test_resolver_shares_one_transfer_between_ranks_on_a_node():
    held = {"a": holds("a", ("a", 2, pieces(ALL_UNITS, 1)))}
    target = plan({"b": 2}, "pp=1,dp=2")
    rp = resolve(held, target, live_nodes=["a", "b"])
    assert rp.fetches[0] == rp.fetches[1]
    assert len(rp.node_fetches("b")) == len(ALL_UNITS)
    assert rp.bytes_moved() == 100 * len(ALL_UNITS)
    assert "step 2" in rp.describe()


def test_resolver_ignores_state_of_another_model():
    other = NodeHoldings("a", {("a", 8): StepHolding("a", 8, 99, pieces(ALL_UNITS, 1))})
    held = {"a": other, "b": holds("b", ("b", 7, pieces(ALL_UNITS, 1)))}
    assert resolve(held, plan({"b": 1}, "pp=1"), live_nodes=["a", "b"]).step == 7


def test_resolver_prefers_own_step_over_replica_on_the_same_node():
    full = pieces(ALL_UNITS, 1)
    held = {"a": holds("a", ("a", 4, full), ("b", 4, full))}
    rp = resolve(held, plan({"a": 1}, "pp=1"), live_nodes=["a"])
    assert {(f.origin_node, f.kind) for f in rp.fetches[0]} == {("a", FetchKind.LOCAL)}


def test_resolver_prefers_the_new_epochs_step_over_a_higher_numbered_one_of_an_older_epoch():
    # A node away during an etcd wipe comes back with step 120 of the old epoch; the job
    # resumed from 101 in the new epoch and committed 105 since: 105 is the job's newest.
    def held(node: str, step: int, epoch: int, generation: int) -> NodeHoldings:
        return NodeHoldings(
            node,
            {
                (node, step): StepHolding(
                    node, step, MODEL.units, pieces(ALL_UNITS, 1), generation, epoch
                )
            },
        )

    target = plan({"a": 1, "b": 1}, "dp=2", generation=2)
    holdings = {"a": held("a", 120, 1, 9), "b": held("b", 105, 2, 1)}
    assert resolve(holdings, target, live_nodes="ab").step == 105
    # Before the new epoch committed anything, the old epoch's newest state is resumed.
    holdings = {"a": held("a", 120, 1, 9), "b": held("b", 101, 1, 9)}
    assert resolve(holdings, target, live_nodes="ab").step == 120
