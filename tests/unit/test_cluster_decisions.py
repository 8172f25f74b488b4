"""Pure parts of the cluster layer: decisions, key layout, records. No etcd."""

from __future__ import annotations

import json

import pytest

from elasticpp.cluster.decisions import (
    live_nodes,
    missing_arrivals,
    newest_common_step,
    ring_order,
    ring_successor,
)
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.keys import JobKeys, last_segment, prefix_end
from elasticpp.cluster.records import GenerationRecord, loads
from elasticpp.errors import ConfigError


def test_ring_order_is_natural_and_deduplicated() -> None:
    assert ring_order(["node-10", "node-2", "node-1", "node-2"]) == ["node-1", "node-2", "node-10"]
    assert ring_order(["b", "a10", "a9"]) == ["a9", "a10", "b"]


def test_ring_successor_wraps_and_handles_absent_and_lonely_nodes() -> None:
    nodes = ["n1", "n2", "n3"]
    assert ring_successor("n1", nodes) == "n2"
    assert ring_successor("n3", nodes) == "n1"
    assert ring_successor("n2", ["n1", "n3"]) == "n3"  # n2 left: its successor still exists
    assert ring_successor("n1", ["n1"]) is None
    assert ring_successor("n1", []) is None


def test_live_nodes_drops_suspects_unless_a_probe_confirmed_them() -> None:
    members = {"n3": {}, "n1": {}, "n2": {}}
    assert live_nodes(members) == ["n1", "n2", "n3"]
    assert live_nodes(members, suspects=["n2", "n9"]) == ["n1", "n3"]
    assert live_nodes(members, suspects=["n2"], confirmed_alive=["n2"]) == ["n1", "n2", "n3"]


def test_barrier_and_commit_helpers() -> None:
    assert missing_arrivals(["n1", "n2", "n10"], ["n2"]) == ["n1", "n10"]
    assert newest_common_step({"n1": 7, "n2": 5}, ["n1", "n2"]) == 5
    assert newest_common_step({"n1": 7}, ["n1", "n2"]) is None
    assert newest_common_step({"n1": 7}, []) is None


def test_key_layout_is_under_one_job_root_and_refuses_slashes() -> None:
    keys = JobKeys("job-a")
    assert keys.node("n1") == "/elasticpp/job-a/nodes/n1"
    assert keys.leader == "/elasticpp/job-a/leader"
    assert keys.generation_history(12) == "/elasticpp/job-a/generations/000000000012"
    assert keys.commit(3, "n1") == "/elasticpp/job-a/commits/000000000003/n1"
    assert keys.barrier("gen3-stopped", "n2") == "/elasticpp/job-a/barriers/gen3-stopped/n2"
    assert last_segment(keys.node("n7")) == "n7"
    assert prefix_end("/a/") == "/a0"
    with pytest.raises(ConfigError, match="node_id"):
        keys.node("a/b")
    with pytest.raises(ConfigError, match="job"):
        JobKeys("")


def test_generation_record_round_trips_as_versioned_json() -> None:
    record = GenerationRecord(
        generation=4,
        plan={"layout": {"pp": 2}},
        leader="n1",
        created_at=1.5,
        resume_step=17,
        store_address="127.0.0.1:9",
        extra={"reason": "node n3 lost"},
    )
    text = record.to_json()
    assert json.loads(text)["format_version"] == 1
    assert GenerationRecord.from_json(text) == record


def test_records_of_unknown_format_or_bad_fields_are_refused() -> None:
    with pytest.raises(ClusterDataError, match="format_version"):
        loads(json.dumps({"format_version": 99}), "x")
    with pytest.raises(ClusterDataError, match="not JSON"):
        loads("{", "x")
    bad = json.dumps({"format_version": 1, "generation": 0, "plan": {}, "leader": "n1"})
    with pytest.raises(ClusterDataError, match="generation"):
        GenerationRecord.from_json(bad)
    missing = json.dumps({"format_version": 1, "generation": 1, "plan": {}})
    with pytest.raises(ClusterDataError, match="bad field"):
        GenerationRecord.from_json(missing)
