"""The safe step (a step that survives any single node loss) from what nodes report, and the
commit records it is computed from. Pure: no etcd, no stores."""

from __future__ import annotations

import pytest

from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.records import ANCHORS_REPORTED, CommitRecord, SafeStep
from elasticpp.store.replicate import replica_holders, safe_step

RING = ["a", "b", "c"]


def test_safe_is_the_newest_step_held_own_and_by_every_replica_holder():
    own = {"a": [40, 41, 42], "b": [40, 41, 42], "c": [40, 41, 42]}
    replicas = {"b": {"a": [41, 42]}, "c": {"b": [40, 41]}, "a": {"c": [41]}}
    assert safe_step(RING, 1, RING, own, replicas) == 41


def test_the_ring_wraps_around_the_last_node_is_kept_by_the_first():
    assert replica_holders(RING, "c", 1) == ["a"]
    own = {n: [8, 9] for n in RING}
    replicas = {"b": {"a": [8, 9]}, "c": {"b": [8, 9]}, "a": {"c": [8]}}
    assert safe_step(RING, 1, RING, own, replicas) == 8
    del replicas["a"]  # nobody holds c's steps: c's loss would lose its state
    assert safe_step(RING, 1, RING, own, replicas) is None


def test_two_copies_need_both_holders():
    own = {n: [5, 6] for n in RING}
    replicas = {
        "a": {"b": [5, 6], "c": [5, 6]},
        "b": {"a": [5, 6], "c": [5, 6]},
        "c": {"a": [5, 6], "b": [5]},
    }
    assert replica_holders(RING, "b", 2) == ["c", "a"]
    assert safe_step(RING, 2, RING, own, replicas) == 5


def test_a_node_without_a_record_means_no_safe_step():
    own = {"a": [3], "b": [3]}
    replicas = {"b": {"a": [3]}, "c": {"b": [3]}, "a": {"c": [3]}}
    assert safe_step(RING, 1, RING, own, replicas) is None


def test_nodes_without_state_only_hold_replicas():
    # d is in the ring (it keeps c's steps) but has no ranks, so no own state is needed.
    ring = [*RING, "d"]
    own = {n: [7] for n in RING}
    replicas = {"b": {"a": [7]}, "c": {"b": [7]}, "d": {"c": [7]}}
    assert safe_step(ring, 1, RING, own, replicas) == 7


def test_no_copies_no_guarantee():
    own = {n: [3] for n in RING}
    assert safe_step(RING, 0, RING, own, {}) is None
    assert safe_step(RING, 1, [], own, {}) is None
    assert safe_step(["a"], 1, ["a"], {"a": [3]}, {}) is None  # alone: no peer to hold it


def test_commit_records_round_trip_and_bound_what_they_list():
    record = CommitRecord("n1", 4, 70, tuple(range(70, 30, -1)), {"n0": (70, 69)})
    data = record.to_dict()
    assert len(data["anchors"]) == ANCHORS_REPORTED and data["anchors"][0] == 70
    back = CommitRecord.from_dict(data)
    assert back.anchors == tuple(range(70, 70 - ANCHORS_REPORTED, -1))
    assert back.replicas == {"n0": (70, 69)}
    old = CommitRecord.from_dict({"node_id": "n1", "generation": 4, "step": 9})
    assert old.anchors == () and old.replicas == {}


@pytest.mark.parametrize(
    "data",
    [
        {"generation": 1, "step": 3},
        {"node_id": "n1", "generation": "1", "step": 3},
        {"node_id": "n1", "generation": 1, "step": True},
        {"node_id": "n1", "generation": 1, "step": 3, "anchors": "3"},
        {"node_id": "n1", "generation": 1, "step": 3, "anchors": [3, -2]},
        {"node_id": "n1", "generation": 1, "step": 3, "replicas": [3]},
        {"node_id": "n1", "generation": 1, "step": 3, "replicas": {"n0": [2.5]}},
    ],
)
def test_malformed_commit_records_are_refused_naming_the_field(data):
    with pytest.raises(ClusterDataError, match="commit record"):
        CommitRecord.from_dict(data)


def test_safe_steps_order_like_commits_and_refuse_bad_values():
    assert SafeStep(2, 5) > SafeStep(1, 90) > SafeStep(1, 89)
    assert SafeStep.from_dict({"generation": 2, "step": 5}) == SafeStep(2, 5)
    for bad in ({"generation": 2}, {"generation": 2, "step": -1}, {"generation": "2", "step": 1}):
        with pytest.raises(ClusterDataError, match="safe step"):
            SafeStep.from_dict(bad)
